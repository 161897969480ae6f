"""`specdec verify-cost`: what one forward over n new tokens costs, for the target and the draft
model, and the drafter parameters (`verify_cost`, `draft_cost`) that price blocks with it."""

from __future__ import annotations

import itertools
import statistics
import time
from collections import defaultdict

import torch

from ...api.request import GenerationRequest
from ...api.sampling import SamplingParams
from ...calibration.questions import DEFAULT_QUESTIONS, first_turn, load_questions
from ...loop.engine import SpeculativeEngine
from ...policies import make_policy
from ...target.scorer import Row, TargetScorer, forward_rows
from .device_clock import synchronize


@torch.inference_mode()
def block_cost_curve(
    model: torch.nn.Module, prompt_ids: list[int], max_tokens: int, repeats: int, batch_rows: int = 1
) -> list[dict]:
    """What one forward over `n` new tokens in each of `batch_rows` sessions costs after
    `prompt_ids`, for n = 1..max_tokens: a target verify of K drafts is n = K + 1. Sizes are
    interleaved within each repeat and each is priced against the one-session 1-token forward of
    its own repeat (median of those ratios), so that the machine's slow and fast stretches
    cancel; the caches are rolled back after every forward."""
    scorers = [TargetScorer(model) for _ in range(batch_rows)]
    for scorer in scorers:
        scorer.reset(prompt_ids, make_policy("greedy"), SamplingParams())
    samples: dict[int, list[float]] = defaultdict(list)
    one_session: list[float] = []  # the unit, timed beside a batched curve
    for _ in range(repeats + 1):  # the first round warms up
        if batch_rows > 1:
            start = time.perf_counter()
            scorers[0].score(prompt_ids[-1:])
            synchronize()  # on CUDA a timer otherwise measures the launches
            one_session.append((time.perf_counter() - start) * 1e3)
            scorers[0].commit(0)
        for num_tokens in range(1, max_tokens + 1):
            start = time.perf_counter()
            forward_rows([Row(scorer, prompt_ids[-num_tokens:]) for scorer in scorers])
            synchronize()
            samples[num_tokens].append((time.perf_counter() - start) * 1e3)
            for scorer in scorers:
                scorer.commit(0)
    unit = one_session if batch_rows > 1 else samples[1]
    return [
        {
            "tokens": num_tokens,
            "ms_p50": round(statistics.median(times[1:]), 2),
            "vs_one_token": round(statistics.median(ms / one_ms for ms, one_ms in zip(times[1:], unit[1:])), 3),
        }
        for num_tokens, times in samples.items()
    ]


def drafter_cost_params(target_curve: list[dict], draft_curve: list[dict] | None) -> dict:
    """`verify_cost` (k = 1.. drafts: a (k + 1)-token forward, made non-decreasing so that timing
    noise cannot make a longer block look cheaper) and, with a draft model, `draft_cost` (its
    1-token forward in target steps)."""
    params = {}
    if len(target_curve) > 1:
        params["verify_cost"] = list(itertools.accumulate((row["vs_one_token"] for row in target_curve[1:]), max))
    if draft_curve is not None:
        params["draft_cost"] = round(draft_curve[0]["ms_p50"] / target_curve[0]["ms_p50"], 3)
    return params


def measure(
    engine: SpeculativeEngine, max_tokens: int, repeats: int, context: int, batch_sizes: tuple[int, ...] = ()
) -> tuple[list[dict], dict]:
    """(one row per block size with each model's ms_p50 and vs_one_token, drafter parameters)
    after `context` tokens of Spec-Bench prompts (the first question of each category, joined);
    with `batch_sizes`, also the target's forward over that many sessions' blocks at once
    (`target_B<n>_*`: the cost of a batched step, which block_length.py reads off the
    one-session curve at n times the tokens)."""
    prompt_ids: list[int] = []
    for question in load_questions(DEFAULT_QUESTIONS, ["all"], 1):
        prompt_ids += engine.frontend.encode(GenerationRequest(messages=first_turn(question)))
    if len(prompt_ids) < context:
        raise ValueError(f"the Spec-Bench prompts give only {len(prompt_ids)} tokens of context")
    models = {"target": engine.target_model}
    if engine.draft_model is not None:
        models["draft"] = engine.draft_model
    curves = {
        name: block_cost_curve(model, prompt_ids[:context], max_tokens, repeats) for name, model in models.items()
    }
    for batch_rows in batch_sizes:
        curve = block_cost_curve(engine.target_model, prompt_ids[:context], max_tokens, repeats, batch_rows)
        curves[f"target_B{batch_rows}"] = curve
    rows = [
        {
            "tokens": size + 1,
            **{
                f"{name}_{key}": curve[size][key]
                for name, curve in curves.items()
                for key in curve[size]
                if key != "tokens"
            },
        }
        for size in range(max_tokens)
    ]
    return rows, drafter_cost_params(curves["target"], curves.get("draft"))
