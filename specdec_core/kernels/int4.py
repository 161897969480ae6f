"""Weight-only int4 linears for CPU drafts (`ModelSpec(dtype="int4")`)."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Sequence, Union

import torch

from .linear import PackedLinear

# Within a forward over several sequences' chunks: which rows run dense (a bool for all of them,
# or a mask); None: by the call's row count
DENSE_ROWS: ContextVar[Union[None, bool, torch.Tensor]] = ContextVar("int4_dense_rows", default=None)


class Int4Linear(torch.nn.Module):
    """Weight-only int4 linear for CPU, as gpt-fast runs int4 on CPU: each group of 32 input
    weights of an output row is stored as 4-bit codes q with a scale and a zero point (asymmetric
    min-max rounding, w ~ (q - 8) * scale + zero), and torch's `_weight_int4pack_mm_for_cpu`
    de-quantizes inside the matmul, in the activations' dtype (bf16 here; its fp32 path is slow).

    Why: a draft's 1-token step is memory-bound, and the int4 kernel reads a quarter of the bf16
    weights' bytes. Its cost grows linearly with the row count, faster than oneDNN's, so calls of
    more than `max_int4_rows` rows run oneDNN on a packed copy of the same de-quantized weights
    instead: one set of weights, two kernels, switched where whole draft forwards cost the same on
    both (docs/performance.md). A checkpoint de-quantized from a Q4_1 GGUF (groups of 32, scale
    and minimum, as the embedded target) comes back close to its own 4-bit codes. The kernel needs
    out_features divisible by 16 and in_features by 32; `quantize_int4` leaves other linears alone.

    In a forward over several sequences' chunks (`kernels_by_chunk`) each row runs the kernel its
    own chunk would alone: both kernels compute a row independently of the others, so a session's
    result does not depend on its batch companions."""

    group_size = 32
    max_int4_rows = 12

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        if not self.supports(linear):
            raise ValueError(f"int4 needs in_features % 32 == 0 and out_features % 16 == 0, got {linear}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dtype = linear.weight.dtype
        groups = linear.weight.detach().float().view(self.out_features, -1, self.group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
        codes_2d = codes.to(torch.int32).view(self.out_features, -1)
        self.register_buffer("packed_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes_2d, 1))
        scales_and_zeros = torch.stack([scale, low + 8 * scale], -1).to(dtype)  # [out, in / 32, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous())  # the kernel's layout
        # the dense copy de-quantizes with the scale and zero as stored, rounded like the kernel's
        scale, zero = scales_and_zeros.float().unbind(-1)
        self.dense = PackedLinear(self.in_features, self.out_features, bias=linear.bias is not None, dtype=dtype)
        with torch.no_grad():
            self.dense.weight.copy_(((codes - 8) * scale[..., None] + zero[..., None]).view_as(linear.weight))
            if linear.bias is not None:
                self.dense.bias.copy_(linear.bias)
        self.dense.requires_grad_(False)._packed_weight()

    @classmethod
    def supports(cls, linear: torch.nn.Linear) -> bool:
        return linear.in_features % cls.group_size == 0 and linear.out_features % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError("int4 linears run on CPU only")
        rows = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype)
        dense_rows = DENSE_ROWS.get()
        if dense_rows is None:  # a plain forward: one kernel by the call's row count
            dense_rows = rows.shape[0] > self.max_int4_rows
        if isinstance(dense_rows, bool):
            out = self.dense(rows) if dense_rows else self.int4(rows)
        else:
            out = rows.new_empty(rows.shape[0], self.out_features)
            out[dense_rows] = self.dense(rows[dense_rows])
            out[~dense_rows] = self.int4(rows[~dense_rows])
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def int4(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed_weight, self.group_size, self.scales_and_zeros
        )
        return out if self.dense.bias is None else out + self.dense.bias


@contextmanager
def kernels_by_chunk(chunk_lengths: Sequence[int]) -> Iterator[None]:
    """Int4 linears in this block pick each row's kernel by the length of its own chunk."""
    long_chunks = [length > Int4Linear.max_int4_rows for length in chunk_lengths]
    if all(long_chunks) or not any(long_chunks):
        dense_rows = long_chunks[0]
    else:
        dense_rows = torch.repeat_interleave(torch.tensor(long_chunks), torch.tensor(list(chunk_lengths)))
    token = DENSE_ROWS.set(dense_rows)
    try:
        yield
    finally:
        DENSE_ROWS.reset(token)


def quantize_int4(model: torch.nn.Module) -> None:
    """Swap every supported linear but the LM head for an `Int4Linear`. The head stays in the
    model's dtype: at 4 bits it moved the draft's argmax too often, for a head that is a fifth of
    SmolLM2's weights (docs/performance.md)."""
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.Linear) and child is not head and Int4Linear.supports(child):
                setattr(parent, name, Int4Linear(child))
