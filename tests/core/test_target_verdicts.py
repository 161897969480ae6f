"""Verdicts decided on the target beside its rows (target/verdicts.py) are the loop's own: the same
rows (penalties, logit_bias, min_tokens' stops), the same rules and the same draws, so a seeded
request's tokens do not depend on where it is decided."""

from __future__ import annotations

from typing import Optional, Sequence

import pytest

from specdec_core import GenerationRequest
from specdec_core.loop.engine import speculative_loop
from specdec_core.loop.sessions import Immediate, run_immediately
from specdec_core.loop.stage_types import DraftBlock, TargetBlock
from specdec_core.policies import make_policy
from specdec_core.policies.step_verdicts import decide_together
from specdec_core.target.verdicts import SessionVerdicts, decides_on_target

from helpers.tiny_models import repeating_prompt


class DecidingTarget(Immediate):
    """A local target session that decides each verdict beside its rows, as a target worker does."""

    def __init__(self, scorer, stop_ids):
        super().__init__(scorer)
        self.stop_ids = stop_ids

    async def reset(self, prompt_ids, policy, sampling, heads_kind=None):
        prefilled = self.session.reset(prompt_ids, policy, sampling, heads_kind)
        self.session.verdicts = SessionVerdicts.of(policy, sampling, self.stop_ids)
        return prefilled

    async def score(self, tokens: Sequence[int], draft: Optional[DraftBlock] = None) -> TargetBlock:
        return self.decided(self.session.score(tokens), draft)

    async def score_tree(self, tokens, tree, draft: Optional[DraftBlock] = None) -> TargetBlock:
        return self.decided(self.session.score_tree(tokens, tree), draft)

    def decided(self, block: TargetBlock, draft: DraftBlock) -> TargetBlock:
        scorer = self.session
        check = scorer.verdicts.check(draft, block, scorer.prompt_ids, scorer.output_ids())
        block.verdict = decide_together([check])[0]
        return block


@pytest.mark.parametrize(
    ("policy", "drafter"),
    [("rejection", "model"), ("rejection", "pld"), ("typical", "model"), ("rejection", "model_tree")],
)
def test_verdicts_decided_beside_the_rows_are_the_loops(tiny_engine, policy, drafter):
    free = tiny_engine.complete(request(policy, drafter)).token_ids
    sampling = {"min_tokens": 10, "stop_token_ids": free[1:3], "presence_penalty": 0.6, "logit_bias": {free[5]: 2.0}}
    for extra in ({}, sampling, {**sampling, "repetition_penalty": 1.3}):
        req = request(policy, drafter, **extra)
        prepared = tiny_engine.frontend.prepare(req)
        output = tiny_engine.frontend.output(prepared)
        drafter_session, target = tiny_engine.sessions(
            prepared, target_session=lambda scorer: DecidingTarget(scorer, output.stop_ids)
        )
        chunks = list(run_immediately(speculative_loop(prepared, drafter_session, target, output)))
        tokens = [token for chunk in chunks for token in chunk.token_ids]
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
