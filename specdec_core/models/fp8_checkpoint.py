"""FP8 checkpoints, in the two formats Llama FP8 checkpoints ship in, each named by the
`quantization_config` of the checkpoint's config.json (transformers' quantizer configs):

- `fbgemm_fp8`: Meta's (Llama-3.1-405B-Instruct-FP8): a converted linear has e4m3 `weight`
  `[out, in]` and `weight_scale` `[out, 1]`; activations are scaled per token, each token's
  largest magnitude bounded by `activation_scale_ub`; `modules_to_not_convert` stay bf16.
- `compressed-tensors`, format `float-quantized` (Neural Magic's / llm-compressor's FP8): 8-bit
  float weights, scale per output channel (`weight_scale` `[out, 1]`) or one per tensor; `ignore`
  stays bf16. Its activation scheme is dynamic per token or a static `input_scale`: here
  activations are always scaled per token, so a static scale is read and not used.

A linear is converted where the checkpoint holds its `weight_scale` (shard_loader.py reads
them: FP8 matmuls where the device has them, else de-quantized once, kernels/fp8.py). Other
FP8 layouts (block-wise scales, packed formats) are refused with a message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

KNOWN = (
    "fbgemm_fp8 (per-row e4m3 weights) and compressed-tensors float-quantized "
    "(8-bit float weights, channel or tensor scales)"
)


@dataclass(frozen=True)
class Fp8Scheme:
    format: str  # the quantization_config's quant_method
    scale_ub: Optional[float]  # the largest activation magnitude a token's scale covers


def fp8_scheme(quantization: Optional[dict]) -> Optional[Fp8Scheme]:
    """The FP8 scheme of a config's `quantization_config`; None for a checkpoint that is not
    FP8 (or quantized some other way, left to transformers); raises ValueError for an FP8
    layout this loader does not know."""
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method == "fbgemm_fp8":
        return Fp8Scheme(method, quantization.get("activation_scale_ub"))
    if method == "compressed-tensors":
        for name, group in quantization.get("config_groups", {}).items():
            weights = group.get("weights") or {}
            scheme = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"), weights.get("symmetric"))
            if scheme[:2] != ("float", 8) or scheme[2] not in ("channel", "tensor") or scheme[3] is False:
                raise ValueError(f"compressed-tensors group {name!r} has weights {weights}: specdec loads {KNOWN}")
        if quantization.get("format") not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors format {quantization.get('format')!r}: specdec loads {KNOWN}")
        return Fp8Scheme(method, None)
    if method == "fp8":
        raise ValueError(f"FP8 format 'fp8' (block-wise scales): specdec loads {KNOWN}")
    return None


def quantization_config(config) -> Optional[dict]:
    """A transformers config's `quantization_config` as a dict (None without one)."""
    quantization = getattr(config, "quantization_config", None)
    return quantization.to_dict() if hasattr(quantization, "to_dict") else quantization


def checkpoint_fp8_scheme(source: str) -> Optional[Fp8Scheme]:
    """`fp8_scheme` of a checkpoint (a directory or a hub id), from its config."""
    from transformers import AutoConfig

    return fp8_scheme(quantization_config(AutoConfig.from_pretrained(source)))
