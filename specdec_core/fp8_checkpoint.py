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
FP8 layouts (block-wise scales, packed formats) are refused with a message.

Over `tp` ranks (tensor parallelism, parallel.py) each rank reads only its shard of each
decoder linear from the files, as transformers' `tp_plan` does for bf16 checkpoints: a colwise
linear (q, k, v, gate, up) its rows and their scales, a rowwise one (o, down) its columns with
every row's scale (a per-row scale multiplies each rank's partial sum alike). transformers' own
tensor-parallel forwards then run on these modules (`apply_tensor_parallelism`: a rowwise
output is all-reduced). The embedding, norms and LM head are whole on every rank."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .kernels.fp8 import FP8, fp8_linear, plain_linear

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
    """`fp8_scheme` of a checkpoint (a directory or a hub id), from its config."""
    from transformers import AutoConfig

    quantization = getattr(AutoConfig.from_pretrained(source), "quantization_config", None)
    return fp8_scheme(quantization.to_dict() if hasattr(quantization, "to_dict") else quantization)


def checkpoint_directory(source: str) -> Path:
    """Where a checkpoint's files are: its directory, or a hub id's snapshot in the hub cache
    (downloaded once, its configs and safetensors only)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors"]))


class Checkpoint:
    """The tensors of a safetensors checkpoint directory, each read when asked for (a slice of
    it where a rank needs only its shard), never the whole checkpoint at once."""

    def __init__(self, directory: Path, device: torch.device):
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.exists():
            files = {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        else:
            files = {}
            for path in sorted(directory.glob("*.safetensors")):
                with safe_open(path, "pt") as handle:
                    files.update(dict.fromkeys(handle.keys(), path))
        if not files:
            raise FileNotFoundError(f"{directory} holds no .safetensors files")
        self.files, self.device = files, device
        self.handles = {path: safe_open(path, "pt", device=str(device)) for path in set(files.values())}

    def read(self, name: str, dim: Optional[int] = None, shard: tuple[int, int] = (0, 1)) -> torch.Tensor:
        """Tensor `name`, or its part `shard` = (rank, ranks) along `dim`: contiguous equal parts,
        the last one shorter where they do not divide (transformers' split)."""
        tensor = self.handles[self.files[name]].get_slice(name)
        if dim is None:
            return tensor[:]
        length = tensor.get_shape()[dim]
        rank, ranks = shard
        part = -(-length // ranks)
        start = min(part * rank, length)
        index = [slice(None)] * len(tensor.get_shape())
        index[dim] = slice(start, min(length, start + part))
        return tensor[tuple(index)]


def tensor_parallel_styles(model: torch.nn.Module) -> dict[str, str]:
    """Each decoder linear's tensor-parallel style (colwise or rowwise) by module name, from the
    config's `base_model_tp_plan` (transformers' plan for the architecture)."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan in transformers")
    return {
        name: style
        for name, _ in model.named_modules()
        for pattern, style in plan.items()
        if style in ("colwise", "rowwise") and fnmatch.fnmatchcase(name, f"{model.base_model_prefix}.{pattern}")
    }


@torch.no_grad()  # not inference mode: its tensors would refuse the CPU kernels' version checks
def load_fp8_model(
    source: str, scheme: Fp8Scheme, dtype: torch.dtype, device: torch.device, shard: tuple[int, int] = (0, 1)
) -> torch.nn.Module:
    """The causal LM of an FP8 checkpoint directory on `device`, its other tensors in `dtype`;
    `shard` = (rank, ranks): this rank's shard of a tensor-parallel model (the process group
    initialized)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    del config.quantization_config  # the model is built plain; its linears are replaced below
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    checkpoint = Checkpoint(checkpoint_directory(source), device)
    styles = tensor_parallel_styles(model) if shard[1] > 1 else {}
    names = set(checkpoint.files)
    for name, module in list(model.named_modules()):
        style = styles.get(name)
        if isinstance(module, torch.nn.Linear) and (style or f"{name}.weight_scale" in names):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, read_linear(checkpoint, name, style, shard, dtype, scheme))
            names -= {f"{name}.{part}" for part in ("weight", "weight_scale", "bias", "input_scale", "input_scale_ub")}
    tensors = {name: checkpoint.read(name) for name in names}
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
    if styles:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        apply_tensor_parallelism(model, init_device_mesh(device.type, (shard[1],)), styles)
        model._tp_size = shard[1]
    return model.eval()


def read_linear(
    checkpoint: Checkpoint, name: str, style: Optional[str], shard: tuple[int, int], dtype, scheme: Fp8Scheme
) -> torch.nn.Module:
    """Linear `name` (this rank's shard under `style`): FP8 where the checkpoint scales it."""
    rows = {"colwise": 0, "rowwise": None}.get(style)  # what of the per-row scales and bias a rank holds
    weight = checkpoint.read(f"{name}.weight", {"colwise": 0, "rowwise": 1}.get(style), shard)
    bias = checkpoint.read(f"{name}.bias", rows, shard) if f"{name}.bias" in checkpoint.files else None
    if f"{name}.weight_scale" in checkpoint.files:
        scale = checkpoint.read(f"{name}.weight_scale")
        if weight.dtype != FP8:
            raise ValueError(f"{name}.weight is {weight.dtype}, not {FP8}, beside its weight_scale")
        if rows is not None and scale.numel() > 1:  # per-row scales of a colwise shard: its rows'
            scale = checkpoint.read(f"{name}.weight_scale", rows, shard)
        linear = fp8_linear(weight, scale, bias, dtype, scheme.scale_ub)
    else:
        linear = plain_linear(weight.to(dtype), None if bias is None else bias.to(dtype))
    if style:  # transformers' tensor-parallel forwards read the whole layer's sizes
        full = checkpoint.handles[checkpoint.files[f"{name}.weight"]].get_slice(f"{name}.weight").get_shape()
        linear.out_features, linear.in_features = full
        linear._hf_quantized_needs_local_tp = True  # their forward takes this rank's plain tensors
    return linear


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
