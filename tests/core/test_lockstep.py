"""lockstep.py: requests decoded together come out as each does alone, and every step holds every
session that has work for it."""

from __future__ import annotations

import pytest

from specdec_core import GenerationRequest
from specdec_core.loop import lockstep
from specdec_core.loop.lockstep import StepTimes, complete_together, decide_together

from helpers.tiny_models import repeating_prompt


def request(seed: int, drafter: str, max_tokens: int, policy: str = "greedy", temperature: float = 0.0):
    return GenerationRequest(
        prompt_ids=repeating_prompt(seed, length=12 + 2 * seed),
        policy={"name": policy},
        drafter={"name": drafter},
        num_draft_tokens=4,
        sampling={"max_tokens": max_tokens, "temperature": temperature, "seed": seed},
    )


@pytest.mark.parametrize("drafter", ["none", "pld", "model", "mla", "model_tree"])
def test_together_equals_alone(tiny_engine, drafter):
    requests = [request(seed, drafter, max_tokens=8 + 3 * seed) for seed in range(4)]  # they end apart
    alone = [tiny_engine.complete(one).token_ids for one in requests]
    assert [done.token_ids for done in complete_together(tiny_engine, requests)] == alone


def test_sampled_requests_together_equal_alone(tiny_engine):
    requests = [request(seed, "model", 12, "rejection", temperature=0.8) for seed in range(3)]
    alone = [tiny_engine.complete(one).token_ids for one in requests]
    assert [done.token_ids for done in complete_together(tiny_engine, requests)] == alone


def test_a_step_decides_every_sampled_chain_and_tree_at_once(sharp_engine, monkeypatch):
    """Rejection and typical requests under two warps, over a draft model's sampled drafts, prompt
    lookup's one-hot ones, none, and a draft model's trees under both rules (a peaked target, so
    that nodes are accepted): each comes out as it does alone, and each step's verdicts are one
    decision over every session's chain and tree (policies/step_verdicts.py)."""
    decisions = []

    def counted(checks):
        decisions.append(len(checks))
        return decide_together(checks)

    monkeypatch.setattr(lockstep, "decide_together", counted)
    kinds = [("rejection", "model", 0.8), ("typical", "model", 0.8), ("rejection", "pld", 1.2)]
    kinds += [("typical", "none", 0.7), ("rejection", "none", 0.8), ("rejection", "model_tree", 0.8)]
    kinds += [("rejection", "model_tree", 1.2), ("typical", "model_tree", 0.8)]
    requests = [request(seed, drafter, 10, policy, warm) for seed, (policy, drafter, warm) in enumerate(kinds)]
    alone = [sharp_engine.complete(one).token_ids for one in requests]
    completions = complete_together(sharp_engine, requests)
    assert [done.token_ids for done in completions] == alone
    steps = [done.metrics["num_steps"] for done in completions]
    assert decisions[: min(steps)] == [len(requests)] * min(steps) and sum(decisions) == sum(steps)
    assert all(done.metrics["mean_acceptance_length"] > 1 for done in completions[-3:])  # the trees accepted nodes


def test_each_step_holds_every_live_session(tiny_engine):
    times = StepTimes()
    requests = [request(seed, "model", max_tokens=16) for seed in range(3)]
    completions = complete_together(tiny_engine, requests, times)
    steps = [done.metrics["num_steps"] for done in completions]
    # a target forward holds the sessions still decoding: all three until the shortest ends
    assert times.target_rows[: min(steps)] == [3] * min(steps)
    assert len(times.target_rows) == max(steps) and sum(times.target_rows) == sum(steps)
    assert len(times.draft_s) >= max(steps) and times.wall_s > 0


def test_eagle3_requests_together_equal_alone_and_each_guess_is_timed_as_the_draft(eagle3_engine):
    """The layer's guesses are each request's own calls, outside the draft rounds: gpu-report's
    draft column counts them (StepTimes.draft_s), one entry a guess."""
    requests = [request(seed, "eagle3", max_tokens=10 + 3 * seed) for seed in range(3)]
    alone = [eagle3_engine.complete(one).token_ids for one in requests]
    times = StepTimes()
    completions = complete_together(eagle3_engine, requests, times)
    assert [done.token_ids for done in completions] == alone
    guesses = sum(done.metrics["spec_decode_num_drafts"] for done in completions)
    assert guesses > 0 and len(times.draft_s) == guesses
