"""One loader for every source sources.py resolves: local checkpoints, hub ids, GGUF files, random
weights and the embedded default. Draft models can be derived from any checkpoint by dtype (including
weight-only int4) and by keeping only the first N decoder layers (a training-free
self-speculative draft)."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..planning.memory import load_model_config
from ..runtime.batching import set_kv_cache_dtype
from ..runtime.compiled_layers import compile_layers
from ..runtime.compiled_step import compile_step
from ..runtime.model_runner import use_paged_attention, use_step_graphs
from ..runtime.ragged_attention import paged_kernel_misfit
from .fp8_checkpoint import checkpoint_fp8_scheme
from .kernels import prepare_model
from .kernels.int4 import quantize_int4
from .kernels.kernel_choice import measured_tables
from .shard_loader import load_shard
from .sources import EMBEDDED, RANDOM, cache_dir, resolve_source

# "int4": bf16 activations, with the linears quantized to 4 bits after loading (kernels/int4.py)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int4": torch.bfloat16}


class ModelSpec(BaseModel):
    """Where a model comes from and how to materialize it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(
        EMBEDDED, description=f"local dir, hub id, path to a .gguf file, {EMBEDDED}, or {RANDOM}<config>"
    )
    dtype: Literal["float32", "bfloat16", "float16", "int4"] = Field(
        "float32",
        description="int4: a CPU draft of 4-bit weights and bf16 activations, each chunk length on the kernel "
        "measured fastest on this machine (kernels/chunked.py)",
    )
    num_layers: Optional[int] = Field(None, ge=1, description="keep only the first N decoder layers")
    device: str = Field("auto", description="auto: CUDA when present (int4 stays on the CPU), else the CPU")
    compile: bool = Field(
        False, description="torch.compile the step (compiled_step.compile_step): compiles a few graphs at first use"
    )
    compile_layers: bool = Field(
        False,
        description="torch.compile each decoder layer around its attention (compiled_layers.py): one compile "
        "shared by every layer, its kernels cached on disk; under the step's CUDA graphs on CUDA",
    )
    cuda_graphs: bool = Field(
        True,
        description="on CUDA, each decoding step replays a CUDA graph recorded at its first use (step_graphs.py); "
        "false: every step eager (vLLM's enforce_eager)",
    )
    attention: Literal["auto", "paged", "sdpa"] = Field(
        "auto",
        description="a step's short rows (verify blocks, trees, single tokens): paged, the Triton kernel that reads "
        "the KV pool through the block tables (kernels/paged_attention.py); sdpa, each row's keys gathered for "
        "PyTorch's SDPA; auto: paged on CUDA (not under compile), sdpa on the CPU. Prompt chunks take SDPA",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto", description="the KV cache's: auto, the activations'; fp8: e4m3, half of bf16's bytes (kv_pool.py)"
    )

    @field_validator("device")
    @classmethod
    def _a_device(cls, device: str) -> str:
        if device != "auto":
            try:
                torch.device(device)
            except RuntimeError as error:
                raise ValueError(f"device {device!r}: {error}") from None
        return device

    @model_validator(mode="after")
    def _one_compilation(self):
        if self.dtype == "int4" and (self.compile or self.compile_layers):
            raise ValueError("int4 runs eager: its chunk kernels (oneDNN, torch's int4 op) are not compiled")
        if self.compile and self.compile_layers:
            raise ValueError("compile (the whole step) or compile_layers (each layer), not both")
        if self.compile and self.attention == "paged":
            raise ValueError("the paged attention kernel runs beside compiled layers, not inside a compiled step")
        return self

    @property
    def paged_attention(self) -> bool:
        """Whether the model's short rows take the paged kernel (`attention`, resolved)."""
        if self.attention != "auto":
            return self.attention == "paged"
        on_cuda = self.torch_device.type == "cuda" and importlib.util.find_spec("triton") is not None
        return on_cuda and not self.compile

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() and self.dtype != "int4" else "cpu")
        return torch.device(self.device)


def load_tokenizer(spec: ModelSpec):
    """The checkpoint's tokenizer; None for random weights (requests then send token ids)."""
    from transformers import AutoTokenizer

    if spec.source.startswith(RANDOM):
        return None
    return AutoTokenizer.from_pretrained(resolve_source(spec.source))


def load_configs(spec: ModelSpec) -> tuple[Any, Optional[Any]]:
    """(model config, generation config or None) without the weights."""
    from transformers import AutoConfig, GenerationConfig

    if spec.source.startswith(RANDOM):
        return load_model_config(spec.source[len(RANDOM) :]), None
    source = resolve_source(spec.source)
    try:
        generation_config = GenerationConfig.from_pretrained(source)
    except OSError:  # the checkpoint has no generation_config.json
        generation_config = None
    return AutoConfig.from_pretrained(source), generation_config


def load_model(spec: ModelSpec) -> torch.nn.Module:
    """Load a causal LM in eval mode on its device, optionally truncated to its first `num_layers`
    layers. On the CPU it runs on this project's kernels (kernels/); elsewhere on the model's own
    attention and linears. An FP8 checkpoint (fp8_checkpoint.py) keeps its FP8 linears, `dtype`
    being the rest's (shard_loader.py)."""
    from transformers import AutoModelForCausalLM

    device = spec.torch_device
    if spec.dtype == "int4" and device.type != "cpu":
        raise ValueError("int4 is a CPU kernel: give the draft device cpu, or dtype bfloat16 on a GPU")
    if spec.source.startswith(RANDOM):
        model = random_model(load_configs(spec)[0], DTYPES[spec.dtype], device)
    else:
        source = resolve_source(spec.source)
        if checkpoint_fp8_scheme(source) is not None:
            model = load_shard(source, DTYPES[spec.dtype], device)
        else:
            placement = {} if device.type == "cpu" else {"device_map": device}  # straight onto the GPU
            model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[spec.dtype], **placement)
    if spec.num_layers is not None:
        truncate_layers(model, spec.num_layers)
    if device.type != "cpu":
        model = model.eval()
    else:
        if spec.dtype == "int4":
            quantize_int4(model, measured_tables(cache_dir()))
        model = prepare_model(model)
    set_kv_cache_dtype(model, spec.kv_cache_dtype)
    if spec.compile:
        compile_step(model)
        return model
    if spec.compile_layers:
        compile_layers(model, cache_dir())
    use_step_settings(model, spec)
    return model


def use_step_settings(model: torch.nn.Module, spec: ModelSpec) -> None:
    """What `spec` asks of a loaded (eager, or layer-compiled) model's steps, on every rank alike:
    the paged kernel for short rows, and on CUDA the steps' graphs. A tensor-parallel rank's graphs
    hold its collectives: every rank records and replays the same steps in the same order, as it
    runs them; a pipeline stage's hold a micro-batch's layers, its sends and receives between
    them (step_graphs.py, docs/architecture.md)."""
    if spec.paged_attention:
        misfit = paged_kernel_misfit(model, spec.kv_cache_dtype)
        if misfit is None:
            use_paged_attention(model)
        elif spec.attention == "paged":  # asked for; auto keeps SDPA
            raise ValueError(f"attention: paged cannot run {spec.source}: {misfit}")
    if spec.cuda_graphs and model.device.type == "cuda":
        use_step_graphs(model)


def random_model(config: Any, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A model of `config`'s shape with transformers' initialization from seed 0, built on `device`."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def truncate_layers(model: torch.nn.Module, num_layers: int) -> None:
    layers = model.model.layers
    if num_layers > len(layers):
        raise ValueError(f"num_layers={num_layers} exceeds the model's {len(layers)} layers")
    model.model.layers = layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]


def refuse_draft_only_target(spec: ModelSpec) -> None:
    """int4 is a draft's format: its kernels change with the chunk length (kernels/chunked.py),
    so a target in it would score a token differently in a verify block than alone."""
    if spec.dtype == "int4":
        raise ValueError(
            "int4 is for drafts (its kernels change with the chunk length); give the target float32 or bfloat16"
        )


# The embedded default's draft: the target's own weights at 4 bits (kernels/int4.py).
DEFAULT_DRAFT = ModelSpec(source=EMBEDDED, dtype="int4")
