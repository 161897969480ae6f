"""`PackedLinear`: CPU linears on oneDNN with the weight packed once."""

from __future__ import annotations

import functools
from typing import Optional

import torch


@functools.cache
def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN can pack here: bf16 needs AVX-512 or AVX-NE-CONVERT (not AVX2 alone)."""
    if not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


class PackedLinear(torch.nn.Linear):
    """nn.Linear whose fp32 (and, where oneDNN supports it, bf16) CPU forward runs oneDNN on a
    copy of the weight packed once for it.

    Why: decoding is a stream of 1- to 16-row matmuls over the same weights; oneDNN on a packed
    weight was faster there than MKL's sgemm and than unpacked bf16 matmuls (docs/performance.md).
    oneDNN is also batch invariant: each row's output is bitwise the same whatever the row count
    of the call (MKL's sgemm is not; tested), so the linears do not make a token's logits depend
    on the size of its verify block.
    The packed copy doubles the memory of the linear weights on CPU. It is rebuilt when the
    weight changes (in place or replaced); other dtypes, devices and autograd use F.linear."""

    # oneDNN's expected row count when packing: 4 measured best at 1 row and on par up to 16
    pack_rows_hint = 4
    # Calls with fewer rows are padded with zero rows to this count: oneDNN's 1- and 2-row kernels
    # were slower than its 4-row one for every SmolLM2 shape. Padded rows' outputs are discarded,
    # so each real row is bitwise what it was.
    min_rows = 4

    def _packed_weight(self) -> Optional[torch.Tensor]:
        if torch.compiler.is_compiling():  # inductor cannot lower oneDNN's packed op: its own linears
            return None
        weight = self.weight
        if weight.dtype not in packable_dtypes() or weight.device.type != "cpu":
            return None
        key = (weight.data_ptr(), weight._version)
        if getattr(self, "_packed_key", None) != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.pack_rows_hint)
            self._packed_key = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = None if (torch.is_grad_enabled() and self.weight.requires_grad) else self._packed_weight()
        if packed is None or x.dtype != self.weight.dtype or x.device.type != "cpu":
            return torch.nn.functional.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        num_rows = rows.shape[0]
        if num_rows < self.min_rows:
            rows = torch.cat([rows, rows.new_zeros(self.min_rows - num_rows, rows.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, self.bias, "none", [], "")[:num_rows]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def use_packed_matmul(model: torch.nn.Module) -> None:
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = PackedLinear
            module._packed_weight()  # pack at load, not on the first request
