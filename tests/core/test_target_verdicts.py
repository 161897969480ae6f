"""Verdicts decided on the target beside its rows (target/verdicts.py) are the loop's own: the same
rows (penalties, logit_bias, min_tokens' stops), the same rules and the same draws, so a seeded
request's tokens do not depend on where it is decided."""

from __future__ import annotations

import pytest

from specdec_core import GenerationRequest
from specdec_core.policies import make_policy
from specdec_core.target.verdicts import SessionVerdicts, decides_on_target

from helpers.deciding_target import decided_beside_rows
from helpers.tiny_models import repeating_prompt


@pytest.mark.parametrize(
    ("policy", "drafter"),
    [("rejection", "model"), ("rejection", "pld"), ("typical", "model"), ("rejection", "model_tree")],
)
def test_verdicts_decided_beside_the_rows_are_the_loops(tiny_engine, policy, drafter):
    free = tiny_engine.complete(request(policy, drafter)).token_ids
    sampling = {"min_tokens": 10, "stop_token_ids": free[1:3], "presence_penalty": 0.6, "logit_bias": {free[5]: 2.0}}
    for extra in ({}, sampling, {**sampling, "repetition_penalty": 1.3}):
        req = request(policy, drafter, **extra)
        tokens = decided_beside_rows(tiny_engine, req)
        assert tokens == tiny_engine.complete(req).token_ids, extra
        if extra:
            assert not set(free[1:3]) & set(tokens[:10])


def test_only_sampled_rules_that_decide_from_rows_and_draws_are_decided_on_the_target():
    hot = request("rejection", "model").sampling
    assert decides_on_target(make_policy("rejection"), hot) and decides_on_target(make_policy("typical"), hot)
    assert not decides_on_target(make_policy("rejection"), hot.model_copy(update={"temperature": 0.0}))
    assert not decides_on_target(make_policy("rejection"), hot.model_copy(update={"logprobs": 2}))
    for lossy in ("easd", "ears", "dropmatch", "fly"):  # host state, draft rows or the target's hidden states
        assert not decides_on_target(make_policy(lossy), hot)
    with pytest.raises(ValueError, match="decided by the server"):
        SessionVerdicts.of(make_policy("fly"), hot, ())


def request(policy: str, drafter: str, **sampling) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=repeating_prompt(5),
        policy={"name": policy},
        drafter={"name": drafter},
        num_draft_tokens=5,
        sampling={"max_tokens": 28, "temperature": 0.8, "seed": 9, **sampling},
    )
