"""How much memory a worker rank's KV pool gets, decided once when the rank starts.

Either a byte budget (`kv_budget_mb`), or on CUDA vLLM's `gpu_memory_utilization`: the fraction
of the card's memory this rank may use for everything, weights, one step's activations and KV
together. The rank loads its weights, runs one profiling forward of a prompt chunk, and the pool
gets what is left of the fraction after the peak the allocator reserved and what others hold on
the card (the CUDA context, other processes). Without either the pool grows as it needs (CPU)."""

from __future__ import annotations

from typing import Optional

import torch

from ..api.errors import SpecdecError
from ..runtime.batching import forward_ragged
from ..runtime.kv_pool import PagedKV
from .memory import GIB

# a rank asking for a whole card leaves some of it for the allocator's fragments, as vLLM's default
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def kv_budget_from_fraction(total: float, utilization: float, peak_reserved: float, others: float) -> float:
    """Bytes for the KV pool: `utilization` of `total` bytes, less the allocator's reserved peak
    over a profiled step (weights and activations) and the bytes held outside it (`others`)."""
    budget = total * utilization - peak_reserved - others
    if budget <= 0:
        raise SpecdecError(
            f"gpu_memory_utilization {utilization:g} of {total / GIB:.1f} GiB leaves no room for the KV "
            f"cache: weights and one step take {peak_reserved / GIB:.1f} GiB and others hold "
            f"{others / GIB:.1f} GiB; raise it, or use more ranks (tp_size)"
        )
    return budget


@torch.inference_mode()
def profile_step(model: torch.nn.Module, tokens: int) -> None:
    """One forward of a `tokens`-long prompt into a session of its own, whose blocks return to
    the pool after: the largest step a worker runs (a prefill chunk), so its activations peak."""
    forward_ragged(model, [PagedKV()], [[0] * tokens])


def gpu_kv_budget(model: torch.nn.Module, utilization: float, profile_tokens: int) -> float:
    """The KV budget of a rank whose weights are loaded on the current CUDA device."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    profile_step(model, profile_tokens)
    torch.cuda.synchronize()
    peak_reserved = torch.cuda.max_memory_reserved()
    free, total = torch.cuda.mem_get_info()
    others = total - free - torch.cuda.memory_reserved()
    return kv_budget_from_fraction(total, utilization, peak_reserved, others)


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
