"""GPU memory of a target sharded over `pp` pipeline stages of `tp` ranks, from its config alone
(`specdec plan`).

The parameter count comes from the model built on the meta device (no weights, any
architecture transformers knows). Sharding follows what the loaders do for decoder LMs
(shard_loader.py): every linear inside a decoder layer is split over the ranks, and so is an
untied LM head; the embedding and the norms are whole. With pipeline stages the first stage
holds the embedding, the last the LM head (and, tied, the embedding). Every rank holds a
step's logits over the whole vocabulary (gathered over the tp ranks, passed on between stages).
`fp8` means FP8 decoder-layer linears with the embedding, LM head and norms in bf16 (the usual
FP8 checkpoints of Llama-3.1).

The KV cache of a rank holds its share of the KV heads: tp must divide the query and KV heads
(`shard_problem`), so at most 8 ranks for Llama-3.1. Besides weights and KV cache a rank needs the
activations and fp32 logits of one verify step for the whole batch, and a fixed reserve
(`RESERVE_GIB`: CUDA context, NCCL buffers, allocator slack)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..models.pipeline import stage_layers

GIB = 1 << 30
RESERVE_GIB = 2.0
BYTES_PER_VALUE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
MODEL_CONFIGS = Path(str(resources.files("specdec_core") / "data" / "model_configs"))


def shipped_configs() -> list[str]:
    """The model configs that ship with specdec (no weights): the planner's and cluster files' models."""
    return sorted(path.name for path in MODEL_CONFIGS.iterdir() if (path / "config.json").exists())


def load_model_config(model: str) -> Any:
    """A transformers config: a shipped name, a config.json, a checkpoint directory, or a hub id."""
    from transformers import AutoConfig

    if (MODEL_CONFIGS / model / "config.json").exists():
        return AutoConfig.from_pretrained(MODEL_CONFIGS / model)
    path = Path(model)
    if path.is_file():
        config_dict = json.loads(path.read_text())
        return AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    return AutoConfig.from_pretrained(model)


@dataclass
class ParameterCounts:
    layer_linears: int  # split over the tp ranks
    lm_head: int  # split over the tp ranks (0 when tied to the embedding)
    embedding: int  # whole on the ranks that hold it
    replicated: int  # whole on every rank: the norms

    @property
    def total(self) -> int:
        return self.layer_linears + self.lm_head + self.embedding + self.replicated


def count_parameters(config: Any) -> ParameterCounts:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    counts = ParameterCounts(0, 0, 0, 0)
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    for name, parameter in model.named_parameters():  # a tied head is the embedding, counted once
        if ".layers." in name and parameter.dim() == 2:
            counts.layer_linears += parameter.numel()
        elif parameter is embedding:
            counts.embedding += parameter.numel()
        elif parameter is head:
            counts.lm_head += parameter.numel()
        else:
            counts.replicated += parameter.numel()
    return counts


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def shard_problem(config, tp: int) -> str | None:
    """Why `config`'s model cannot be split over `tp` ranks, or None."""
    query_heads, key_value_heads = config.num_attention_heads, kv_heads(config)
    if tp < 1 or query_heads % tp or key_value_heads % tp:
        valid = (n for n in range(1, key_value_heads + 1) if not query_heads % n and not key_value_heads % n)
        return (
            f"tp_size {tp} must divide the model's {query_heads} query heads and {key_value_heads} KV heads "
            f"(valid: {', '.join(str(n) for n in valid)})"
        )
    return None


def kv_bytes_per_token(config: Any, tp: int, bytes_per_value: float) -> float:
    """Keys and values of one token over all layers, on one of `tp` ranks."""
    return 2 * config.num_hidden_layers * (kv_heads(config) // tp) * head_dim(config) * bytes_per_value


@dataclass
class Plan:
    tp: int
    pp: int
    parameters: ParameterCounts
    weight_bytes: float  # per rank
    kv_bytes_per_token: float  # per rank
    kv_bytes_per_request: float  # per rank, at max_len
    step_bytes: float  # per rank: one verify step's activations and logits, whole batch
    reserve_bytes: float
    gpu_bytes: float
    max_len: int
    max_batch: int

    @property
    def kv_bytes(self) -> float:
        return self.kv_bytes_per_request * self.max_batch

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.step_bytes + self.reserve_bytes

    @property
    def headroom_bytes(self) -> float:
        return self.gpu_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0


def plan(
    config: Any,
    tp: int,
    gpu_gib: float,
    dtype: str = "bfloat16",
    kv_dtype: str = "bfloat16",
    max_len: int | None = None,
    max_batch: int = 1,
    step_tokens: int = 16,
    reserve_gib: float = RESERVE_GIB,
    pp: int = 1,
) -> Plan:
    """Per-rank memory of `config` over `pp` pipeline stages of `tp` ranks of `gpu_gib` each,
    for the rank that needs most; `step_tokens` per request in a verify step (K + 1); `max_len`
    defaults to the model's context length. A stage holds ceil(layers / pp) layers (the first
    stages take the remainder); the first holds the embedding, the last the LM head."""
    problem = shard_problem(config, tp)
    if problem:
        raise ValueError(problem)
    layers = config.num_hidden_layers
    largest_stage = len(stage_layers(layers, 0, pp))  # the first stages take the remainder
    counts = count_parameters(config)
    other_width = BYTES_PER_VALUE["bfloat16" if dtype == "fp8" else dtype]

    def stage_bytes(stage: int) -> float:
        first, last = stage == 0, stage == pp - 1
        ends = (
            counts.replicated + counts.lm_head / tp * last + counts.embedding * (first or (last and not counts.lm_head))
        )
        linears = counts.layer_linears * len(stage_layers(layers, stage, pp)) / layers / tp
        return linears * BYTES_PER_VALUE[dtype] + ends * other_width

    weight_bytes = max(stage_bytes(0), stage_bytes(pp - 1))
    kv_per_token = kv_bytes_per_token(config, tp, BYTES_PER_VALUE[kv_dtype]) * largest_stage / layers
    max_len = max_len or config.max_position_embeddings
    rows = max_batch * step_tokens  # fp32 logits and the widest activations (MLP, both halves)
    step_bytes = rows * (config.vocab_size + 2 * config.intermediate_size / tp + 4 * config.hidden_size) * 4
    return Plan(
        tp=tp,
        pp=pp,
        parameters=counts,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_per_token,
        kv_bytes_per_request=kv_per_token * max_len,
        step_bytes=step_bytes,
        reserve_bytes=reserve_gib * GIB,
        gpu_bytes=gpu_gib * GIB,
        max_len=max_len,
        max_batch=max_batch,
    )


def smallest_layout(config: Any, gpu_gib: float, gpus_per_node: int = 8, max_pp: int = 8, **settings):
    """The (tp, pp) that fits with the fewest stages (each a node: activations cross the slower
    links between nodes), then the fewest ranks a stage, tensor parallelism within a node of
    `gpus_per_node` and up to `max_pp` stages; None when none does."""
    for pp in range(1, min(max_pp, config.num_hidden_layers) + 1):
        for tp in range(1, gpus_per_node + 1):
            if shard_problem(config, tp) is None and plan(config, tp, gpu_gib, pp=pp, **settings).fits:
                return tp, pp
    return None
