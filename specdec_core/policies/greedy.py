"""Exact match: accept while the draft token equals the target argmax (needs temperature 0)."""

from __future__ import annotations

from ..types import Verdict
from .base import AcceptancePolicy, accepted_prefix, base_decision, first_false


class GreedyPolicy(AcceptancePolicy):
    name = "greedy"
    lossless = True
    supports_sampling = False

    def verify(self, draft, target, sampling, generator) -> Verdict:
        decision = base_decision(draft, target, sampling, generator)
        num_accepted = first_false(decision.accepted)
        return Verdict(
            num_accepted,
            int(decision.target_argmax[num_accepted]),
            {"accepted": accepted_prefix(decision.accepted, num_accepted)},
        )
