"""Prompt lookup decoding: match the last n tokens (n = max_ngram .. min_ngram) in prompt +
output and propose what followed. A miss proposes nothing, so the step costs one target token
and no verification padding. FLy's reference uses n = 4..1 and 6 tokens; transformers uses
max n = 2 (`prompt_lookup_num_tokens`); the original PLD n = 3, 10 tokens."""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from pydantic import Field, model_validator

from ..types import DraftBlock
from .base import Drafter, DrafterParams


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


def lookup_continuation(context: Sequence[int], params: PromptLookupParams, max_tokens: int) -> list[int]:
    """The continuation of the first (or last) earlier occurrence of the longest matching
    suffix n-gram, at most `max_tokens` long; [] when nothing matches."""
    if max_tokens <= 0:
        return []
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
        return ids[start : start + limit].tolist()
    return []


class PromptLookupDrafter(Drafter):
    name = "pld"
    Params = PromptLookupParams

    def propose(self, max_tokens: int) -> DraftBlock:
        continuation = lookup_continuation(self.context, self.params, max_tokens)
        return DraftBlock(tokens=torch.tensor(continuation, dtype=torch.long))
