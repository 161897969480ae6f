"""How much memory a worker rank's KV pool gets, decided once when the rank starts.

Either a byte budget (`kv_budget_mb`), or on CUDA vLLM's `gpu_memory_utilization`: the fraction
of the card's memory this rank may use for everything, weights, one step's activations and KV
together. The rank loads its weights, runs one profiling forward of a prompt chunk, and the pool
gets what is left of the fraction after the peak the allocator reserved, what others hold on the
card (the CUDA context, other processes) and, where the steps replay CUDA graphs, what the
graphs' own memory pool will hold. Without either the pool grows as it needs (CPU)."""

from __future__ import annotations

from typing import Optional

import torch

from ..api.errors import SpecdecError
from ..runtime.batching import forward_ragged
from ..runtime.kv_pool import PagedKV
from ..runtime.model_runner import runner_of
from ..runtime.ragged_attention import LONG_ROW
from ..runtime.step_graphs import GRAPH_MAX_TOKENS
from .memory import GIB

# a rank asking for a whole card leaves some of it for the allocator's fragments, as vLLM's default
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def kv_budget_from_fraction(
    total: float, utilization: float, peak_reserved: float, others: float, graph_pool: float = 0.0
) -> float:
    """Bytes for the KV pool: `utilization` of `total` bytes, less the allocator's reserved peak
    over a profiled step (weights and activations), the bytes held outside it (`others`) and what
    the CUDA graphs' own pool will hold (`graph_pool`)."""
    budget = total * utilization - peak_reserved - others - graph_pool
    if budget <= 0:
        graphs = f", CUDA graphs {graph_pool / GIB:.1f} GiB" if graph_pool else ""
        raise SpecdecError(
            f"gpu_memory_utilization {utilization:g} of {total / GIB:.1f} GiB leaves no room for the KV "
            f"cache: weights and one step take {peak_reserved / GIB:.1f} GiB{graphs} and others hold "
            f"{others / GIB:.1f} GiB; raise it, or use more ranks (tp_size)"
        )
    return budget


@torch.inference_mode()
def profile_step(model: torch.nn.Module, tokens: int, rows: int = 1) -> None:
    """One forward of `rows` rows of `tokens` new tokens, each a session of its own whose blocks
    return to the pool after: by default the largest step a worker runs (a prefill chunk), so its
    activations peak."""
    forward_ragged(model, [PagedKV() for _ in range(rows)], [[0] * tokens] * rows)


def graph_pool_bytes(model: torch.nn.Module) -> float:
    """What `model`'s CUDA graphs will hold in their own memory pool, which the eager steps' cached
    blocks cannot lend them: the activations of the largest step a graph covers (GRAPH_MAX_TOKENS
    tokens in rows of LONG_ROW; with the KV blocks it grows, an over-estimate), run eagerly (a
    graph recorded here would write a pool that is replaced). 0 without graphs."""
    runner = runner_of(model.model)
    if runner.graphs is None or model.device.type != "cuda":
        return 0.0
    graphs, runner.graphs = runner.graphs, None
    try:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        profile_step(model, LONG_ROW, rows=GRAPH_MAX_TOKENS // LONG_ROW)
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - before)
    finally:
        runner.graphs = graphs


def gpu_kv_budget(model: torch.nn.Module, utilization: float, profile_tokens: int) -> float:
    """The KV budget of a rank whose weights are loaded on the current CUDA device."""
    torch.cuda.empty_cache()
    graph_pool = graph_pool_bytes(model)
    torch.cuda.reset_peak_memory_stats()  # the peak from here holds what the graphs' profile left reserved
    profile_step(model, profile_tokens)
    torch.cuda.synchronize()
    peak_reserved = torch.cuda.max_memory_reserved()
    free, total = torch.cuda.mem_get_info()
    others = total - free - torch.cuda.memory_reserved()
    return kv_budget_from_fraction(total, utilization, peak_reserved, others, graph_pool)


def kv_budget(
    model: torch.nn.Module, budget_mb: Optional[float], utilization: float, profile_tokens: int
) -> Optional[float]:
    """A rank's KV bytes: `budget_mb` if set, else on CUDA `utilization` of its card, else None
    (a pool that grows)."""
    if budget_mb is not None:
        return budget_mb * 2**20
    if model.device.type != "cuda":
        return None
    return gpu_kv_budget(model, utilization, profile_tokens)
