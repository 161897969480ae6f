"""A rank's part of a checkpoint, read from its safetensors files: the decoder layers of its
pipeline stage (pipeline.py), its shard of each decoder linear over the `tp` ranks of a
tensor-parallel group (parallel.py), and FP8 linears where the checkpoint has them
(fp8_checkpoint.py). The model is built on the meta device and takes the tensors as they are
read, each once (a slice where the rank needs only a part). A pipeline's first stage holds the
embedding, its last the final norm and the LM head (and, tied, the embedding it reads); the
other stages hold neither (pipeline.py passes the logits on).

Tensor parallelism follows transformers' `tp_plan` for the architecture: a colwise linear (q, k,
v, gate, up) keeps its rows (and, FP8, their scales), a rowwise one (o, down) its columns with
every row's scale (a per-row scale multiplies each rank's partial sum alike), and an untied LM
head its rows of the vocabulary, whose logits are gathered (`colwise_gather_output`); transformers'
own tensor-parallel forwards then run on these modules (`apply_tensor_parallelism`: a rowwise
output is all-reduced over the group). The embedding and the norms are whole on every rank that
holds them, as is a head tied to the embedding (split, it would be a second copy of its rows)."""

from __future__ import annotations

import fnmatch
import json
import math
import re
from pathlib import Path
from typing import Optional

import torch

from .fp8_checkpoint import fp8_scheme, quantization_config
from .kernels.fp8 import FP8, fp8_linear, plain_linear

LAYER = re.compile(r"\.layers\.(\d+)\.")
READ_DIM = {"colwise": 0, "rowwise": 1, "colwise_gather_output": 0, "colwise_rep": 0}  # a style's split weight dim


def checkpoint_directory(source: str, layers: Optional[range] = None) -> Path:
    """Where a checkpoint's files are: its directory, or a hub id's snapshot in the hub cache,
    downloaded once: its configs, then the safetensors files that hold the tensors of a stage
    of `layers` (all of them without an index)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    directory = Path(snapshot_download(source, allow_patterns=["*.json"]))
    index = directory / "model.safetensors.index.json"
    files = ["*.safetensors"]
    if index.exists() and layers is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({weight_map[name] for name in stage_names(weight_map, layers).values()})
    return Path(snapshot_download(source, allow_patterns=["*.json", *files]))


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
        self.open = lambda path: safe_open(path, "pt", device=str(device))
        self.handles: dict[Path, object] = {}  # opened at a first read (a stage's snapshot lacks the others)

    def slice(self, name: str):
        """safetensors' lazy view of tensor `name` (its shape, and its parts on indexing)."""
        path = self.files[name]
        if path not in self.handles:
            self.handles[path] = self.open(path)
        return self.handles[path].get_slice(name)

    def read(self, name: str, dim: Optional[int] = None, shard: tuple[int, int] = (0, 1)) -> torch.Tensor:
        """Tensor `name`, or its part `shard` = (rank, ranks) along `dim`: contiguous equal parts,
        the last one shorter where they do not divide (transformers' split)."""
        tensor = self.slice(name)
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
def load_shard(
    source: str,
    dtype: torch.dtype,
    device: torch.device,
    layers: Optional[range] = None,
    tp_mesh=None,
    num_layers: Optional[int] = None,
) -> torch.nn.Module:
    """The causal LM of a checkpoint (a directory or a hub id) on `device`, its unquantized
    tensors in `dtype`: only the decoder layers `layers` (renumbered from 0; all by default) of
    the model's first `num_layers` (all by default), what its stage needs around them (the
    embedding first, the norm and LM head after the last layer; None where a stage has none), and
    over `tp_mesh` (a 1-D device mesh of this rank's tensor-parallel group) this rank's shard."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    quantization = quantization_config(config)
    scheme = fp8_scheme(quantization)
    if quantization:
        if scheme is None:
            raise ValueError(f"{source}: quantization {quantization.get('quant_method')!r} does not load by shards")
        del config.quantization_config  # the model is built plain; its linears are replaced below
    num_layers = num_layers or config.num_hidden_layers
    layers = layers if layers is not None else range(num_layers)
    first, last = layers.start == 0, layers.stop == num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[layers.start : layers.stop]
    config.num_hidden_layers = len(layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.dtype = dtype  # the activations' (activation_dtype, where a stage has no embedding)
    checkpoint = Checkpoint(checkpoint_directory(source, layers), device)
    names = stage_names(checkpoint.files, layers)  # this stage's name -> the checkpoint's
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embedding.weight
    module_names = {module: name for name, module in model.named_modules()}
    ends = {  # what the stage keeps of the modules around the layers (the model is built whole, on meta)
        module_names[embedding]: (first or (tied and last), None),
        module_names[head]: (last, None),
        f"{model.base_model_prefix}.norm": (last, torch.nn.Identity()),
    }
    for module, (keep, instead) in ends.items():
        if not keep:
            parent, _, attribute = module.rpartition(".")
            setattr(model.get_submodule(parent), attribute, instead)
            names = {name: stored for name, stored in names.items() if not name.startswith(f"{module}.")}
    shard = (tp_mesh.get_local_rank(), tp_mesh.size()) if tp_mesh is not None else (0, 1)
    styles = tensor_parallel_styles(model) if tp_mesh is not None else {}
    if styles and last and not tied and (style := head_style(model, module_names[head])):
        styles[module_names[head]] = style
    for name, module in list(model.named_modules()):
        style = styles.get(name)
        if isinstance(module, torch.nn.Linear) and (style or f"{name}.weight_scale" in names):
            model.set_submodule(name, read_linear(checkpoint, names[f"{name}.weight"], style, shard, dtype, scheme))
            for part in ("weight", "weight_scale", "bias", "input_scale", "input_scale_ub"):
                names.pop(f"{name}.{part}", None)
    tensors = {name: checkpoint.read(stored) for name, stored in names.items()}
    stray = [name for name, tensor in tensors.items() if tensor.dtype == FP8]
    if stray:
        raise ValueError(f"FP8 tensors without a weight_scale: {stray[:3]}")
    missing, unexpected = model.load_state_dict(
        {name: tensor.to(dtype) for name, tensor in tensors.items()}, strict=False, assign=True
    )
    if tied and last:
        model.tie_weights()
    missing = [name for name in missing if getattr(model.get_parameter(name), "is_meta", False)]
    if missing or unexpected:
        raise ValueError(f"{source}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    rebuild_meta_buffers(model, device)
    if styles:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        apply_tensor_parallelism(model, tp_mesh, styles)
    model._tp_size = shard[1]  # transformers' `tp_size`: this rank holds 1 / tp_size of the KV heads
    return model.eval()


def activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of a model's hidden states (and KV cache): its embedding's, or, on a pipeline
    stage that holds none, the one it was loaded in."""
    embeddings = model.get_input_embeddings()
    return embeddings.weight.dtype if embeddings is not None else model.config.dtype


def head_style(model: torch.nn.Module, name: str) -> Optional[str]:
    """The LM head's (module `name`'s) tensor-parallel style in transformers' plan for the
    architecture where it splits the vocabulary and gathers the logits on every rank; None
    (the head stays whole) where the plan has none."""
    style = (getattr(model, "_tp_plan", None) or {}).get(name)
    return style if READ_DIM.get(style) == 0 else None


def stage_names(stored, layers: range) -> dict[str, str]:
    """The checkpoint's tensors a stage of `layers` holds, by the stage's names (its layers
    numbered from 0): every tensor outside the decoder layers, and those of its layers
    (`stored`: the checkpoint's tensor names)."""
    names = {}
    for name in stored:
        match = LAYER.search(name)
        if match is None:
            names[name] = name
        elif int(match[1]) in layers:
            names[name[: match.start()] + f".layers.{int(match[1]) - layers.start}." + name[match.end() :]] = name
    return names


def read_linear(
    checkpoint: Checkpoint, weight_name: str, style: Optional[str], shard: tuple[int, int], dtype, scheme
) -> torch.nn.Module:
    """The linear of the checkpoint's `weight_name` (this rank's shard under `style`): FP8
    where the checkpoint scales it (`scheme`)."""
    name = weight_name.removesuffix(".weight")
    rows = 0 if READ_DIM.get(style) == 0 else None  # what of the per-row scales and bias a rank holds
    weight = checkpoint.read(f"{name}.weight", READ_DIM.get(style), shard)
    bias = checkpoint.read(f"{name}.bias", rows, shard) if f"{name}.bias" in checkpoint.files else None
    if f"{name}.weight_scale" in checkpoint.files:
        if weight.dtype != FP8:
            raise ValueError(f"{name}.weight is {weight.dtype}, not {FP8}, beside its weight_scale")
        per_row = math.prod(checkpoint.slice(f"{name}.weight_scale").get_shape()) > 1  # else one for the tensor
        scale = checkpoint.read(f"{name}.weight_scale", rows if per_row else None, shard)
        linear = fp8_linear(weight, scale, bias, dtype, scheme.scale_ub)
    else:
        linear = plain_linear(weight.to(dtype), None if bias is None else bias.to(dtype))
    if style:  # transformers' tensor-parallel forwards read the whole layer's sizes
        full = checkpoint.slice(f"{name}.weight").get_shape()
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
            with torch.device(device):
                model.set_submodule(name, type(module)(config=model.config))
