"""EARS, adaptive rejection tolerance (Sun et al., "EARS: Efficient Adaptive Rejection Sampling
for Accelerating Speculative Decoding in Large Language Models", arXiv:2512.13194).

R = p_t(c) / max(p_d(c), 1e-10); accept if R >= U; otherwise "pardon" if
R >= max(U - beta * (1 - max p_t), 0); otherwise reject and resample from the residual.
max p_t is taken once per score call on the sampling (temperature-warped) distribution, as
the paper ties the tolerance to temperature. beta = 0 is exactly `rejection`."""

from __future__ import annotations

from pydantic import Field

from ..loop.stage_types import Verdict
from .policy_base import AcceptancePolicy, PolicyParams, accepted_prefix, base_decision, first_false, recover_token


class EarsParams(PolicyParams):
    beta: float = Field(0.1, ge=0.0, le=1.0, description="base tolerance; 0 = lossless")


class EarsPolicy(AcceptancePolicy):
    name = "ears"
    Params = EarsParams
    counters = ("pardoned",)

    def verify(self, draft, target, sampling, generator) -> Verdict:
        decision = base_decision(draft, target, sampling, generator)
        accepted = decision.accepted
        pardoned = accepted & False
        if decision.target_probs is not None and self.params.beta > 0:
            max_target_prob = decision.target_probs[: draft.num_tokens].amax(-1)
            tolerance = self.params.beta * (1.0 - max_target_prob)
            pardoned = ~accepted & (decision.ratio >= (decision.uniform - tolerance).clamp_min(0.0))
            accepted = accepted | pardoned
        num_accepted = first_false(accepted)
        next_token = recover_token(num_accepted, draft, decision, sampling, generator)
        kept = accepted_prefix(accepted, num_accepted)
        return Verdict(num_accepted, next_token, {"accepted": kept, "pardoned": pardoned & kept})
