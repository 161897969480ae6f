"""Continuous batching in a worker: the calls of different sessions (the target's Score calls and
the prompts of new sessions in chunks, the draft's Propose calls) gathered into one step on the
torch thread.

A call enqueues its row and waits. The first one schedules a step; a step waits for the other
open sessions' rows at most `window_s` (not at all when its session is the only one open), takes
every row queued, runs them as one forward and answers each. A prompt longer than `chunk`
tokens is prefilled over several steps, beside the verify rows of running sessions, so it never
holds them for its whole length. A row that fails its checks fails alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional


class WorkerStopping(RuntimeError):
    """The torch thread takes no more work: the worker process is going away."""


def schedule(executor, call: Callable[..., Any], *args: Any) -> Future:
    """`executor.submit`, raising WorkerStopping where a stopping process refuses the work."""
    try:
        return executor.submit(call, *args)
    except RuntimeError as error:
        raise WorkerStopping(str(error)) from error


@dataclass
class PendingRow:
    row: Any  # the session's part of the step (worker_ops.DraftRow or TargetRow)
    future: Future
    reply: Optional[Callable[[Any], Any]] = None  # builds the answer from the row's result, on the torch thread
    attached: Any = None  # what its answer reads beside its result (a target row's: its draft, for its verdict)

    @property
    def session_id(self) -> str:
        return self.row.session_id

    @property
    def prefill(self) -> bool:
        return getattr(self.row, "prefill", False)


class StepBatcher:
    def __init__(
        self,
        executor,
        run_step: Callable[[list[Any]], list[Any]],
        check_row: Callable[[PendingRow], None],
        open_sessions: Callable[[], int],
        window_s: float,
        chunk: int,
        plan: Callable[[list[PendingRow]], list[PendingRow]] = list,
        settle: Callable[[list[PendingRow], list[Any]], None] = lambda rows, results: None,
    ):
        """`run_step(rows)`: one step over the rows (worker_ops' rows), a result (None for a prompt
        chunk) per row; `check_row` raises for a row that may not run (and
        may set its `reply`); `open_sessions()`: how many rows a full step would hold;
        `plan(rows)`: those of the checked rows that run now (it keeps the others, to `requeue`
        or answer them later); `settle(rows, results)`: what the step's rows decide together from
        their results before any is answered (the target's verdicts; it fails a row it cannot
        settle by the row's future)."""
        self.executor, self.run_step, self.check_row, self.open_sessions = executor, run_step, check_row, open_sessions
        self.plan, self.settle = plan, settle
        self.window_s, self.chunk = window_s, chunk
        self.pending: list[PendingRow] = []
        self.arrived = threading.Condition()
        self.scheduled = False
        self.steps = 0
        self.rows = 0
        self.step_seconds = 0.0  # the steps' time on the torch thread

    def submit(self, step_row: Any, attached: Any = None) -> Future:
        """A row for the next step; its future gives the row's result (`reply(result)` when
        `check_row` set one), or None once a prompt (prefill=True, tokens) is prefilled."""
        row = PendingRow(step_row, Future(), attached=attached)
        with self.arrived:
            self.pending.append(row)
            self.arrived.notify()
            if not self.scheduled:
                try:
                    schedule(self.executor, self.step)
                except WorkerStopping:
                    self.pending.remove(row)
                    raise
                self.scheduled = True
        return row.future

    def requeue(self, row: PendingRow) -> None:
        """A row `plan` kept back: it joins the next step (on the torch thread)."""
        with self.arrived:
            self.pending.append(row)
            if not self.scheduled:
                try:
                    schedule(self.executor, self.step)
                except WorkerStopping as error:
                    self.pending.remove(row)
                    row.future.set_exception(error)
                    return
                self.scheduled = True

    def step(self) -> None:
        """On the torch thread: gather, run one forward, answer; schedule the next if rows wait."""
        with self.arrived:
            deadline = time.monotonic() + self.window_s
            while len(self.pending) < self.open_sessions() and (left := deadline - time.monotonic()) > 0:
                self.arrived.wait(left)
            taken, self.pending = self.pending, []
        try:
            self.run(taken)
        finally:
            with self.arrived:
                self.scheduled = False
                if self.pending:
                    try:
                        schedule(self.executor, self.step)
                        self.scheduled = True
                    except WorkerStopping as error:
                        for row in self.pending:
                            row.future.set_exception(error)
                        self.pending = []

    def run(self, taken: list[PendingRow]) -> None:
        rows = []
        for row in taken:
            try:
                self.check_row(row)
            except Exception as error:  # noqa: BLE001 - this row's caller gets it; the others run
                row.future.set_exception(error)
                continue
            rows.append(row)
        try:
            rows = self.plan(rows)
        except Exception as error:  # noqa: BLE001 - a bug: the step's rows fail, the worker goes on
            for row in rows:
                if not row.future.done():
                    row.future.set_exception(error)
            return
        if not rows:
            return
        ops = [
            row.row.model_copy(update={"tokens": row.row.tokens[: self.chunk]}) if row.prefill else row.row
            for row in rows
        ]
        clock = time.perf_counter()
        try:
            results = self.run_step(ops)
        except Exception as error:  # noqa: BLE001 - the forward failed for every row in it
            for row in rows:
                row.future.set_exception(error)
            return
        try:
            self.settle(rows, results)
        except Exception as error:  # noqa: BLE001 - a bug: the step's rows fail, the worker goes on
            for row in rows:
                if not row.future.done():
                    row.future.set_exception(error)
            return
        self.step_seconds += time.perf_counter() - clock
        self.steps += 1
        self.rows += len(rows)
        for row, result in zip(rows, results):
            if row.future.done():  # answered already (a failed plan parked it)
                continue
            if row.prefill:
                row.row = row.row.model_copy(update={"tokens": row.row.tokens[self.chunk :]})
                if row.row.tokens:
                    with self.arrived:
                        self.pending.append(row)  # the rest of its prompt goes in the next step
                else:
                    row.future.set_result(None)
                continue
            try:
                row.future.set_result(row.reply(result) if row.reply else result)
            except Exception as error:  # noqa: BLE001 - building one answer failed; the others stand
                row.future.set_exception(error)
