"""Forwarded blocks on the target worker (run-ahead, specdec_core/loop/run_ahead.py): the draft worker
sends an ahead proposal for block t+1 straight here, with the verdict on block t it assumes; the
target decides block t's verdict itself (from the rows alone, `target_outcome`; or a session's
sampled verdict, verify_answers.py) and, when they agree, commits block t and scores block t+1
at once, before the server's next Score asks for it. That Score then gets the scored rows (or
their verdict) without waiting for a forward, so the target never waits for the server's
verdict and round trip between two blocks.

Invariants (per session, all under one lock):
- at most one forwarded block is scored and not yet claimed by the server (`prescored`), so a
  session never has two rows in one step, and a claim that does not match undoes nothing but
  the rows of that one block;
- a forwarded block is scored only on the verdict it assumed, reached by the server's own rule on
  the rows it receives, or the verdict the server takes from here, so the server's next Score
  commits exactly what the target committed (a Score that commits otherwise is a bug, and fails);
- a block is known by the sequence length before it (`after_length`, the prompt and the tokens
  generated): one for an older length is stale and dropped;
- a session that decides its sampled verdicts here (specdec_core/target/verdicts.py) draws the
  verdict of a block scored ahead from its verify stream; when that block goes unused, the stream
  is set back to where it stood before, so the session draws exactly what the loop draws."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from specdec_core.api.errors import SpecdecError
from specdec_core.loop.run_ahead import Outcome, target_outcome
from specdec_core.loop.stage_types import DraftBlock, TargetBlock
from specdec_core.target.compact import expand_rows
from specdec_core.target.scorer import TargetScorer
from specdec_core.target.verdicts import SessionVerdicts
from specdec_core.trees.topologies import default_bank

from .worker_ops import TargetRow
from .worker_service import SessionMissing

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardedBlock:
    after_length: int  # the sequence's tokens before block t (whose last is block t's root)
    assumed: list[int]  # the verdict on block t it assumes: its drafts kept, then the guess
    tokens: list[int]  # [guess, block t+1's drafts]: the next Score's tokens under that verdict
    tree: str = ""
    draft: Optional[DraftBlock] = None  # block t+1's drafts as its Score's (verify_answers.checked_draft)
    drafts_as_scored: bool = True  # their probabilities sent as its Score's (False: a draft worker from before)


@dataclass
class ScoredRows:
    """A verify row's answer: its block, and its rows as top-k (`top_ids`, `top_log_probs`
    `[T, k]`) where they may travel so (None: the whole `block.logits` `[T, V]`)."""

    block: TargetBlock
    top_ids: Optional[torch.Tensor] = None
    top_log_probs: Optional[torch.Tensor] = None
    forwarded: bool = False  # scored from the draft worker's forwarded block, before the Score came


@dataclass
class Prescored:
    row: TargetRow  # what was committed and scored, as a Score would ask it
    future: Future  # the row's answer (the ScoredRows a Score returns)
    draft: Optional[DraftBlock] = None  # its drafts, where the session decides its verdict here
    stream_state: Optional[torch.Tensor] = None  # the session's verify stream before that verdict's draws


@dataclass
class SessionForwards:
    verdict: Optional[tuple[int, Outcome]] = None  # (after_length, outcome) of the last block scored
    waiting: Optional[ForwardedBlock] = None  # arrived before its block's verdict
    prescored: Optional[Prescored] = None
    stale_below: int = 0  # forwarded blocks for shorter sequences come too late
    claiming: bool = False  # a Score is settling the block scored ahead
    paused: bool = False  # preempted: no block is scored ahead any more
    verdicts: Optional[SessionVerdicts] = None  # a session deciding its sampled verdicts here


class ForwardedBlocks:
    """The forwarded blocks of a target worker's sessions that take them (`open`); `submit(row,
    draft)` runs a row (of that draft, where its session decides verdicts here) in the worker's
    next step and returns its future (the step batcher's). The lock is
    never held while submitting: the batcher's own lock is taken before this one where a step
    expires idle sessions (`close`)."""

    def __init__(self, submit: Callable[[TargetRow, Optional[DraftBlock]], Future]):
        self.submit = submit
        self.lock = threading.Lock()
        self.sessions: dict[str, SessionForwards] = {}
        self.scored = self.used = 0  # over all sessions: blocks scored ahead, and claimed

    def open(self, session_id: str, verdicts: Optional[SessionVerdicts] = None) -> None:
        with self.lock:
            self.sessions[session_id] = SessionForwards(verdicts=verdicts)

    def close(self, session_id: str) -> None:
        with self.lock:
            self.sessions.pop(session_id, None)

    def pause(self, session_id: str) -> Optional[TargetRow]:
        """No block of the session is scored ahead from now on (it was preempted); the row of the
        one scored ahead that has not run yet, if any, to withdraw (its claim then falls back to
        the server's own row). One that ran is claimed as usual: its commit is applied."""
        with self.lock:
            state = self.sessions.get(session_id)
            if state is None:
                return None
            state.paused = True
            prescored = state.prescored
            return prescored.row if prescored is not None and not prescored.future.done() else None

    def takes(self, session_id: str) -> bool:
        with self.lock:
            return session_id in self.sessions

    def stats(self) -> dict:
        return {"forwarded_scored": self.scored, "forwarded_used": self.used}

    def on_scored(self, session_id: str, after_length: int, outcome: Outcome) -> None:
        """The target's verdict on the block it just scored for `session_id` (on the torch thread,
        before the block's answer goes out)."""
        with self.lock:
            state = self.sessions.get(session_id)
            if state is None:
                return
            state.verdict = (after_length, outcome)
            started = self._start(session_id, state)
        self._launch(started)

    def decide(self, scorer: TargetScorer, row: TargetRow, scored: ScoredRows) -> None:
        """The server's verdict on a scored block, decided here on the rows the server receives
        (a CPU copy of the wire's tensors, expanded as the server expands them)."""
        block = scored.block
        if scored.top_ids is None:
            rows = block.logits.cpu()
        else:
            rows = expand_rows(scored.top_ids.cpu(), scored.top_log_probs.cpu(), block.vocab_size)
        tree = default_bank().get(row.tree) if row.tree else None
        outcome = target_outcome(scorer.policy, scorer.sampling, row.tokens, tree, rows)
        self.on_scored(row.session_id, scorer.committed_len + 1, outcome)

    def on_forwarded(self, session_id: str, block: ForwardedBlock) -> None:
        """A block the draft worker forwarded; unknown sessions (released, or not taking them) drop it."""
        with self.lock:
            state = self.sessions.get(session_id)
            if state is None or block.after_length < state.stale_below:
                return
            state.waiting = block
            started = self._start(session_id, state)
        self._launch(started)

    def _start(self, session_id: str, state: SessionForwards) -> Optional[Prescored]:
        """(Under the lock.) The waiting block as a row to score ahead, when the verdict is the one
        it assumed and no block scored ahead is unclaimed or being claimed."""
        if state.prescored is not None or state.claiming or state.paused:
            return None
        if state.verdict is None or state.waiting is None:
            return None
        after_length, outcome = state.verdict
        if state.waiting.after_length > after_length:
            return None  # for a later block: it waits for that block's verdict
        block, state.waiting = state.waiting, None
        if block.after_length < after_length or block.assumed != outcome.new_tokens:
            return None  # stale, or the verdict went otherwise: the server's next Score drafts anew
        row = TargetRow(
            session_id=session_id,
            tokens=block.tokens,
            commit_keep=outcome.commit_keep,
            commit_path=list(outcome.commit_path),
            tree=block.tree,
        )
        stream_state = state.verdicts.generator.get_state() if state.verdicts is not None else None
        state.prescored, state.verdict = Prescored(row, Future(), block.draft, stream_state), None
        self.scored += 1
        return state.prescored

    def _launch(self, prescored: Optional[Prescored]) -> None:
        """(Outside the lock.) Submit a row `_start` made; its answer goes to its future."""
        if prescored is None:
            return
        try:
            answer = self.submit(prescored.row, prescored.draft)
        except Exception as error:  # noqa: BLE001 - the claimant's to see (a stopping worker)
            prescored.future.set_exception(error)
            return
        answer.add_done_callback(lambda done: chain(done, prescored.future))

    def claim(self, row: TargetRow, draft: Optional[DraftBlock] = None) -> tuple[Optional[Future], TargetRow]:
        """The server's Score `row`, of `draft` where the session decides its verdicts (on a gRPC
        handler thread): the future of the same row scored ahead, else None and the row to run
        (without its commit where a block scored ahead and unused already applied it). Waits for a
        block scored ahead to finish first."""
        with self.lock:
            state = self.sessions.get(row.session_id)
            if state is None:
                return None, row
            prescored = state.prescored  # kept until the claim settles, for `close` to see
            if prescored is None:  # the server moves past the verdict: its forwarded block is late
                if state.verdict is not None:
                    state.stale_below = state.verdict[0] + 1
                state.verdict = None
                return None, row
            state.claiming = True  # no block starts ahead until this claim settles
        try:
            error = prescored.future.exception()  # waits for its step
            with self.lock:
                state.prescored = None
            if isinstance(
                error, (SpecdecError, SessionMissing)
            ):  # refused by its checks (or withdrawn): nothing applied
                with self.lock:
                    state.verdict = None
                restore_stream(state, prescored)
                return None, row
            if error is not None:  # its forward failed: the session's state is the claimant's error
                raise error
            ahead = prescored.row
            if (row.commit_keep, row.commit_path) != (ahead.commit_keep, ahead.commit_path):
                raise RuntimeError(
                    f"session {row.session_id}: the server committed {row.commit_keep} / {row.commit_path}, "
                    f"the target's own verdict {ahead.commit_keep} / {ahead.commit_path}"
                )
            with self.lock:
                state.claiming = False
                if (row.tokens, row.tree) != (ahead.tokens, ahead.tree) or not same_probs(draft, prescored.draft):
                    state.verdict = None  # the verdict on the unused block is not the server's
                    restore_stream(state, prescored)
                    return None, row.model_copy(update={"commit_keep": 0, "commit_path": []})
                self.used += 1
                started = self._start(row.session_id, state)  # the block after it may be waiting
            self._launch(started)
            return prescored.future, row
        finally:
            with self.lock:
                state.claiming = False


def restore_stream(state: SessionForwards, unused: Prescored) -> None:
    """The verify stream as it stood before an unused block's verdict drew from it."""
    if unused.stream_state is not None:
        state.verdicts.generator.set_state(unused.stream_state)


def same_probs(draft: Optional[DraftBlock], ahead: Optional[DraftBlock]) -> bool:
    """Whether a Score's drafts were sampled with the probabilities of the block scored ahead."""
    sent, scored = (block.token_probs if block is not None else None for block in (draft, ahead))
    return sent is scored if sent is None or scored is None else torch.equal(sent, scored)


def chain(source: Future, target: Future) -> None:
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())
