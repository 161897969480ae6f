"""`PackedLinear`: CPU linears on oneDNN with the weight packed once."""

from __future__ import annotations

import functools
from typing import Optional

import torch

# oneDNN's expected row count when packing: 4 measured best at 1 row and on par up to 16
PACK_ROWS_HINT = 4
MIN_ROWS = 4  # packed_matmul pads calls of fewer rows to this many


@functools.cache
def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN packs and multiplies here, each tried on a small weight: bf16 needs
    AVX-512 or AVX-NE-CONVERT on x86 (not AVX2 alone), and a build or CPU without oneDNN's
    kernels (some aarch64 ones) gets none, so its linears run torch's matmul."""
    if not torch.backends.mkldnn.is_available():
        return ()
    dtypes = []
    for dtype in (torch.float32, torch.bfloat16):
        if dtype is torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            continue
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 32, dtype=dtype), PACK_ROWS_HINT)
            torch.ops.mkldnn._linear_pointwise(torch.ones(MIN_ROWS, 32, dtype=dtype), packed, None, "none", [], "")
        except (RuntimeError, NotImplementedError):
            continue
        dtypes.append(dtype)
    return tuple(dtypes)


class PackedLinear(torch.nn.Linear):
    """nn.Linear whose fp32 (and, where oneDNN supports it, bf16) CPU forward runs oneDNN on a
    copy of the weight packed once for it.

    Why: decoding is a stream of 1- to 16-row matmuls over the same weights; oneDNN on a packed
    weight was faster there than MKL's sgemm and than unpacked bf16 matmuls (docs/architecture.md,
    "Why the CPU kernels").
    oneDNN is also batch invariant: each row's output is bitwise the same whatever the row count
    of the call (MKL's sgemm is not; tested), so the linears do not make a token's logits depend
    on the size of its verify block.
    The packed copy doubles the memory of the linear weights on CPU. It is rebuilt when the
    weight changes (in place or replaced); other dtypes, devices and autograd use F.linear."""

    def _packed_weight(self) -> Optional[torch.Tensor]:
        if torch.compiler.is_compiling():  # inductor cannot lower oneDNN's packed op: its own linears
            return None
        key = (self.weight.data_ptr(), self.weight._version)
        if getattr(self, "_packed_key", None) != key:
            self._packed, self._packed_key = pack_weight(self.weight), key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = None if (torch.is_grad_enabled() and self.weight.requires_grad) else self._packed_weight()
        if packed is None or x.dtype != self.weight.dtype or x.device.type != "cpu":
            return torch.nn.functional.linear(x, self.weight, self.bias)
        out = packed_matmul(x.reshape(-1, x.shape[-1]), packed, self.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def pack_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """oneDNN's packed copy of a CPU weight, or None where oneDNN cannot pack its dtype here."""
    if weight.dtype not in packable_dtypes() or weight.device.type != "cpu":
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def packed_matmul(rows: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """rows [N, in] @ W^T + b on a weight packed by `pack_weight`; calls of fewer than MIN_ROWS
    rows are padded with zero rows to it: oneDNN's 1- and 2-row kernels were slower than its
    4-row one for every SmolLM2 shape. Padded rows' outputs are discarded, so each real row is
    bitwise what it was."""
    num_rows = rows.shape[0]
    if num_rows < MIN_ROWS:
        rows = torch.cat([rows, rows.new_zeros(MIN_ROWS - num_rows, rows.shape[1])])
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")[:num_rows]  # [N, out]


def use_packed_matmul(model: torch.nn.Module) -> None:
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = PackedLinear
            module._packed_weight()  # pack at load, not on the first request
