"""Weight-only int4 for CPU drafts (`ModelSpec(dtype="int4")`): 4-bit codes and torch's kernel
over them, one of the kernels a draft's linears choose from by chunk length (chunked.py)."""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from .chunked import Candidates, ChunkedLinear, DenseKernel, KernelTable

GROUP_SIZE = 32


def int4_supported(linear: torch.nn.Linear) -> bool:
    """The kernel needs out_features divisible by 16 and in_features by the group size."""
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % 16 == 0


class Int4Kernel(torch.nn.Module):
    """Weight-only int4 linear for CPU, as gpt-fast runs int4 on CPU: each group of 32 input
    weights of an output row is stored as 4-bit codes q with a scale and a zero point (asymmetric
    min-max rounding, w ~ (q - 8) * scale + zero), and torch's `_weight_int4pack_mm_for_cpu`
    de-quantizes inside the matmul, in the activations' dtype (bf16 here; its fp32 path is slow).

    Why: a draft's 1-token step is memory-bound, and the kernel reads a quarter of the bf16
    weights' bytes; its cost grows linearly with the rows, so longer chunks run a dense kernel on
    the de-quantized values (`quantize`). A checkpoint de-quantized from a Q4_1 GGUF (groups of
    32, scale and minimum, as the embedded target) comes back close to its own 4-bit codes."""

    def __init__(self, packed_weight: torch.Tensor, scales_and_zeros: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.register_buffer("packed_weight", packed_weight)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [in / 32, out, 2], the kernel's layout
        self.bias = bias

    @classmethod
    def quantize(cls, linear: torch.nn.Linear) -> tuple["Int4Kernel", torch.Tensor]:
        """The kernel over `linear`'s weights at 4 bits, and the values it computes with: `[out,
        in]` fp32, the scale and zero as stored, rounded like the kernel's (for dense kernels)."""
        if not int4_supported(linear):
            raise ValueError(f"int4 needs in_features % 32 == 0 and out_features % 16 == 0, got {linear}")
        groups = linear.weight.detach().float().view(linear.out_features, -1, GROUP_SIZE)  # [out, in / 32, 32]
        low, high = groups.amin(-1), groups.amax(-1)  # [out, in / 32]
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)  # [out, in / 32, 32]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).flatten(1), 1)
        scales_and_zeros = torch.stack([scale, low + 8 * scale], -1).to(linear.weight.dtype)  # [out, in / 32, 2]
        stored_scale, zero = scales_and_zeros.float().unbind(-1)
        values = ((codes - 8) * stored_scale[..., None] + zero[..., None]).view_as(linear.weight)  # [out, in]
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(packed, scales_and_zeros.transpose(0, 1).contiguous(), bias), values

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed_weight, GROUP_SIZE, self.scales_and_zeros)
        return out if self.bias is None else out + self.bias


# chooses a linear's kernels (its table) from its candidates: kernel_choice.measured_tables on a
# machine, a fixed table in tests
ChooseKernels = Callable[[torch.nn.Linear, Candidates], KernelTable]


def dense_kernels(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Candidates:
    """The dense candidates over the same values: bf16 and fp32 (oneDNN packs fp32 everywhere it
    runs, bf16 only with AVX-512 or AVX-NE-CONVERT; elsewhere bf16 is torch's matmul)."""
    return {
        name: functools.partial(DenseKernel, weight, bias, dtype)
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))
    }


def int4_candidates(linear: torch.nn.Linear) -> Candidates:
    """int4 and the dense kernels over its de-quantized values; the dense ones alone where torch
    has no int4 CPU kernel (a build without it raises on packing)."""
    try:
        int4, values = Int4Kernel.quantize(linear)
    except (RuntimeError, NotImplementedError):
        return dense_kernels(linear.weight.detach().float(), linear.bias)
    return {"int4": lambda: int4, **dense_kernels(values, linear.bias)}


def quantize_int4(model: torch.nn.Module, choose: ChooseKernels) -> None:
    """Swap every supported linear but the LM head for a `ChunkedLinear` over its int4 codes,
    and the head for one over its own values (bf16 and fp32 kernels): at 4 bits the head moved
    the draft's argmax too often, for a head that is a fifth of SmolLM2's weights
    (docs/architecture.md, "Why the CPU kernels"). Each linear runs the kernels `choose` picks from its candidates."""
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if not isinstance(child, torch.nn.Linear):
                continue
            if child is head:
                candidates = dense_kernels(child.weight.detach().float(), child.bias)
            elif int4_supported(child):
                candidates = int4_candidates(child)
            else:
                continue
            setattr(parent, name, ChunkedLinear(child, candidates, choose(child, candidates), child.weight.dtype))
