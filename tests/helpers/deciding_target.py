"""A local target session that decides each verdict beside its rows, as a served target worker
does (specdec_core/target/verdicts.py), and the check that its tokens are the loop's own."""

from __future__ import annotations

from typing import Optional, Sequence

from specdec_core import GenerationRequest
from specdec_core.loop.engine import speculative_loop
from specdec_core.loop.sessions import Immediate, run_immediately
from specdec_core.loop.stage_types import DraftBlock, TargetBlock
from specdec_core.policies.step_verdicts import decide_together
from specdec_core.target.verdicts import SessionVerdicts


class DecidingTarget(Immediate):
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


def decided_beside_rows(engine, request: GenerationRequest) -> list[int]:
    """`request`'s tokens with each verdict decided by a `DecidingTarget` over `engine`'s models."""
    prepared = engine.frontend.prepare(request)
    output = engine.frontend.output(prepared)
    drafter, target = engine.sessions(prepared, target_session=lambda scorer: DecidingTarget(scorer, output.stop_ids))
    chunks = list(run_immediately(speculative_loop(prepared, drafter, target, output)))
    return [token for chunk in chunks for token in chunk.token_ids]
