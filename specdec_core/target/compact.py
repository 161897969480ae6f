"""Compact target rows for the wire: top-k log-probs plus a uniform tail.

A `[K+1, V]` fp32 block is 3 MB at V = 49,152 and K = 15 (8 MB at V = 128k). Policies that
only read the argmax (greedy and the base rule at T = 0) or the top-3 probabilities (FLy's
reference entropy) declare `wire_top_k`; the target then ships `k` ids and log-probs per row,
and `expand_rows` rebuilds rows that give those policies exactly the same inputs: the top-k
log-probs are kept, and the remaining mass is spread evenly over the other tokens (each tail
entry is <= the k-th probability, so the argmax and the top-k set are unchanged)."""

from __future__ import annotations

from typing import Optional

import torch

from ..api.sampling import SamplingParams
from ..policies import AcceptancePolicy


def wire_top_k(policy: AcceptancePolicy, sampling: SamplingParams) -> Optional[int]:
    """How many top entries per row a request reads: its policy's need, widened to the top
    log-probs it asked for; None: full rows."""
    top_k = policy.wire_top_k(sampling)
    if top_k is None or not sampling.logprobs:
        return top_k
    return max(top_k, sampling.logprobs)


def compact_rows(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, k] int64, log_probs [N, k] float32) of the k most likely tokens per row."""
    log_probs, ids = logits.float().log_softmax(-1).topk(top_k, dim=-1)
    return ids, log_probs


def expand_rows(ids: torch.Tensor, log_probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Log-prob rows `[N, V]` with the given top-k entries and a uniform tail."""
    top_k = ids.shape[-1]
    tail_mass = (1.0 - log_probs.exp().sum(-1)).clamp_min(1e-30)
    tail = (tail_mass / max(vocab_size - top_k, 1)).log()
    rows = tail[:, None].expand(-1, vocab_size).clone()
    return rows.scatter_(-1, ids, log_probs)
