"""The two per-request sessions the speculative loop drives. Local objects satisfy them
(`TargetScorer`, the drafters) and so do the gRPC proxies of the served path
(deployments/proxies.py), so one loop serves both."""

from __future__ import annotations

from typing import Protocol, Sequence

from .policies import AcceptancePolicy
from .sampling import SamplingParams
from .types import DraftBlock, TargetBlock


class TargetSession(Protocol):
    def reset(self, prompt_ids: Sequence[int], policy: AcceptancePolicy, sampling: SamplingParams) -> None:
        """Prefill the prompt (all but its last token, which the first `score` feeds)."""

    def score(self, tokens: Sequence[int]) -> TargetBlock:
        """Target logits for `[last committed, d_1..d_K]` (plus the policy's target features)."""

    def commit(self, num_keep: int) -> None:
        """Keep the first `num_keep` scored tokens in the KV cache; roll back the rest."""


class DraftSession(Protocol):
    def reset(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Start a request on this prompt (the drafter draws from `sampling.generator("draft")`)."""

    def propose(self, max_tokens: int, batch_rows: int = 1) -> DraftBlock:
        """Up to `max_tokens` draft tokens (none: the step is a plain one-token target step);
        `batch_rows`: the sessions the target's last step held, which prices a block."""

    def commit(self, new_tokens: Sequence[int]) -> None:
        """The tokens the verifier committed: accepted drafts, then its correction or bonus."""
