"""What a CPU draft model costs beside its target on this machine, measured once and cached.

The model drafters price their work in 1-token target steps (drafters/block_length.py): a draft
forward (`draft_cost`) and a prompt token of the draft's own prefill (`prefill_cost`). Both
depend on the CPU: on AVX2 alone the int4 draft's kernels differ from AVX-512's
(kernels/chunked.py), and its prefill costs what the fp32 target's does. So where both models
run on the CPU in one place (the in-process engine, `specdec serve` before it starts the
workers) they are timed once per machine and pair, after the draft's kernels are chosen, and
cached as JSON in the specdec cache (`draft_costs/`); the drafters take them as their defaults."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..models.kernels.chunked import kernel_summary
from ..models.kernels.kernel_choice import machine
from ..models.loader import ModelSpec, load_model
from ..models.sources import cache_dir, source_identity
from ..runtime.batching import forward_ragged
from ..runtime.kv_pool import PagedKV
from .cache_files import write_atomically

CONTEXT = 256  # tokens before each timed step: a short chat's
PROMPT = 512  # tokens of the timed prefill: a long prompt's per-token cost
REPEATS = 7


class DraftCosts(BaseModel):
    """The model drafters' prices (drafters/block_length.DraftCostParams), in 1-token target steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # the drafters' own bounds (DraftCostParams): a measurement beyond them is clipped to them
    draft_cost: float = Field(ge=0.0, le=100.0, description="one 1-token draft forward")
    prefill_cost: float = Field(ge=0.0, le=100.0, description="one prompt token of the draft's prefill")

    def verdict(self) -> str:
        """Whether the draft can pay, for `specdec serve`'s notes."""
        costs = f"a draft step costs {self.draft_cost:.2f} target steps, a prompt token {self.prefill_cost:.3f}"
        if self.draft_cost >= 1.0:
            return f"{costs}: slower than the target, so adaptive model and mla requests run without it (mla as pld)"
        return f"{costs}: model and mla requests draft with it where it pays for their prompt (their cost model)"


def step_ms(model: torch.nn.Module, cache: PagedKV, tokens: list[int]) -> float:
    """One forward over `tokens` after the cache's positions and the LM head on its last row;
    the cache is cropped back after."""
    held = cache.length
    start = time.perf_counter()
    hidden, _ = forward_ragged(model, [cache], [tokens])
    model.lm_head(hidden[0, -1:])
    elapsed = (time.perf_counter() - start) * 1e3
    cache.crop(held)
    return elapsed


@torch.inference_mode()
def measure_draft_costs(
    target_model: torch.nn.Module, draft_model: torch.nn.Module, threads: Optional[tuple[int, int]] = None
) -> DraftCosts:
    """(fastest draft step / fastest target step) and (fastest draft prefill per token / fastest
    target step) over repeats that time the three in turn after the same context (fresh random
    tokens per prefill, so no cache holds them): the fastest, since a busy machine only ever
    adds time. `threads`: (the target's, the draft's) torch threads, as their workers run them;
    None: this process's."""
    vocab = min(target_model.config.vocab_size, draft_model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (CONTEXT + 1,), generator=generator).tolist()
    own_threads = torch.get_num_threads()
    target_threads, draft_threads = threads or (own_threads, own_threads)
    caches = {"target": PagedKV(CONTEXT + 2), "draft": PagedKV(CONTEXT + 2)}
    forward_ragged(target_model, [caches["target"]], [context[:-1]])
    forward_ragged(draft_model, [caches["draft"]], [context[:-1]])
    times: dict[str, list[float]] = {"target": [], "draft": [], "prefill": []}
    try:
        for repeat in range(REPEATS + 1):  # the first warms up
            torch.set_num_threads(target_threads)
            target = step_ms(target_model, caches["target"], context[-1:])
            torch.set_num_threads(draft_threads)
            draft = step_ms(draft_model, caches["draft"], context[-1:])
            prompt = torch.randint(0, vocab, (PROMPT,), generator=generator).tolist()
            prefill = step_ms(draft_model, PagedKV(PROMPT + 1), prompt)
            if repeat:
                for name, ms in (("target", target), ("draft", draft), ("prefill", prefill / PROMPT)):
                    times[name].append(ms)
    finally:
        torch.set_num_threads(own_threads)
    target_ms = min(times["target"])
    return DraftCosts(
        draft_cost=min(round(min(times["draft"]) / target_ms, 3), 100.0),
        prefill_cost=min(round(min(times["prefill"]) / target_ms, 4), 100.0),
    )


def draft_costs_path(target: ModelSpec, draft: ModelSpec, threads: Optional[tuple[int, int]]) -> Path:
    key = json.dumps(
        [
            machine(),
            threads,
            *(source_identity(spec.source)[1] for spec in (target, draft)),
            *(spec.model_dump(exclude=fields_outside_key(spec)) for spec in (target, draft)),
        ]
    )
    return cache_dir() / "draft_costs" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def fields_outside_key(spec: ModelSpec) -> set[str]:
    """cuda_graphs has no bearing on a CPU pair; compile_layers and attention count where set (a
    pair that sets neither keeps the key it had before these fields)."""
    unset = (
        *(() if spec.compile_layers else ("compile_layers",)),
        *(("attention",) if spec.attention == "auto" else ()),
    )
    return {"source", "cuda_graphs", *unset}


def cpu_pair(target: ModelSpec, draft: Optional[ModelSpec]) -> bool:
    """Whether the pair is one these costs are measured for: both models on the CPU."""
    return draft is not None and target.torch_device.type == "cpu" and draft.torch_device.type == "cpu"


def load_draft_costs(
    target: ModelSpec,
    draft: ModelSpec,
    target_model: torch.nn.Module,
    draft_model: torch.nn.Module,
    threads: Optional[tuple[int, int]] = None,
) -> DraftCosts:
    """The pair's cached costs on this machine, measured and cached where there are none."""
    path = draft_costs_path(target, draft, threads)
    return cached_draft_costs(path) or measured_draft_costs(path, target_model, draft_model, threads)


def cached_draft_costs(path: Path) -> Optional[DraftCosts]:
    return DraftCosts.model_validate_json(path.read_text()) if path.exists() else None


def measured_draft_costs(
    path: Path, target_model: torch.nn.Module, draft_model: torch.nn.Module, threads: Optional[tuple[int, int]]
) -> DraftCosts:
    """`measure_draft_costs`, stored at `path`."""
    costs = measure_draft_costs(target_model, draft_model, threads)
    write_atomically(path, costs.model_dump_json())
    return costs


def choose_draft(target: ModelSpec, draft: ModelSpec, threads: tuple[int, int]) -> tuple[DraftCosts, str]:
    """For a service about to start its workers on this machine: the pair's costs and what the
    draft runs, in words. Where the costs are cached, neither model is loaded ("": the draft
    worker notes its kernels); else both are, the draft's kernels chosen (and cached) at its
    worker's `threads`, the target timed at its own."""
    path = draft_costs_path(target, draft, threads)
    cached = cached_draft_costs(path)
    if cached is not None:
        return cached, ""
    own_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads[0])
        target_model = load_model(target)
        torch.set_num_threads(threads[1])  # the kernel tables its worker will read
        draft_model = load_model(draft)
    finally:
        torch.set_num_threads(own_threads)
    return measured_draft_costs(path, target_model, draft_model, threads), kernel_summary(draft_model)
