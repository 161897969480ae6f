"""Room in a fixed KV pool for the sessions that share it: who is admitted, who runs each step,
who is preempted when the pool runs out, and who resumes (vLLM's scheduler, with recompute).

Two admissions, both first come first served:
- `on_demand` (vLLM's): a request is admitted by what its prompt needs now. A step's rows take the
  blocks of their new positions (K + 1 a verify row; what is rejected is cropped and given
  back); where they do not fit, the youngest sessions are preempted: each publishes its committed
  positions' full blocks to the prefix cache and gives every block back. A preempted session
  resumes, oldest first, once its positions and its row fit again, by recomputing what the prefix
  cache no longer holds; its stream only pauses. A request may so run to the end of the context.
- `reach` (a worker's admission before): a request is admitted only when its whole reach
  (prompt, max_tokens and a block of drafts) fits beside the reaches of those running; none is
  ever preempted, and a long reach leaves few running.

Invariant: the oldest waiting session is never passed by a younger one, and a session that
cannot fit an empty pool fails alone, with a clear error."""

from __future__ import annotations

import itertools
from typing import Literal, Optional, Sequence

from ..api.errors import SpecdecError
from ..api.request import session_positions
from ..runtime.kv_pool import KVPool, blocks_for
from ..target.scorer import Row, TargetScorer

Admission = Literal["on_demand", "reach"]


class KVRoom:
    def __init__(self, pool: KVPool, admission: Admission = "on_demand"):
        self.pool, self.admission = pool, admission
        self.arrivals = itertools.count()
        self.arrival: dict[TargetScorer, int] = {}  # every session admitted or waiting, by arrival
        self.running: set[TargetScorer] = set()  # admitted and holding its blocks
        self.preempted: set[TargetScorer] = set()  # admitted, its blocks taken back: it waits to resume
        self.reach: dict[TargetScorer, int] = {}  # with `reach` admission: the blocks each may take
        self.preemptions = 0

    def arrive(self, scorer: TargetScorer) -> None:
        """A new request's session joins the queue (its turn comes by arrival)."""
        self.arrival[scorer] = next(self.arrivals)

    def fits(self, scorer: TargetScorer, prompt: Sequence[int], max_tokens: int) -> bool:
        """Whether a new request's prefill may start now (it is the oldest waiting); with `reach`
        admission this holds its reach from now on. A request whose reach is more than the whole
        pool fails (SpecdecError): alone, it could still run out."""
        reach = blocks_for(session_positions(len(prompt), max_tokens), self.pool.block_size)
        self.check_alone(reach, f"a prompt of {len(prompt)} tokens and max_tokens={max_tokens}")
        if self.admission == "reach":
            if sum(self.reach.values()) + reach > self.pool.num_blocks:
                return False
            self.reach[scorer] = reach
        else:
            # the prompt and one verify row of the most drafts
            if blocks_for(session_positions(len(prompt), 0), self.pool.block_size) > self.pool.available:
                return False
        self.running.add(scorer)
        return True

    def check_alone(self, blocks: int, what: str) -> None:
        if blocks > self.pool.num_blocks:
            raise SpecdecError(f"{what} need {blocks} KV blocks; the pool holds {self.pool.num_blocks}", "max_tokens")

    def rows_that_fit(self, rows: Sequence[Row]) -> tuple[list[Row], list[Row]]:
        """This step's rows that run, and those whose sessions were preempted to make room for
        the others: the youngest first, also sessions waiting on a draft round."""
        running_rows = list(rows)
        while self.wanted(running_rows) > self.pool.available:
            running = sorted(self.running, key=self.arrival.__getitem__)
            if len(running) <= 1:  # admitted within its reach, a lone session always fits
                raise RuntimeError(f"KV pool of {self.pool.num_blocks} blocks short for one session")
            self.preempt(running[-1])
            running_rows = [row for row in running_rows if row.scorer in self.running]
        return running_rows, [row for row in rows if row.scorer not in self.running]

    def wanted(self, rows: Sequence[Row]) -> int:
        """The blocks a step of `rows` takes beyond what their sessions hold (rejected positions
        of the last step are cropped first)."""
        return sum(
            row.scorer.cache.blocks_wanted(row.scorer.committed_len + len(row.tokens), self.pool.block_size)
            for row in rows
        )

    def preempt(self, scorer: TargetScorer) -> None:
        scorer.preempt()
        self.running.discard(scorer)
        self.preempted.add(scorer)
        self.preemptions += 1

    def resumable(self, scorer: TargetScorer, row: Row) -> bool:
        """Whether a preempted session's positions and its next `row` fit now (no prefix cache
        counted: what it holds may be evicted by the recompute itself)."""
        needed = blocks_for(len(scorer.cached_ids) + len(row.tokens), self.pool.block_size)
        return needed <= self.pool.available

    def resume(self, scorer: TargetScorer) -> list[int]:
        """The session runs again: the tokens to prefill (`TargetScorer.recompute`)."""
        self.preempted.discard(scorer)
        self.running.add(scorer)
        return scorer.recompute()

    def leave(self, scorer: TargetScorer) -> None:
        """A request is done: its blocks go back now, not when its objects are collected."""
        scorer.cache.drop()
        self.running.discard(scorer)
        self.preempted.discard(scorer)
        self.reach.pop(scorer, None)
        self.arrival.pop(scorer, None)

    def oldest(self, waiting: Sequence[TargetScorer]) -> Optional[TargetScorer]:
        return min(waiting, key=self.arrival.__getitem__, default=None)
