"""FP8 linears, the weights of FP8 checkpoints (fp8_checkpoint.py): e4m3 weights `[out, in]`
with a float32 scale per output row, w ~ q * scale. On a CUDA device that has FP8 tensor cores
(compute capability 8.9 or more: Ada, Hopper) `Fp8Linear` multiplies in FP8, each activation row
quantized on the fly with its own scale (dynamic per-token scaling, as vLLM and FBGEMM run Meta's
FP8 405B); elsewhere the weights are de-quantized once, at load, into the activations' dtype, so
the same checkpoint loads and is testable on a CPU."""

from __future__ import annotations

from typing import Optional

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_FLOOR = 1e-12  # an all-zero row still gets a positive scale


def quantize_rows(values: torch.Tensor, scale_ub: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` `[rows, n]` as e4m3 codes `[rows, n]` and float32 scales `[rows, 1]`, each row's
    largest magnitude mapped to FP8_MAX; `scale_ub` bounds a row's largest magnitude (an outlier
    token then saturates instead of costing its row's precision: Meta's activation_scale_ub)."""
    largest = values.abs().amax(dim=-1, keepdim=True).float()  # [rows, 1]
    if scale_ub is not None:
        largest = largest.clamp(max=scale_ub)
    scale = largest.clamp(min=SCALE_FLOOR) / FP8_MAX  # [rows, 1]
    codes = (values.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 `codes` `[out, in]` times `scale` (`[out, 1]`, or one for the tensor), in `dtype`."""
    return (codes.float() * scale.float().reshape(-1, 1)).to(dtype)


def has_fp8_matmul(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(torch.nn.Module):
    """y = x W^T + b in FP8: `weight` e4m3 `[out, in]`, `weight_scale` float32 `[out, 1]`; the
    output in the activations' dtype (bf16)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor], scale_ub=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        # a per-tensor scale serves every row
        self.weight_scale = torch.nn.Parameter(
            weight_scale.float().reshape(-1, 1).expand(self.out_features, 1).contiguous(), requires_grad=False
        )
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.scale_ub = scale_ub

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the weight's own sizes: a tensor-parallel shard's in/out_features name the whole layer's
        rows = x.reshape(-1, self.weight.shape[1])  # [M, in]
        codes, scale = quantize_rows(rows, self.scale_ub)  # [M, in], [M, 1]
        output = torch._scaled_mm(
            codes,
            self.weight.t(),  # [in, out], column-major as the kernel wants
            scale_a=scale,
            scale_b=self.weight_scale.t(),  # [1, out]
            bias=self.bias,
            out_dtype=x.dtype,
        )  # [M, out]
        return output.reshape(*x.shape[:-1], output.shape[-1])


def fp8_linear(
    codes: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype, scale_ub=None
) -> torch.nn.Module:
    """The module for one FP8 checkpoint linear on `codes`' device: `Fp8Linear` where FP8 matmuls
    run, else a plain linear of the de-quantized weights."""
    bias = None if bias is None else bias.to(dtype)
    if has_fp8_matmul(codes.device):
        return Fp8Linear(codes, scale, bias, scale_ub)
    return plain_linear(dequantize(codes, scale, dtype), bias)


def plain_linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.nn.Linear:
    """An `nn.Linear` over these tensors as they are (no copy)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    return linear
