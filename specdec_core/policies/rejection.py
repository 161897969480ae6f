"""Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023); greedy at T = 0."""

from __future__ import annotations

from ..types import Verdict
from .base import AcceptancePolicy, accepted_prefix, base_decision, first_false, recover_token


class RejectionPolicy(AcceptancePolicy):
    name = "rejection"
    lossless = True

    def decided_by_target_rows(self, sampling) -> bool:
        return sampling.greedy  # the base rule at T = 0: the target's argmax

    def verify(self, draft, target, sampling, generator) -> Verdict:
        decision = base_decision(draft, target, sampling, generator)
        num_accepted = first_false(decision.accepted)
        next_token = recover_token(num_accepted, draft, decision, sampling, generator)
        return Verdict(num_accepted, next_token, {"accepted": accepted_prefix(decision.accepted, num_accepted)})
