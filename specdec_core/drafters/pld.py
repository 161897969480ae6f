"""Prompt lookup decoding: match the last n tokens (n = max_ngram .. min_ngram) in prompt +
output and propose what followed. A miss proposes nothing, so the step costs one target token.
FLy's reference uses n = 4..1 and 6 tokens; transformers uses max n = 2
(`prompt_lookup_num_tokens`); the original PLD n = 3, 10 tokens.

By default the proposal length follows what lookups of that n-gram size actually earned in
this request: each n keeps its own acceptance estimate, and `block_length` picks the length.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from pydantic import Field, model_validator

from ..loop.stage_types import DraftBlock
from .block_length import AcceptanceEstimate, AdaptiveLengthParams, best_block
from .drafter_base import Drafter, DrafterParams


class PromptLookupParams(DrafterParams):
    max_ngram: int = Field(3, ge=1, le=32)
    min_ngram: int = Field(1, ge=1, le=32)
    num_pred_tokens: int = Field(10, ge=1, le=128, description="longest continuation proposed")
    match: Literal["earliest", "latest"] = "earliest"

    @model_validator(mode="after")
    def _ngram_range(self):
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
        return self


class AdaptiveLookupParams(PromptLookupParams, AdaptiveLengthParams):
    # with the adaptive length, the latest occurrence of an n-gram predicted the continuation
    # better than the first when replaying greedy Spec-Bench outputs (an ad-hoc replay)
    match: Literal["earliest", "latest"] = "latest"


def lookup_continuation(context: Sequence[int], params: PromptLookupParams, max_tokens: int) -> tuple[int, list[int]]:
    """(n, continuation): the continuation of the first (or last) earlier occurrence of the
    longest matching suffix n-gram, at most `max_tokens` long; (0, []) when nothing matches."""
    if max_tokens <= 0:
        return 0, []
    ids = torch.as_tensor(context)
    length = ids.shape[0]
    limit = min(max_tokens, params.num_pred_tokens)
    for ngram in range(min(params.max_ngram, length - 1), params.min_ngram - 1, -1):
        # candidate windows end before the final position, so a continuation exists
        windows = ids[: length - 1].unfold(0, ngram, 1)
        hits = (windows == ids[length - ngram :]).all(-1).nonzero().flatten()
        if hits.numel() == 0:
            continue
        start = int(hits[0] if params.match == "earliest" else hits[-1]) + ngram
        return ngram, ids[start : start + limit].tolist()
    return 0, []


class PromptLookupDrafter(Drafter):
    name = "pld"
    Params = AdaptiveLookupParams

    def reset(self, prompt_ids, sampling) -> None:
        super().reset(prompt_ids, sampling)
        self.estimates = [AcceptanceEstimate() for _ in range(self.params.max_ngram + 1)]  # per n-gram size
        self.last_proposal: tuple[int, list[int]] = (0, [])

    def choose(self, max_tokens: int, batch_rows: int = 1) -> tuple[int, list[int], float]:
        """(n, proposal, value): the lookup, the block kept of it and that block's expected tokens
        per unit of cost (`block_length`; 1 for no proposal)."""
        ngram, continuation = lookup_continuation(self.context, self.params, max_tokens)
        if not continuation:
            return ngram, [], 1.0
        rate = self.estimates[ngram].rate
        choice = best_block(rate, len(continuation), self.params.verify_cost, batch_rows=batch_rows)
        return ngram, continuation[: choice.length] if self.params.adaptive else continuation, choice.value

    def guess(self, context: Sequence[int], max_tokens: int) -> list[int]:
        """How `context` goes on, unchecked (mla's first level: the draft model checks it)."""
        return lookup_continuation(context, self.params, max_tokens)[1]

    def propose(self, max_tokens: int, batch_rows: int = 1) -> DraftBlock:
        ngram, proposal, _ = self.choose(max_tokens, batch_rows)
        return self.proposed(ngram, proposal)

    def proposed(self, ngram: int, proposal: list[int]) -> DraftBlock:
        """Remember a proposal (its n-gram's estimate learns from the commit) and make its block."""
        self.last_proposal = (ngram, proposal)
        return DraftBlock(tokens=torch.tensor(proposal, dtype=torch.long))

    def commit(self, new_tokens: Sequence[int]) -> None:
        ngram, proposal = self.last_proposal
        if proposal:
            self.estimates[ngram].update(proposal, new_tokens)
        self.last_proposal = (0, [])  # learned once: the next step may not propose from here
        super().commit(new_tokens)
