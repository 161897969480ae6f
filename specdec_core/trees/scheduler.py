"""EntMTP's per-step tree scheduler: after each verify, a scalar score of the decode state picks
the next step's tree from a bank (switching is a lookup, tree.py).

The score is the paper's `s = max(p0, g_1..g_D)` with `g_d = p0 * p_1 * .. * p_d`: p0 is the
target's top-1 probability at the last accepted position and p_d the top-1 probability of the
head (or draft) at depth d. As the probabilities are at most 1, every g_d <= p0 and the score as
written equals p0, the verifier's own confidence; `path_score` keeps the formula so that a score
over other path values drops in.

Policies: `static` (always one tree); `binary_tau` (the aggressive tree once s > tau_on, back to
the conservative one once s <= tau_off: hysteresis, a single threshold when tau_off is unset);
`ladder` (K trees from small to large, the tree index = how many of K - 1 rising thresholds s
exceeds)."""

from __future__ import annotations

import bisect
from typing import Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


def path_score(top1_probs: Sequence[float]) -> float:
    """`max(p0, g_1..g_D)` from `[p0, p_1, .., p_D]`."""
    best = value = top1_probs[0]
    for prob in top1_probs[1:]:
        value *= prob
        best = max(best, value)
    return float(best)


class StaticParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["static"] = "static"
    tree: str


class BinaryTauParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["binary_tau"] = "binary_tau"
    conservative: str
    aggressive: str
    tau_on: float = Field(ge=0.0, le=1.0)
    tau_off: Optional[float] = Field(None, ge=0.0, le=1.0, description="unset: tau_on (a single threshold)")

    @model_validator(mode="after")
    def _ordered(self):
        if self.tau_off is not None and self.tau_off > self.tau_on:
            raise ValueError(f"tau_off ({self.tau_off}) must be <= tau_on ({self.tau_on})")
        return self


class LadderParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["ladder"] = "ladder"
    trees: tuple[str, ...] = Field(min_length=2, description="from the smallest tree to the largest")
    thresholds: tuple[float, ...] = Field(description="len(trees) - 1 rising scores")

    @model_validator(mode="after")
    def _one_threshold_between_trees(self):
        if len(self.thresholds) != len(self.trees) - 1 or list(self.thresholds) != sorted(self.thresholds):
            raise ValueError("a ladder needs len(trees) - 1 rising thresholds")
        return self


SchedulerParams = Union[StaticParams, BinaryTauParams, LadderParams]


class TreeScheduler:
    """One request's scheduler: `choose(score)` names the next step's tree."""

    def __init__(self, params: SchedulerParams):
        self.params = params
        self.aggressive = False  # binary_tau's state

    def choose(self, score: float) -> str:
        params = self.params
        if isinstance(params, StaticParams):
            return params.tree
        if isinstance(params, LadderParams):
            return params.trees[bisect.bisect_left(params.thresholds, score)]
        tau_off = params.tau_on if params.tau_off is None else params.tau_off
        if not self.aggressive and score > params.tau_on:
            self.aggressive = True
        elif self.aggressive and score <= tau_off:
            self.aggressive = False
        return params.aggressive if self.aggressive else params.conservative
