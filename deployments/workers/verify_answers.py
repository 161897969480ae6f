"""A verify row's answer on the target worker, built on the torch thread after its step's forward.

- For a session that decides its verdicts here (specdec_core/target/verdicts.py) the server sends
  what the session's rule reads of the sampled drafts with each Score (`checked_draft`), as the
  draft worker does with a forwarded block; the step's deciding sessions are decided together (`settle_verdicts`;
  one read back on a device), and each gets its verdict, not its rows, which may start the block
  forwarded after it (forwarded_blocks.py).
- Otherwise its rows travel, as top-k where the policy reads no more (compact.py), and a session
  that takes forwarded blocks has its verdict decided for the block scored ahead
  (forwarded_blocks.py)."""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from specdec_core.api.errors import SpecdecError
from specdec_core.loop.run_ahead import verdict_outcome
from specdec_core.loop.stage_types import DraftBlock, TargetBlock
from specdec_core.policies.step_verdicts import decide_together
from specdec_core.target.compact import compact_rows, wire_top_k
from specdec_core.target.scorer import TargetScorer
from specdec_core.trees.tree import Topology

from .forwarded_blocks import ForwardedBlocks, ScoredRows
from .steps import PendingRow
from .worker_ops import TargetRow

logger = logging.getLogger(__name__)


def checked_draft(
    scorer: TargetScorer,
    tokens: Sequence[int],
    tree: Optional[Topology],
    token_probs: Sequence[float],
    logits: Optional[torch.Tensor],
    vocab_size: int,
) -> Optional[DraftBlock]:
    """The draft of a Score's `tokens` (`[root, drafts]`) as its session's rule reads it, with the
    probabilities it was sampled by: `token_probs [K]` (empty: not sampled) and the draft's rows
    `logits [K, V]` where the rule's residual reads them. None for a session the server decides."""
    if scorer.verdicts is None:
        if token_probs or logits is not None:
            raise SpecdecError("draft_token_probs, draft_logits: this session was not reset to decide verdicts")
        return None
    num_drafts = len(tokens) - 1
    sampled = bool(token_probs)
    if sampled and (tree is not None or len(token_probs) != num_drafts):
        raise SpecdecError(f"draft_token_probs: one per draft of a chain ({num_drafts}), none for a tree")
    probs = torch.tensor(list(token_probs), dtype=torch.float32) if sampled else None  # [K]
    if probs is not None and not bool(((probs > 0) & (probs <= 1)).all()):
        raise SpecdecError("draft_token_probs must lie in (0, 1]")
    if logits is not None and (not sampled or logits.shape != (num_drafts, vocab_size) or logits.isnan().any()):
        raise SpecdecError(f"draft_logits: [{num_drafts}, {vocab_size}] rows without NaN, of sampled drafts")
    if sampled and logits is None and scorer.verdicts.policy.reads_draft_probs:
        raise SpecdecError(f"draft_logits: policy {scorer.verdicts.policy.name!r} reads a sampled draft's rows")
    drafts = torch.tensor(list(tokens[1:]), dtype=torch.long)  # [K]
    return DraftBlock(drafts, logits if sampled else None, probs, tree, ids=list(tokens[1:]))


def settle_verdicts(rows: list[PendingRow], blocks: list, scorer_of: Callable[[str], TargetScorer]) -> None:
    """The verdicts of a step's rows whose sessions decide them (`row.attached`: their drafts), set
    on their blocks. A failed decision fails those rows alone: the step's other rows stand."""
    deciding, checks = [], []
    for row, block in zip(rows, blocks):
        if row.prefill or row.attached is None or row.future.done():  # (done: answered by its plan)
            continue
        try:  # before any draw: a row that fails here fails alone
            scorer = scorer_of(row.session_id)
            checks.append(scorer.verdicts.check(row.attached, block, scorer.prompt_ids, scorer.output_ids()))
            deciding.append((row, block))
        except Exception as error:  # noqa: BLE001 - logged; this row's caller gets it
            logger.exception("session %s: its verdict's rows could not be laid out", row.session_id)
            row.future.set_exception(error)
    if not deciding:
        return
    try:
        for (_, block), verdict in zip(deciding, decide_together(checks)):
            block.verdict = verdict
    except Exception as error:  # noqa: BLE001 - a bug: logged; these rows' callers get it, the others' stand
        logger.exception("deciding %d verdicts on the target failed", len(deciding))
        for row, _ in deciding:
            row.future.set_exception(error)


def verify_answer(
    scorer: TargetScorer, row: TargetRow, forwarded: ForwardedBlocks, draft: Optional[DraftBlock], block: TargetBlock
) -> ScoredRows:
    """The answer to `row`'s Score, from its scored `block` (of `draft`, where the session decides
    its verdicts here)."""
    if block.verdict is not None:
        if forwarded.takes(row.session_id):
            forwarded.on_scored(row.session_id, scorer.committed_len + 1, verdict_outcome(block.verdict, draft))
        return ScoredRows(block)
    # the server changes these rows before its policy reads them (stop tokens masked within
    # min_tokens, penalties, logit_bias): a top-k row could miss what they promote, so ship it whole
    sampling = scorer.sampling  # (the output's length is counted only where min_tokens asks: a copy a step)
    whole = sampling.processes_logits or (sampling.min_tokens > 0 and len(scorer.output_ids()) < sampling.min_tokens)
    top_k = None if whole else wire_top_k(scorer.policy, scorer.sampling)
    scored = ScoredRows(block) if top_k is None else ScoredRows(block, *compact_rows(block.logits, top_k))
    if not whole and forwarded.takes(row.session_id):
        try:
            forwarded.decide(scorer, row, scored)
        except Exception:  # noqa: BLE001 - logged; the block's answer stands, only its head start is lost
            logger.exception("session %s: deciding its verdict on the target failed", row.session_id)
    return scored
