"""EASD, entropy-aware penalty (Su et al., "Entropy-Aware Speculative Decoding Toward Improved
LLM Reasoning", arXiv:2512.23765, Algorithm 1).

At position i, if H(p_d) > tau_H and H(p_t) > tau_H (full-vocab, T = 1, nats; H(p_t) is a
target-side feature, so at T = 0 only top-n target rows travel) and the top-n
overlap |T_d ∩ T_t| / n >= tau_O, the target probability of the draft token is set to 0 and
p_t renormalized: the token is rejected and the replacement drawn from the penalized p_t
(its argmax at T = 0). Otherwise the base rule applies. tau_H = inf is exactly the base rule.
`>=` for the overlap: the paper's Table 7 rows for tau_O = 0 and 0.2 coincide, which only fits
`>=`. Drafts without a distribution (prompt lookup) have zero entropy and are never penalized.
tau_H is a per-model calibration in the paper; left out, it is the target's (calibration/target_profile.py)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from pydantic import Field

from ..api.errors import SpecdecError
from ..api.sampling import entropy_of_logits, sample, warp_logits
from ..loop.stage_types import Verdict
from .policy_base import AcceptancePolicy, PolicyParams, accepted_prefix, base_decision, first_false, recover_token


class EasdParams(PolicyParams):
    tau_h: Optional[float] = Field(
        None, ge=0.0, description="entropy threshold in nats (inf disables); None: the target's calibrated value"
    )
    tau_o: float = Field(0.8, ge=0.0, le=1.0, description="top-n overlap threshold")
    top_n: int = Field(5, ge=1, le=100)


class EasdPolicy(AcceptancePolicy):
    name = "easd"
    Params = EasdParams
    counters = ("penalized",)

    @property
    def needs_profile(self) -> bool:
        return self.params.tau_h is None

    def for_target(self, profile):
        if self.params.tau_h is not None:
            return self
        if profile is None:
            raise SpecdecError(
                "policy 'easd': this target has no calibrated tau_h (calibration is off or it has no "
                "tokenizer); pass tau_h",
                "policy",
            )
        return EasdPolicy(self.params.model_copy(update={"tau_h": profile.easd_tau_h}))

    def wire_top_k(self, sampling):
        # T = 0 reads the top-n sets and, after a penalty, the runner-up; the target entropy
        # comes as a feature. Sampling from the penalized row needs the full rows.
        return max(self.params.top_n, 2) if sampling.greedy else None

    def needs_draft_logits(self) -> bool:
        return True

    def target_features(self, target, draft_tokens, sampling, generator):
        """Full-vocab target entropies, computed next to the target's logits."""
        if math.isinf(self.params.tau_h):
            return {}
        return {"target_entropy": entropy_of_logits(target.logits[: len(draft_tokens)])}

    def penalized_positions(self, draft, target, num_rows: int) -> torch.Tensor:
        """[K] bool, evaluated on the first `num_rows` positions (the later ones cannot matter).
        Each test runs only on the rows that passed the previous one."""
        penalized = torch.zeros(draft.num_tokens, dtype=torch.bool, device=draft.tokens.device)
        if draft.logits is None or math.isinf(self.params.tau_h) or num_rows == 0:
            return penalized
        rows = (target.features["target_entropy"][:num_rows] > self.params.tau_h).nonzero().flatten()
        rows = rows[entropy_of_logits(draft.logits[rows]) > self.params.tau_h]
        top_n = self.params.top_n
        draft_top = draft.logits[rows].topk(top_n, dim=-1).indices  # [R, n]
        target_top = target.logits[rows].topk(top_n, dim=-1).indices
        overlap = (draft_top[:, :, None] == target_top[:, None, :]).any(-1).sum(-1) / top_n
        penalized[rows] = overlap >= self.params.tau_o
        return penalized

    def verify(self, draft, target, sampling, generator) -> Verdict:
        decision = base_decision(draft, target, sampling, generator)
        # up to and including the base rule's first rejection
        penalized = self.penalized_positions(draft, target, min(first_false(decision.accepted) + 1, draft.num_tokens))
        accepted = decision.accepted & ~penalized
        num_accepted = first_false(accepted)
        if num_accepted < draft.num_tokens and penalized[num_accepted]:
            banned = draft.tokens[num_accepted]
            row = target.logits[num_accepted].float().clone()
            row[banned] = float("-inf")
            if sampling.greedy:
                next_token = int(row.argmax())
            else:
                next_token = int(sample(warp_logits(row[None], sampling).softmax(-1), generator)[0])
        else:
            next_token = recover_token(num_accepted, draft, decision, sampling, generator)
        kept = accepted_prefix(accepted, num_accepted)
        penalized_hit = penalized & (torch.arange(draft.num_tokens, device=penalized.device) == num_accepted)
        return Verdict(num_accepted, next_token, {"accepted": kept, "penalized": penalized_hit})


def calibrate_tau_h(target_entropies: torch.Tensor, top_fraction: float = 0.05) -> float:
    """The paper's tau_H: mean of the top `top_fraction` of target entropies over a validation
    set (|S_p| = ceil(p |E|))."""
    flat = target_entropies.flatten().float()
    count = max(1, math.ceil(top_fraction * flat.numel()))
    return float(flat.topk(count).values.mean())
