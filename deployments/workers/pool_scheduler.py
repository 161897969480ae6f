"""A target worker's KV pool shared on demand, as the in-process lockstep shares it
(specdec_core/loop/kv_room.py): a session is admitted when its prompt fits the pool now, its
blocks come as its rows do, and where a step's rows do not fit, the youngest sessions are
preempted. A preempted session's next row waits here (parked), and the Score call with it; the
session resumes, oldest first, once its positions and that row fit again, by recomputing what
the prefix cache no longer holds, and its row then runs as it would have: its stream only pauses.

Every decision is rank 0's, on the torch thread, and reaches the other ranks as an operation
(`Preempt`, `Resume`) sent before the step that needs it, so every rank's pool stays alike.

Invariants: a session waiting to be admitted holds no block (its prompt's cached blocks come with
`Admit`); a session has at most one row here or in a step; a session's commit is applied once,
before its recompute (a row parked with a commit brings it to `Resume`); a block the draft worker
forwarded for a preempted session that has not run is withdrawn (the server's own Score comes
instead), and none is scored ahead for it after; every change to a pool is an operation all
ranks apply in the same torch-thread task, so their pools stay alike."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from specdec_core.api.errors import SpecdecError
from specdec_core.api.request import MAX_DRAFT_TOKENS
from specdec_core.loop.kv_room import KVRoom, Need
from specdec_core.runtime.kv_pool import KVPool
from specdec_core.target.scorer import TargetScorer

from .admission import Admission, Overloaded
from .steps import PendingRow, StepBatcher
from .worker_ops import Admit, Message, Preempt, Resume, TargetRow
from .worker_service import SessionMissing, on_torch_thread

logger = logging.getLogger(__name__)


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
        batcher: StepBatcher,
        pause_forwarding: Callable[[str], Optional[TargetRow]],
        admission: Admission,
        context: int,
    ):
        """`run(op)`: an operation on every rank; `batcher`: the worker's steps, whose rows this
        plans; `pause_forwarding(session_id)`: score no more of its forwarded blocks ahead,
        returning the row of one that has not run; `admission`: how many sessions may wait to be
        admitted, and how long; `context`: the model's positions."""
        self.room = KVRoom(pool, "on_demand", preempt=self.preempt, recompute=self.recompute)
        self.run, self.batcher, self.pause_forwarding = run, batcher, pause_forwarding
        self.chunk, self.max_waiting, self.wait_s = batcher.chunk, admission.max_waiting, admission.wait_s
        batcher.plan = self.plan
        if pool.num_blocks * pool.block_size < context:
            logger.warning(
                "the KV pool holds %d positions, fewer than the context's %d: a request without max_tokens "
                "is refused (raise kv_budget_mb or gpu_memory_utilization)",
                pool.num_blocks * pool.block_size,
                context,
            )
        self.scorers: dict[str, TargetScorer] = {}
        self.session_ids: dict[TargetScorer, str] = {}
        self.arrivals: dict[str, Arrival] = {}
        self.parked: dict[str, PendingRow] = {}  # the next row of each preempted session
        self.recomputing: set[str] = set()  # resumed, its parked row waiting for its recompute
        self.withdrawn: dict[str, list[TargetRow]] = {}  # forwarded rows of preempted sessions, not to run

    def arrive(self, session_id: str, scorer: TargetScorer, num_prompt: int, max_tokens: int) -> Future:
        """A session opened: the future of its admission (Overloaded where too many wait)."""
        self.room.arrive(scorer, num_prompt, max_tokens, MAX_DRAFT_TOKENS)
        self.scorers[session_id], self.session_ids[scorer] = scorer, session_id
        arrival = self.arrivals[session_id] = Arrival(num_prompt, Future(), time.monotonic())
        self.let_in()
        if not arrival.admitted.done() and len(self.arrivals) > self.max_waiting:
            self.withdraw(session_id)
            arrival.admitted.set_exception(Overloaded(f"{len(self.arrivals)} sessions wait for KV blocks"))
        return arrival.admitted

    def wait_admitted(self, session_id: str, scorer: TargetScorer, num_prompt: int, max_tokens: int) -> list[int]:
        """(A handler's thread.) A session opened waits here until it is admitted: the tokens to
        prefill. Overloaded where too many wait, or after `wait_s`."""
        admitted = on_torch_thread(self.arrive, session_id, scorer, num_prompt, max_tokens)
        try:
            return admitted.result(timeout=self.wait_s)
        except TimeoutError:
            if on_torch_thread(self.withdraw, session_id):
                raise self.waited_too_long() from None
            return admitted.result(timeout=self.wait_s)  # admitted meanwhile: its Admit is under way

    def waited_too_long(self) -> Overloaded:
        return Overloaded(f"no KV blocks freed within {self.wait_s:g} s")

    def waits(self, session_id: str) -> bool:
        """Whether the session waits for KV blocks (preempted, or its recompute not done)."""
        scorer = self.scorers.get(session_id)
        return scorer in self.room.preempted or session_id in self.recomputing

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
        scorer = self.scorers[row.session_id]
        if row.prefill:  # this step's chunk of it
            return Need(scorer, scorer.committed_len + min(len(row.row.tokens), self.chunk))
        return Need(scorer, scorer.committed_len + self.added_positions(row))

    def park_if_preempted(self, row: PendingRow) -> bool:
        session_id = row.session_id
        if self.scorers[session_id] not in self.room.preempted:
            return False
        if any(row.row is withdrawn for withdrawn in self.withdrawn.get(session_id, ())):  # the server's Score comes
            row.future.set_exception(SpecdecError("withdrawn: the session was preempted"))
        else:
            self.parked[session_id] = row
        return True

    def let_in(self, queued_rows: Optional[list[PendingRow]] = None) -> None:
        """Resume preempted sessions and admit arrivals, oldest first, while they fit beside the
        rows queued (those of the next step by default); one that waited past `wait_s` gets
        Overloaded."""
        if queued_rows is None:
            queued_rows = [
                row for row in list(self.batcher.pending) if self.scorers.get(row.session_id) in self.room.running
            ]
        queued = [self.need(row) for row in queued_rows]
        now = time.monotonic()
        for session_id in [sid for sid, arrival in self.arrivals.items() if now - arrival.since > self.wait_s]:
            self.arrivals[session_id].admitted.set_exception(self.waited_too_long())
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
                try:
                    arrival.admitted.set_result(self.run(Admit(session_id=session_id)))
                except Exception as error:  # its Reset fails (and releases it); the step's rows see it too
                    arrival.admitted.set_exception(error)
                    raise
                queued.append(Need(oldest, arrival.num_prompt))

    @staticmethod
    def added_positions(row: PendingRow) -> int:
        """The positions a verify row adds to its session's committed ones: the commit it brings
        and its tokens (a parked prompt chunk adds none: its recompute feeds them)."""
        if row.prefill:
            return 0
        return row.row.commit_keep + len(row.row.commit_path) + len(row.row.tokens)

    def preempt(self, scorer: TargetScorer) -> None:
        session_id = self.session_ids[scorer]
        forwarded = self.pause_forwarding(session_id)
        if forwarded is not None:
            self.withdrawn.setdefault(session_id, []).append(forwarded)
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
        row = self.parked.pop(session_id)
        if row.prefill:
            row.row = row.row.model_copy(update={"tokens": tokens})
            if tokens:
                self.batcher.requeue(row)
            else:
                row.future.set_result(None)
            return
        row.row = row.row.model_copy(update={"commit_keep": 0, "commit_path": []})  # applied by Resume
        if not tokens:
            self.batcher.requeue(row)
            return
        prefill = PendingRow(TargetRow(session_id=session_id, tokens=tokens, prefill=True), Future())
        self.recomputing.add(session_id)
        prefill.future.add_done_callback(lambda done: self.after_recompute(done, row))
        self.batcher.requeue(prefill)

    def after_recompute(self, prefill: Future, row: PendingRow) -> None:
        self.recomputing.discard(row.session_id)
        error = prefill.exception()
        if error is None and self.scorers.get(row.session_id) is None:
            error = SessionMissing(row.session_id)
        if error is not None:
            row.future.set_exception(error)
        else:
            self.batcher.requeue(row)

    def leave(self, session_id: str) -> None:
        """A session released or expired: its blocks go back now, its waiting rows fail, and those
        waiting for blocks may come in."""
        scorer = self.scorers.get(session_id)
        if scorer is None:
            return
        gone = SessionMissing(session_id)
        arrival = self.arrivals.pop(session_id, None)
        if arrival is not None and not arrival.admitted.done():
            arrival.admitted.set_exception(gone)
        row = self.parked.pop(session_id, None)
        if row is not None and not row.future.done():
            row.future.set_exception(gone)
        self.forget(session_id)
        self.let_in()

    def stats(self, kv_bytes_per_token: float) -> dict:
        """What the sessions hold of the pool now, and the preemptions so far."""
        pool = self.room.pool
        return {
            "kv_reserved_bytes": pool.num_used * pool.block_size * kv_bytes_per_token,
            "kv_pool_positions": pool.num_blocks * pool.block_size,
            "preemptions": self.room.preemptions,
        }

    def forget(self, session_id: str) -> None:
        scorer = self.scorers.pop(session_id)
        self.session_ids.pop(scorer, None)
        self.withdrawn.pop(session_id, None)
        self.recomputing.discard(session_id)
        self.room.leave(scorer)


def apply_pool_operation(op: Union[Admit, Preempt, Resume], scorer: TargetScorer) -> Optional[list[int]]:
    """What every rank of the group does for the scheduler's operations: the tokens to prefill
    after an `Admit` or a `Resume`."""
    if isinstance(op, Admit):
        return scorer.take_prompt()
    if isinstance(op, Preempt):
        return scorer.preempt()
    scorer.commit_scored(op.commit_keep, op.commit_path)
    return scorer.recompute()
