"""Typical acceptance (Medusa / Hydra): accept c_i iff p_t(c_i) > min(eps, alpha * exp(-H(p_t))).

p_t is the temperature-warped target distribution; at T = 0 the rule is exact match. After the
accepted prefix the next token is sampled from p_t at that position (the bonus likewise)."""

from __future__ import annotations

import torch
from pydantic import Field

from ..sampling import entropy, sample, sampling_probs
from ..types import Verdict
from .base import AcceptancePolicy, PolicyParams, accepted_prefix, first_false
from .greedy import GreedyPolicy


class TypicalParams(PolicyParams):
    epsilon: float = Field(0.09, ge=0.0, le=1.0, description="hard probability threshold")
    alpha: float = Field(0.3, ge=0.0, le=1.0, description="entropy-scaled threshold factor")


class TypicalPolicy(AcceptancePolicy):
    name = "typical"
    Params = TypicalParams

    def verify(self, draft, target, sampling, generator) -> Verdict:
        if sampling.greedy:
            return GreedyPolicy().verify(draft, target, sampling, generator)
        target_probs = sampling_probs(target.logits, sampling)
        num_draft = draft.num_tokens
        draft_token_target_probs = target_probs[:num_draft].gather(-1, draft.tokens[:, None]).squeeze(-1)
        threshold = torch.minimum(
            torch.full((num_draft,), self.params.epsilon),
            self.params.alpha * torch.exp(-entropy(target_probs[:num_draft])),
        )
        accepted = draft_token_target_probs > threshold
        num_accepted = first_false(accepted)
        next_token = int(sample(target_probs[num_accepted][None], generator)[0])
        return Verdict(num_accepted, next_token, {"accepted": accepted_prefix(accepted, num_accepted)})
