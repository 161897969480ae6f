"""Typical acceptance (Medusa / Hydra): accept c_i iff p_t(c_i) > min(eps, alpha * exp(-H(p_t))).

p_t is the temperature-warped target distribution; at T = 0 the rule is exact match. After the
accepted prefix the next token is sampled from p_t at that position (the bonus likewise)."""

from __future__ import annotations

import torch
from pydantic import Field

from ..sampling import entropy_of_probs, sample, warp_logits
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
        warped_logits = warp_logits(target.logits, sampling)
        target_probs = warped_logits.softmax(-1)
        num_draft = draft.num_tokens
        draft_token_target_probs = target_probs[:num_draft].gather(-1, draft.tokens[:, None]).squeeze(-1)
        # p_t(c_i) > eps passes whatever the entropy, so H(p_t) is computed only for the other rows
        accepted = draft_token_target_probs > self.params.epsilon
        rows = (~accepted).nonzero().flatten()
        row_entropy = entropy_of_probs(target_probs[rows], warped_logits[rows])
        accepted[rows] = draft_token_target_probs[rows] > self.params.alpha * torch.exp(-row_entropy)
        num_accepted = first_false(accepted)
        next_token = int(sample(target_probs[num_accepted][None], generator)[0])
        return Verdict(num_accepted, next_token, {"accepted": accepted_prefix(accepted, num_accepted)})
