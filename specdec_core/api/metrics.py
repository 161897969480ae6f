"""Per-request speculative metrics, named as vLLM's spec-decode counters (docs/architecture.md)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

from ..loop.stage_types import DraftBlock, Verdict
from ..trees.tree import LISTED


@dataclass
class SpecMetrics:
    num_steps: int = 0  # target forwards after prefill
    num_drafts: int = 0  # steps that verified >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)  # per trace flag the policy counts
    tree_steps: dict[str, int] = field(default_factory=dict)  # steps per tree (a scheduler's choices)
    draft_ms: list[float] = field(default_factory=list)
    target_ms: list[float] = field(default_factory=list)
    verify_ms: list[float] = field(default_factory=list)
    prefill_ms: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the target's prefix cache (vLLM's name)
    prefix_cache_hits: int = 0  # and found there
    preemptions: int = 0  # times the target took the request's KV back and recomputed it (kv_room.py)
    run_ahead: Optional[dict] = None  # with run-ahead drafting: its proposals used, discarded, draft time hidden

    def record(self, draft: DraftBlock, verdict: Verdict) -> None:
        self.num_steps += 1
        num_draft = draft.num_tokens
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += verdict.num_accepted
        if draft.tree is not None:
            # a tree built for its step (a node budget's, a dynamic tree) counts by its size
            name = f"nodes_{draft.tree.num_nodes}" if draft.tree.name.startswith(LISTED) else draft.tree.name
            self.tree_steps[name] = self.tree_steps.get(name, 0) + 1
        # a tree proposes one token per depth along whichever path wins: count positions by depth
        num_positions = draft.tree.max_depth if draft.tree is not None else num_draft
        grow = num_positions - len(self.num_draft_tokens_per_pos)
        if grow > 0:
            self.num_draft_tokens_per_pos += [0] * grow
            self.num_accepted_tokens_per_pos += [0] * grow
        for position in range(num_positions):
            self.num_draft_tokens_per_pos[position] += 1
            self.num_accepted_tokens_per_pos[position] += int(position < verdict.num_accepted)
        for name in self.counters:
            self.counters[name] += int(verdict.trace[name].sum())

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (vLLM's definition: tokens per drafting step)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def summary(self) -> dict:
        def p50(values: list[float]) -> float:
            return round(statistics.median(values), 4) if values else 0.0

        return {
            "num_steps": self.num_steps,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": self.num_accepted_tokens_per_pos,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.num_accepted_tokens / self.num_draft_tokens, 4)
            if self.num_draft_tokens
            else 0.0,
            "acceptance_rate_per_pos": [
                round(accepted / proposed, 4)
                for accepted, proposed in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)
            ],
            **self.counters,
            **({"tree_steps": dict(self.tree_steps)} if self.tree_steps else {}),
            **({"run_ahead": self.run_ahead} if self.run_ahead is not None else {}),
            "prefill_ms": round(self.prefill_ms, 3),
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "preemptions": self.preemptions,
            "draft_ms_p50": p50(self.draft_ms),
            "target_ms_p50": p50(self.target_ms),
            "verify_ms_p50": p50(self.verify_ms),
            # a request's time split: awaiting drafts, awaiting the target's rows, verifying
            "draft_ms_total": round(sum(self.draft_ms), 3),
            "target_ms_total": round(sum(self.target_ms), 3),
            "verify_ms_total": round(sum(self.verify_ms), 3),
        }
