"""A target step's verdicts decided beside its rows (deployments/workers/verify_answers.py): a
session whose check cannot be laid out fails alone, before any draw; the step's others get the
verdicts they would get without it."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from deployments.workers.steps import PendingRow
from deployments.workers.verify_answers import settle_verdicts
from deployments.workers.worker_ops import TargetRow
from specdec_core.api.sampling import SamplingParams
from specdec_core.loop.stage_types import DraftBlock, TargetBlock
from specdec_core.policies import make_policy
from specdec_core.target.verdicts import SessionVerdicts

VOCAB = 50


def session(seed: int) -> SimpleNamespace:
    """A scorer as settle_verdicts reads it: its verdicts, prompt and output."""
    sampling = SamplingParams(temperature=0.8, seed=seed)
    verdicts = SessionVerdicts.of(make_policy("rejection"), sampling, ())
    return SimpleNamespace(verdicts=verdicts, prompt_ids=[1, 2], output_ids=lambda: [])


def step(scorers: dict) -> tuple[list[PendingRow], list[TargetBlock]]:
    rows, blocks = [], []
    for session_id, scorer in scorers.items():
        seed = scorer.verdicts.sampling.seed
        logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(seed))  # [K + 1, V]
        draft = DraftBlock(logits[:3].argmax(-1))
        rows.append(
            PendingRow(TargetRow(session_id=session_id, tokens=[2, *draft.token_ids]), Future(), attached=draft)
        )
        blocks.append(TargetBlock(logits))
    return rows, blocks


def test_a_session_that_cannot_be_laid_out_fails_alone():
    scorers = {"a": session(1), "broken": session(2), "c": session(3)}
    scorers["broken"].output_ids = lambda: 1 / 0  # its check raises before any draw
    rows, blocks = step(scorers)
    settle_verdicts(rows, blocks, scorers.__getitem__)
    with pytest.raises(ZeroDivisionError):
        rows[1].future.result(timeout=0)
    alone = {"a": session(1), "c": session(3)}
    alone_rows, alone_blocks = step(alone)
    settle_verdicts(alone_rows, alone_blocks, alone.__getitem__)
    decided = [(block.verdict.num_accepted, block.verdict.next_token) for block in (blocks[0], blocks[2])]
    assert decided == [(block.verdict.num_accepted, block.verdict.next_token) for block in alone_blocks]
    assert not rows[0].future.done() and not rows[2].future.done()  # answered by their replies, later
