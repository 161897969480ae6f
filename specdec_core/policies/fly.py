"""FLy, loosely speculative decoding (Li et al., "Training-Free Loosely Speculative Decoding:
Accepting Semantically Correct Drafts Beyond Exact Match", arXiv:2511.22972; reference code
github.com/AMD-AGI/FLy fly/models/FLy.py, whose behaviour is the default here).

On the base accept vector (exact match at T = 0):
  * entropy gate: a mismatch whose target entropy is < theta stays rejected. Reference entropy
    ("top3"): -sum of p log p over the top-3 full-softmax target probs (not renormalized, not
    divided by log|V|); "normalized" is the paper text's full-vocab entropy / log|V|;
  * deferred window, reference convention: a mismatch at j is accepted loosely iff positions
    j+1 .. j+W-1 are exact matches (W counts j itself), judged on the original match vector,
    and the last W positions of the block stay strict. "paper" convention: the W positions
    j+1 .. j+W must all match and lie inside the block;
  * W = 0 disables the window (the reference ablation `abla_no_window`): every mismatch that
    passes the gate is accepted loosely. theta = 0 opens the gate for every mismatch (so
    theta = 0 with W = 0 accepts every draft token); theta = inf is exactly the base rule.
Loosely accepted positions keep the draft's token; the first position still rejected emits
the base rule's correction (the target argmax at T = 0)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from ..api.sampling import entropy_of_logits
from ..loop.stage_types import Verdict
from .policy_base import AcceptancePolicy, PolicyParams, accepted_prefix, base_decision, first_false, recover_token


class FlyParams(PolicyParams):
    theta: float = Field(0.3, ge=0.0, description="entropy gate; 0 = gate off, inf = never loose")
    window: int = Field(6, ge=0, le=64, description="deferred window W; 0 disables the window")
    entropy: Literal["top3", "normalized"] = "top3"
    window_convention: Literal["reference", "paper"] = "reference"


def top3_entropy(logits: torch.Tensor) -> torch.Tensor:
    # log-probs of the top 3 without materializing a [K, V] log_softmax
    logits = logits.float()
    top_log_probs = logits.topk(3, dim=-1).values - logits.logsumexp(-1, keepdim=True)
    return -(top_log_probs.exp() * top_log_probs).sum(-1)


class FlyPolicy(AcceptancePolicy):
    name = "fly"
    Params = FlyParams
    counters = ("loose",)

    def wire_top_k(self, sampling):
        return 3 if sampling.greedy and self.params.entropy == "top3" else None

    def gate_entropy(self, logits: torch.Tensor) -> torch.Tensor:
        if self.params.entropy == "top3":
            return top3_entropy(logits)
        return entropy_of_logits(logits) / math.log(logits.shape[-1])

    def window_passes(self, exact: torch.Tensor) -> torch.Tensor:
        """[K] bool: the deferred window after each position sees only exact matches."""
        num_draft = exact.shape[0]
        window = self.params.window
        passes = torch.zeros(num_draft, dtype=torch.bool, device=exact.device)
        if window == 0:
            return ~passes
        following = window - 1 if self.params.window_convention == "reference" else window
        # reference: the last W positions stay strict; paper: j + W <= K - 1. Both give:
        last_loose = num_draft - window - 1
        if last_loose < 0:
            return passes
        if following == 0:
            passes[: last_loose + 1] = True
            return passes
        # windows of `following` positions starting at j + 1, for j = 0 .. last_loose
        runs = exact[1:].unfold(0, following, 1).all(-1)  # runs[j] covers j+1 .. j+following
        passes[: last_loose + 1] = runs[: last_loose + 1]
        return passes

    def verify(self, draft, target, sampling, generator) -> Verdict:
        decision = base_decision(draft, target, sampling, generator)
        exact = decision.accepted
        # the gate is read only where a mismatch passes its window: entropy for those rows alone
        candidates = ~exact & self.window_passes(exact)
        loose = torch.zeros_like(candidates)
        if candidates.any():
            rows = candidates.nonzero().flatten()
            loose[rows] = self.gate_entropy(target.logits[rows]) >= self.params.theta
        accepted = exact | loose
        num_accepted = first_false(accepted)
        next_token = recover_token(num_accepted, draft, decision, sampling, generator)
        kept = accepted_prefix(accepted, num_accepted)
        return Verdict(num_accepted, next_token, {"accepted": kept, "loose": loose & kept})
