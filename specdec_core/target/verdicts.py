"""Verdicts decided where the target's rows are. A served target worker decides its sampled
sessions' verdicts itself, so a step's rows `[K + 1, V]` never cross the wire and the server's
host warps none of them. It reads the rows the server's loop would read (the request's logits
processors, then min_tokens' stops masked), decides them by the same rules (step_verdicts.py: a
step's sessions at once), and draws what the loop would draw: the session's verify stream is the
request's, seeded alike and drawn in the loop's order. So a seeded request's tokens are the ones
it gets in process. The server keeps what only it holds: a grammar, and the log-probs it reads
from the rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import torch

from ..api.output import early_stops_masked
from ..api.sampling import SamplingParams
from ..loop.stage_types import DraftBlock, TargetBlock
from ..policies import AcceptancePolicy
from ..policies.sampled_chains import Check
from .logits_processors import processed_block


def decides_on_target(policy: AcceptancePolicy, sampling: SamplingParams) -> bool:
    """Whether a request's verdicts can be decided on its target worker: sampled chains and trees
    under a rule that decides them from the rows and its draws alone (`Check.decided_together`),
    rows no grammar masks (the server's), and no log-probs read from them."""
    rule_decides = policy.decides_chains and policy.decides_trees
    return not sampling.greedy and rule_decides and not sampling.structured_output and sampling.logprobs is None


@dataclass
class SessionVerdicts:
    """A session's verdicts on its target: its rule and settings, the stop tokens min_tokens holds
    back, and its verify stream."""

    policy: AcceptancePolicy
    sampling: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator

    @classmethod
    def of(cls, policy: AcceptancePolicy, sampling: SamplingParams, stop_ids: Collection[int]) -> "SessionVerdicts":
        if not decides_on_target(policy, sampling):
            raise ValueError(f"policy {policy.name!r} at these settings is decided by the server")
        return cls(policy, sampling, frozenset(stop_ids), sampling.generator("verify"))

    def check(
        self, draft: DraftBlock, block: TargetBlock, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> Check:
        """The loop's check of `block`, whose drafts are `draft`'s, after `output_ids` (the tokens
        generated before its root, the root included)."""
        draft = draft.to(block.logits.device)
        rows = processed_block(block, draft, self.sampling, prompt_ids, output_ids)
        rows = early_stops_masked(rows, draft.tree, len(output_ids), self.sampling.min_tokens, self.stop_ids)
        return Check(self.policy, draft, rows, self.sampling, self.generator)
