"""A target worker's KV pool shared on demand, as the in-process lockstep shares it
(specdec_core/loop/kv_room.py): a session is admitted when its prompt fits the pool now, its
blocks come as its rows do, and where a step's rows do not fit, the youngest sessions are
preempted. A preempted session's next row waits here (parked), and the Score call with it; the
session resumes, oldest first, once its positions and that row fit again, by recomputing what
the prefix cache no longer holds, and its row then runs as it would have: its stream only pauses.

Every decision is rank 0's, on the torch thread, and reaches the other ranks as an operation
(`Preempt`, `Resume`) sent before the step that needs it, so every rank's pool stays alike.

Invariants: a session has at most one row here or in a step; a session's commit is applied once,
before its recompute (a row parked with a commit brings it to `Resume`); a block the draft
worker forwarded for a preempted session is withdrawn (the server's own Score comes instead)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional

from specdec_core.api.errors import SpecdecError
from specdec_core.api.request import MAX_DRAFT_TOKENS
from specdec_core.loop.kv_room import KVRoom, Need
from specdec_core.runtime.kv_pool import KVPool
from specdec_core.target.scorer import TargetScorer

from .admission import Overloaded
from .steps import PendingRow
from .worker_ops import Message, Preempt, Resume, TargetRow
from .worker_service import SessionMissing, on_torch_thread


@dataclass
class Arrival:
    """A session opened and waiting to be admitted (its Reset waits on `admitted`)."""

    num_prompt: int
    admitted: Future
    since: float


class PoolScheduler:
    def __init__(
        self,
        pool: KVPool,
        run: Callable[[Message], Any],
        requeue: Callable[[PendingRow], None],
        close_forwarding: Callable[[str], Optional[TargetRow]],
        chunk: int,
        max_waiting: int,
        wait_s: float,
    ):
        """`run(op)`: an operation on every rank; `requeue(row)`: a parked row into the next step;
        `close_forwarding(session_id)`: stop taking the session's forwarded blocks, returning
        the row of the one scored ahead and not yet claimed; `chunk`: prompt tokens a step;
        `max_waiting`, `wait_s`: how many sessions may wait to be admitted, and how long."""
        self.room = KVRoom(pool, "on_demand", preempt=self.preempt, recompute=self.recompute)
        self.run, self.requeue, self.close_forwarding = run, requeue, close_forwarding
        self.chunk, self.max_waiting, self.wait_s = chunk, max_waiting, wait_s
        self.scorers: dict[str, TargetScorer] = {}
        self.session_ids: dict[TargetScorer, str] = {}
        self.arrivals: dict[str, Arrival] = {}
        self.parked: dict[str, PendingRow] = {}  # the next row of each preempted session
        self.withdrawn: dict[str, TargetRow] = {}  # a preempted session's forwarded row, not to run

    def check_reach(self, num_prompt: int, max_tokens: int) -> None:
        """Refuse a request that could not run alone in the whole pool (SpecdecError)."""
        self.room.check_reach(num_prompt, max_tokens, MAX_DRAFT_TOKENS)

    def arrive(self, session_id: str, scorer: TargetScorer, num_prompt: int, max_tokens: int) -> Future:
        """A session opened: the future of its admission (Overloaded where too many wait)."""
        self.room.arrive(scorer, num_prompt, max_tokens, MAX_DRAFT_TOKENS)
        self.scorers[session_id], self.session_ids[scorer] = scorer, session_id
        arrival = self.arrivals[session_id] = Arrival(num_prompt, Future(), time.monotonic())
        self.let_in([])
        if not arrival.admitted.done() and len(self.arrivals) > self.max_waiting:
            self.withdraw(session_id)
            arrival.admitted.set_exception(Overloaded(f"{len(self.arrivals)} sessions wait for KV blocks"))
        return arrival.admitted

    def wait_admitted(self, session_id: str, scorer: TargetScorer, num_prompt: int, max_tokens: int) -> None:
        """(A handler's thread.) A session opened waits here until it is admitted; Overloaded
        where too many wait, or after `wait_s`."""
        admitted = on_torch_thread(self.arrive, session_id, scorer, num_prompt, max_tokens)
        try:
            admitted.result(timeout=self.wait_s)
        except TimeoutError:
            if on_torch_thread(self.withdraw, session_id):
                raise Overloaded(f"no KV blocks freed within {self.wait_s:g} s") from None
            admitted.result()  # admitted meanwhile

    def withdraw(self, session_id: str) -> bool:
        """An arrival that gave up waiting: whether it was still waiting (else it was admitted)."""
        arrival = self.arrivals.pop(session_id, None)
        if arrival is None:
            return False
        self.forget(session_id)
        return True

    def plan(self, rows: list[PendingRow]) -> list[PendingRow]:
        """Before a step: the rows that run in it. A preempted session's row waits; where the
        others' do not fit, the youngest sessions are preempted and theirs wait too."""
        running = [row for row in rows if not self.park_if_preempted(row)]
        self.room.make_room([self.need(row) for row in running])
        running = [row for row in running if not self.park_if_preempted(row)]
        self.let_in(running)
        return running

    def need(self, row: PendingRow) -> Need:
        scorer, step_row = self.scorers[row.session_id], row.row
        if row.prefill:
            return Need(scorer, scorer.committed_len + min(len(step_row.tokens), self.chunk))
        commit = step_row.commit_keep + len(step_row.commit_path)
        return Need(scorer, scorer.committed_len + commit + len(step_row.tokens))

    def park_if_preempted(self, row: PendingRow) -> bool:
        session_id = row.session_id
        if self.scorers[session_id] not in self.room.preempted:
            return False
        if self.withdrawn.get(session_id) is row.row:  # its Score comes again, as the server's own
            row.future.set_exception(SpecdecError("withdrawn: the session was preempted"))
        else:
            self.parked[session_id] = row
        return True

    def let_in(self, queued_rows: list[PendingRow]) -> None:
        """Resume preempted sessions and admit arrivals, oldest first, while they fit beside the
        rows queued; an arrival that waited past `wait_s` gets Overloaded."""
        queued = [self.need(row) for row in queued_rows]
        now = time.monotonic()
        for session_id in [sid for sid, arrival in self.arrivals.items() if now - arrival.since > self.wait_s]:
            self.arrivals[session_id].admitted.set_exception(Overloaded(f"no KV blocks freed within {self.wait_s:g} s"))
            self.withdraw(session_id)
        while True:
            waiting = [*self.room.preempted, *(self.scorers[sid] for sid in self.arrivals)]
            oldest = self.room.oldest(waiting)
            if oldest is None:
                return
            session_id = self.session_ids[oldest]
            if oldest in self.room.preempted:
                row = self.parked.get(session_id)
                added = self.added_positions(row) if row is not None else 0
                if row is None or not self.room.resumable(oldest, added, queued):
                    return  # its row is on its way, or does not fit yet
                positions = len(oldest.cached_ids) + added  # before its commit lands in cached_ids
                self.resume(session_id, self.room.resume(oldest))
                queued.append(Need(oldest, positions))
            else:
                arrival = self.arrivals[session_id]
                if not self.room.admit(oldest, arrival.num_prompt, queued):
                    return
                del self.arrivals[session_id]
                arrival.admitted.set_result(None)
                queued.append(Need(oldest, arrival.num_prompt))

    @staticmethod
    def added_positions(row: PendingRow) -> int:
        """The positions a parked row adds to its session's committed ones (a prompt chunk's are
        among them already: its recompute feeds them)."""
        if row.prefill:
            return 0
        return row.row.commit_keep + len(row.row.commit_path) + len(row.row.tokens)

    def preempt(self, scorer: TargetScorer) -> None:
        session_id = self.session_ids[scorer]
        forwarded = self.close_forwarding(session_id)
        if forwarded is not None:
            self.withdrawn[session_id] = forwarded
        self.run(Preempt(session_id=session_id))

    def recompute(self, scorer: TargetScorer) -> list[int]:
        """Resume on every rank, with the commit the parked row brings; the tokens to prefill."""
        session_id = self.session_ids[scorer]
        row = self.parked[session_id].row
        keep, path = (0, []) if row.prefill else (row.commit_keep, row.commit_path)
        return self.run(Resume(session_id=session_id, commit_keep=keep, commit_path=path))

    def resume(self, session_id: str, tokens: list[int]) -> None:
        """Its parked row runs after the recompute's prefill (a prompt chunk's future is the
        prefill's: the recompute feeds the rest of the prompt)."""
        self.withdrawn.pop(session_id, None)
        row = self.parked.pop(session_id)
        if row.prefill:
            row.row = row.row.model_copy(update={"tokens": tokens})
            if tokens:
                self.requeue(row)
            else:
                row.future.set_result(None)
            return
        row.row = row.row.model_copy(update={"commit_keep": 0, "commit_path": []})  # applied by Resume
        if not tokens:
            self.requeue(row)
            return
        prefill = PendingRow(TargetRow(session_id=session_id, tokens=tokens, prefill=True), Future())
        prefill.future.add_done_callback(lambda done: self.after_recompute(done, row))
        self.requeue(prefill)

    def after_recompute(self, prefill: Future, row: PendingRow) -> None:
        error = prefill.exception()
        if error is not None:
            row.future.set_exception(error)
        elif self.scorers.get(row.session_id) is not None:
            self.requeue(row)

    def leave(self, session_id: str) -> None:
        """A session released or expired: its blocks go back now, its waiting rows fail, and those
        waiting for blocks may come in."""
        scorer = self.scorers.get(session_id)
        if scorer is None:
            return
        gone = SessionMissing(f"no session {session_id!r} (released or expired)")
        arrival = self.arrivals.pop(session_id, None)
        if arrival is not None and not arrival.admitted.done():
            arrival.admitted.set_exception(gone)
        row = self.parked.pop(session_id, None)
        if row is not None and not row.future.done():
            row.future.set_exception(gone)
        self.forget(session_id)
        self.let_in([])

    def forget(self, session_id: str) -> None:
        scorer = self.scorers.pop(session_id)
        self.session_ids.pop(scorer, None)
        self.withdrawn.pop(session_id, None)
        self.room.leave(scorer)
