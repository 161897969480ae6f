"""FP8 checkpoints, in the two formats Llama FP8 checkpoints ship in, each named by the
`quantization_config` of the checkpoint's config.json (transformers' quantizer configs):

- `fbgemm_fp8`: Meta's (Llama-3.1-405B-Instruct-FP8): a converted linear has e4m3 `weight`
  `[out, in]` and `weight_scale` `[out, 1]`; activations are scaled per token, each token's
  largest magnitude bounded by `activation_scale_ub`; `modules_to_not_convert` stay bf16.
- `compressed-tensors`, format `float-quantized` (Neural Magic's / llm-compressor's FP8): 8-bit
  float weights, scale per output channel (`weight_scale` `[out, 1]`) or one per tensor; `ignore`
  stays bf16. Its activation scheme is dynamic per token or a static `input_scale`: here
  activations are always scaled per token, so a static scale is read and not used.

A linear is converted where the checkpoint holds its `weight_scale`. The model is built on the
meta device and takes the checkpoint's tensors as they are (kernels/fp8.py: FP8 matmuls where
the device has them, else de-quantized once): no bf16 copy of the whole model is made. Other
FP8 layouts (block-wise scales, FP8 activations with static scales only, packed formats) are
refused with a message."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .kernels.fp8 import FP8, fp8_linear

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


def checkpoint_fp8_scheme(source: str) -> Optional[Fp8Scheme]:
    """`fp8_scheme` of a local checkpoint directory (None elsewhere: hub ids load as they are)."""
    config = Path(source) / "config.json"
    if not config.is_file():
        return None
    return fp8_scheme(json.loads(config.read_text()).get("quantization_config"))


def checkpoint_tensors(directory: Path, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else None
    paths = [directory / name for name in files] if files else sorted(directory.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"{directory} holds no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        tensors.update(load_file(path, device=str(device)))
    return tensors


@torch.no_grad()  # not inference mode: its tensors would refuse the CPU kernels' version checks
def load_fp8_model(source: str, scheme: Fp8Scheme, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The causal LM of an FP8 checkpoint directory on `device`, its other tensors in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    del config.quantization_config  # the model is built plain; its linears are replaced below
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = checkpoint_tensors(Path(source), device)
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and f"{name}.weight_scale" in tensors:
            for unused in ("input_scale", "input_scale_ub"):
                tensors.pop(f"{name}.{unused}", None)
            codes, scale = tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.weight_scale")
            if codes.dtype != FP8:
                raise ValueError(f"{name}.weight is {codes.dtype}, not {FP8}, beside its weight_scale")
            linear = fp8_linear(codes, scale, tensors.pop(f"{name}.bias", None), dtype, scheme.scale_ub)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, linear)
    stray = [name for name, tensor in tensors.items() if tensor.dtype == FP8]
    if stray:
        raise ValueError(f"FP8 tensors without a weight_scale: {stray[:3]} ({scheme.format})")
    missing, unexpected = model.load_state_dict(
        {name: tensor.to(dtype) for name, tensor in tensors.items()}, strict=False, assign=True
    )
    model.tie_weights()
    missing = [name for name in missing if getattr(model.get_parameter(name), "is_meta", False)]
    if missing or unexpected:
        raise ValueError(f"{source}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    rebuild_meta_buffers(model, device)
    return model.eval()


def rebuild_meta_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (a rotary embedding's frequencies) are not in a checkpoint: built
    on the meta device, they are computed again on `device` by their module's own constructor."""
    for name, module in list(model.named_modules()):
        if any(buffer.is_meta for buffer in module.buffers(recurse=False)):
            if not hasattr(module, "inv_freq"):
                raise ValueError(f"{name}: a buffer the checkpoint does not hold, of an unknown kind")
            parent, _, child = name.rpartition(".")
            with torch.device(device):
                setattr(model.get_submodule(parent), child, type(module)(config=model.config))
