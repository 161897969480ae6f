"""What a bench run is made of, apart from running it (bench.py) and reporting it (report.py): its
configuration, one method's output on one question, and that output judged."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ...drafters.pld import PromptLookupParams


@dataclass
class MethodRun:
    """One method's output on one question."""

    token_ids: list[int]
    seconds: float
    metrics: dict = field(default_factory=dict)


@dataclass
class BenchConfig:
    questions: str  # a questions file in Spec-Bench's format, or "humaneval"
    methods: list[str]
    categories: list[str]
    per_category: int
    max_new_tokens: int
    temperature: float
    seed: int
    num_draft_tokens: int
    policy_params: dict[str, dict[str, Any]]
    drafter_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    sampling_params: dict[str, Any] = field(default_factory=dict)  # every method's (penalties, logit_bias, ...)
    endpoint: Optional[str] = None
    skip: int = 0  # questions passed over at the start of each category (e.g. to tune on others)
    run_ahead: Optional[bool] = None  # every request's (run_ahead.py); None: the engine's or service's default
    pld_max_ngram: int = PromptLookupParams().max_ngram
    pld_min_ngram: int = PromptLookupParams().min_ngram
    pld_tokens: int = PromptLookupParams().num_pred_tokens


@dataclass
class MethodResult:
    """One method's run on one question, judged."""

    method: str
    category: str
    run: MethodRun
    identical: Optional[bool]  # equal to target-only output (T = 0 only)
    nll: float  # the target's mean NLL of the output
    correct: Optional[bool]  # None where the question has no checkable answer
