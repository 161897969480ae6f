"""Prompt lookup decoding: match the last n tokens (n = max_ngram .. min_ngram) in prompt +
output and propose what followed. A miss proposes nothing, so the step costs one target token.
FLy's reference uses n = 4..1 and 6 tokens; transformers uses max n = 2
(`prompt_lookup_num_tokens`); the original PLD n = 3, 10 tokens.

On CPU a longer verify block costs real time, so by default the proposal length follows what
lookups of that n-gram size actually earned in this request: each n keeps a Beta(1, 1)
estimate of the per-token acceptance rate a_n, and the drafter proposes the k that maximizes
expected tokens per unit of target cost, (1 + a + .. + a^k) / cost(k), with cost(k) the
measured cost of a step that scores k drafts (`verify_cost`, printed by `specdec verify-cost`).
The curve is not linear and depends on the machine: on the 2-core Zen 4 here, scoring 1-5 drafts
adds 4-5% to a 1-token step, 8 drafts 13%, 15 drafts 38%."""

from __future__ import annotations

from typing import Annotated, Literal, Sequence

import torch
from pydantic import Field, model_validator

from ..types import DraftBlock
from .base import Drafter, DrafterParams, common_prefix_length


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


# Cost of a target step that scores k = 1, 2, .. drafts, relative to a 1-token step: the mean of
# two runs of `specdec verify-cost --draft none --repeats 40` on this project's 2-core VM (AMD
# EPYC Zen 4, AVX-512; torch 2.13, oneDNN linears padded to 4 rows, grouped-head SDPA,
# SmolLM2-135M fp32, 200 tokens of context), made non-decreasing. A Zen 3 (AVX2) VM of the same
# name measured a steeper curve (1.73 at 15 drafts): run `specdec verify-cost` and pass its
# curve where it differs.
DEFAULT_VERIFY_COST = (1.04, 1.05, 1.05, 1.05, 1.05, 1.10, 1.12, 1.13, 1.21, 1.22, 1.24, 1.28, 1.34, 1.37, 1.38)


class AdaptiveLookupParams(PromptLookupParams):
    adaptive: bool = Field(True, description="choose the proposal length from acceptance so far")
    verify_cost: tuple[Annotated[float, Field(gt=0.0, le=100.0)], ...] = Field(
        DEFAULT_VERIFY_COST,
        min_length=1,
        description="target cost of scoring k = 1, 2, .. drafts, in 1-token steps; beyond the list "
        "it grows by the list's mean slope",
    )
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


def block_cost(verify_cost: Sequence[float], num_drafts: int) -> float:
    """Cost of a step scoring `num_drafts` drafts; past the curve's end it grows by its mean slope."""
    if num_drafts == 0:
        return 1.0
    if num_drafts <= len(verify_cost):
        return verify_cost[num_drafts - 1]
    slope = (verify_cost[-1] - 1.0) / len(verify_cost)
    return verify_cost[-1] + slope * (num_drafts - len(verify_cost))


def best_block_length(acceptance_rate: float, max_length: int, verify_cost: Sequence[float]) -> int:
    """argmax_k (1 + a + .. + a^k) / cost(k) over k = 0 .. max_length."""
    best_length, best_value = 0, 1.0
    expected_tokens, term = 1.0, 1.0
    for length in range(1, max_length + 1):
        term *= acceptance_rate
        expected_tokens += term
        value = expected_tokens / block_cost(verify_cost, length)
        if value > best_value:
            best_length, best_value = length, value
    return best_length


class PromptLookupDrafter(Drafter):
    name = "pld"
    Params = AdaptiveLookupParams

    def reset(self, prompt_ids, sampling, generator) -> None:
        super().reset(prompt_ids, sampling, generator)
        size = self.params.max_ngram + 1
        self.accepted = [1.0] * size  # Beta(1, 1) prior per n-gram size
        self.rejected = [1.0] * size
        self.last_proposal: tuple[int, list[int]] = (0, [])

    def propose(self, max_tokens: int) -> DraftBlock:
        ngram, continuation = lookup_continuation(self.context, self.params, max_tokens)
        if self.params.adaptive and continuation:
            rate = self.accepted[ngram] / (self.accepted[ngram] + self.rejected[ngram])
            continuation = continuation[: best_block_length(rate, len(continuation), self.params.verify_cost)]
        self.last_proposal = (ngram, continuation)
        return DraftBlock(tokens=torch.tensor(continuation, dtype=torch.long))

    def commit(self, new_tokens: Sequence[int]) -> None:
        ngram, proposal = self.last_proposal
        if proposal:
            kept = common_prefix_length(proposal, new_tokens, min(len(proposal), len(new_tokens) - 1))
            self.accepted[ngram] += kept
            self.rejected[ngram] += int(kept < len(proposal))
        super().commit(new_tokens)
