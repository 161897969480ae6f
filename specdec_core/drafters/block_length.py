"""Adaptive block length, shared by the chain drafters (`pld`, `model`, `mla`, `eagle3`) and the
depth of the tree drafters (`model_tree`, `mla_tree`, `eagle3`'s dynamic trees).

On CPU a longer block costs real time: the target's verify forward grows with it, and a draft
model pays a forward per drafted token. So a drafter proposes the length k that maximizes
expected tokens per unit of cost, (1 + a + .. + a^k) / cost(k), where a is the per-token
acceptance rate this request has earned so far (a Beta posterior mean) and cost(k), in
one-token target steps, is the measured cost of a target step that scores k drafts
(`verify_cost`, printed by `specdec verify-cost`) plus k times the draft's cost per token (0 for
lookups). The curve is a parameter, not timed at start-up: block lengths decide how many random
draws a sampled request consumes, so timing them would make seeded outputs depend on the load.
(A CPU draft's own prices are measured once per machine and cached, draft_costs.py: they follow
the machine, not its load.)

Under load the target runs B sessions' blocks in one forward (continuous batching), so a step's
cost is that of all their tokens: with every session drafting k, cost(B (k + 1)) against
cost(B) for plain decoding, where cost(n) is the same curve read as the cost of an n-token
forward. The curve grows with n, so k shrinks as B grows and reaches 0 (plain decoding in the
same batch) where drafting stops paying. Draft forwards are priced per session, B k per step:
the draft worker runs sessions' forwards together, but on CPU an int4 draft's rows cost about
linearly even in a shared forward (docs/performance.md)."""

from __future__ import annotations

from typing import Annotated, NamedTuple, Sequence

from pydantic import Field

from .drafter_base import DrafterParams, common_prefix_length

# Cost of a target step that scores k = 1, 2, .. drafts, relative to a 1-token step, by the device
# type of the target. CPU: `specdec verify-cost --draft none` for the embedded target on the
# project's Zen 4 VM. CUDA: gpu-report's curve for the 8B shape's graphed step on an H100 (11.96 ms
# for one token, docs/performance.md), nearly flat since reading the weights bounds a step of a
# few dozen tokens; past 16 it goes on by its slope. Other machines have other curves: run
# `specdec verify-cost` there and pass what it prints.
VERIFY_COSTS = {
    "cpu": (1.04, 1.05, 1.05, 1.05, 1.05, 1.10, 1.12, 1.13, 1.21, 1.22, 1.24, 1.28, 1.34, 1.37, 1.38),
    "cuda": (1.057, 1.076, 1.076, 1.093, 1.096, 1.099, 1.099, *(1.142,) * 9),
}
DEFAULT_VERIFY_COST = VERIFY_COSTS["cpu"]


def device_verify_cost(device_type: str) -> tuple[float, ...]:
    """The default curve for a target on `device_type` (the CPU's where none was measured)."""
    return VERIFY_COSTS.get(device_type, DEFAULT_VERIFY_COST)


class AdaptiveLengthParams(DrafterParams):
    adaptive: bool = Field(True, description="choose the proposal's size from the verify cost")
    verify_cost: tuple[Annotated[float, Field(gt=0.0, le=100.0)], ...] = Field(
        DEFAULT_VERIFY_COST,
        min_length=1,
        description="target cost of scoring k = 1, 2, .. drafts, in 1-token steps; beyond the list "
        "it grows by the list's mean slope (default: the curve of the target's device type)",
    )


class DraftCostParams(AdaptiveLengthParams):
    # the embedded pair's on an AVX-512 CPU: the int4 draft's 1-token step over the fp32 target's,
    # from `specdec verify-cost` (docs/performance.md); where both models run on the CPU in one
    # place, this machine's measurement replaces it (draft_costs.py)
    draft_cost: float = Field(
        0.55, ge=0.0, le=100.0, description="one draft forward, in 1-token target steps (specdec verify-cost)"
    )


# the most tokens a request counts on emitting when it prices a draft's prefill: one without
# max_tokens may run to the end of the context, and a long chat answer stops within this
ANSWER_TOKENS = 512


def draft_pays(value: float, remaining_tokens: int, prompt_tokens: int, prefill_cost: float) -> bool:
    """Whether a draft model earns back its prefill of a request's prompt: at `value` tokens per
    unit of cost (best_block's, a plain step earning 1) the n tokens the request may still emit
    (at most ANSWER_TOKENS) take n (1 - 1 / value) fewer target steps, against `prompt_tokens` *
    `prefill_cost` target steps of the draft's prefill first."""
    expected_tokens = min(remaining_tokens, ANSWER_TOKENS)
    return value > 1.0 and expected_tokens * (1.0 - 1.0 / value) > prompt_tokens * prefill_cost


def block_cost(verify_cost: Sequence[float], num_drafts: int) -> float:
    """Cost of a step scoring `num_drafts` drafts; past the curve's end it grows by its mean slope."""
    if num_drafts == 0:
        return 1.0
    if num_drafts <= len(verify_cost):
        return verify_cost[num_drafts - 1]
    slope = (verify_cost[-1] - 1.0) / len(verify_cost)
    return verify_cost[-1] + slope * (num_drafts - len(verify_cost))


def step_cost(verify_cost: Sequence[float], num_tokens: int) -> float:
    """Cost of a forward over `num_tokens` tokens in 1-token steps (the curve read by tokens)."""
    return block_cost(verify_cost, num_tokens - 1)


class BlockChoice(NamedTuple):
    length: int
    value: float  # expected tokens per unit of cost, a plain one-token step being 1


def best_length(
    expected_tokens: Sequence[float], verify_cost: Sequence[float], draft_cost: float = 0.0, batch_rows: int = 1
) -> BlockChoice:
    """argmax_k expected_tokens[k] / ((cost(B (k + 1)) + B k draft_cost) / cost(B)) over the k
    that `expected_tokens` lists (k = 0, a plain step, expects 1 token), for B = `batch_rows`
    sessions per target step, each verifying k drafts."""
    plain_step = step_cost(verify_cost, batch_rows)
    best_length, best_value = 0, 1.0
    for length in range(1, len(expected_tokens)):
        step = step_cost(verify_cost, batch_rows * (length + 1)) + batch_rows * length * draft_cost
        value = expected_tokens[length] / (step / plain_step)
        if value > best_value:
            best_length, best_value = length, value
    return BlockChoice(best_length, best_value)


def best_block(
    acceptance_rate: float, max_length: int, verify_cost: Sequence[float], draft_cost: float = 0.0, batch_rows: int = 1
) -> BlockChoice:
    """The best chain length of at most `max_length` for a per-token acceptance rate a: a chain
    of k expects 1 + a + .. + a^k tokens."""
    expected, term = [1.0], 1.0
    for _ in range(max_length):
        term *= acceptance_rate
        expected.append(expected[-1] + term)
    return best_length(expected, verify_cost, draft_cost, batch_rows)


def least_drafts(batch_rows: int) -> int:
    """The fewest drafts (tokens, depths, tree nodes) a drafter that learns from its blocks
    proposes: alone 1, so its acceptance estimate keeps learning; under load 0 (no draft work)
    where drafting does not pay."""
    return 1 if batch_rows == 1 else 0


def learning_block(
    acceptance_rate: float, max_length: int, verify_cost: Sequence[float], draft_cost: float, batch_rows: int
) -> BlockChoice:
    """`best_block`, at least `least_drafts` long."""
    length, value = best_block(acceptance_rate, max_length, verify_cost, draft_cost, batch_rows)
    return BlockChoice(max(length, least_drafts(batch_rows)), value)


def cost_per_draft(draft_cost: float, forwards: int, drafted: int) -> float:
    """A drafted token's (or tree depth's) cost: a draft forward's, times this request's forwards
    per drafted token so far, which mla's lookup guesses push below 1."""
    return draft_cost * (forwards + 1) / (drafted + 1)


class AcceptanceEstimate:
    """Posterior mean of the per-token acceptance rate under a Beta prior: a proposal counts its
    kept tokens as successes and its rejection, if any, as one failure (geometric likelihood)."""

    def __init__(self, prior_accepted: float = 1.0, prior_rejected: float = 1.0):
        self.accepted, self.rejected = prior_accepted, prior_rejected

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, proposal: Sequence[int], new_tokens: Sequence[int]) -> None:
        """`new_tokens`: the committed tokens, whose last one the target chose itself."""
        kept = common_prefix_length(proposal, new_tokens, min(len(proposal), len(new_tokens) - 1))
        self.accepted += kept
        self.rejected += int(kept < len(proposal))
