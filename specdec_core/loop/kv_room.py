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
  (prompt, max_tokens and a block of its drafts) fits beside the reaches of those running; none
  is ever preempted, and a long reach leaves few running.

Invariants: the oldest waiting session is never passed by a younger one; a request whose reach
could not fit the empty pool is refused before any work (`check_reach`), so a session running
alone always fits.

The room decides; `preempt` and `recompute` carry its decisions out on the sessions (in process:
the scorer's own methods; a tensor-parallel target worker: operations every rank applies)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from ..api.errors import SpecdecError
from ..api.request import session_positions
from ..runtime.kv_pool import KVPool, blocks_for
from ..target.scorer import Row, TargetScorer

Admission = Literal["on_demand", "reach"]


@dataclass(frozen=True)
class Need:
    """A session's row in the next step: the positions its cache holds once the row is in (its
    committed ones, a commit the row brings first, and the row's tokens)."""

    scorer: TargetScorer
    positions: int

    @classmethod
    def of(cls, row: Row) -> "Need":
        return cls(row.scorer, row.scorer.committed_len + len(row.tokens))


class KVRoom:
    def __init__(
        self,
        pool: KVPool,
        admission: Admission = "on_demand",
        preempt: Callable[[TargetScorer], None] = TargetScorer.preempt,
        recompute: Callable[[TargetScorer], list[int]] = TargetScorer.recompute,
    ):
        self.pool, self.admission = pool, admission
        self.preempt_session, self.recompute_session = preempt, recompute
        self.arrivals = itertools.count()
        self.arrival: dict[TargetScorer, int] = {}  # every session admitted or waiting, by arrival
        self.reach: dict[TargetScorer, int] = {}  # the blocks each may take at most
        self.running: set[TargetScorer] = set()  # admitted and holding its blocks
        self.preempted: set[TargetScorer] = set()  # admitted, its blocks taken back: it waits to resume
        self.reserved = 0  # with `reach` admission: the reaches of the sessions admitted
        self.preemptions = 0

    def reach_blocks(self, num_prompt: int, max_tokens: int, num_draft_tokens: int) -> int:
        return blocks_for(session_positions(num_prompt, max_tokens, num_draft_tokens), self.pool.block_size)

    def check_reach(self, num_prompt: int, max_tokens: int, num_draft_tokens: int) -> None:
        """Refuse a request (SpecdecError) whose reach is more than the whole pool: alone, it could
        still run out."""
        reach = self.reach_blocks(num_prompt, max_tokens, num_draft_tokens)
        if reach > self.pool.num_blocks:
            raise SpecdecError(
                f"a prompt of {num_prompt} tokens and max_tokens={max_tokens} need {reach} KV blocks; "
                f"the pool holds {self.pool.num_blocks}",
                "max_tokens",
            )

    def arrive(self, scorer: TargetScorer, num_prompt: int, max_tokens: int, num_draft_tokens: int) -> None:
        """A new request's session joins the queue (its turn comes by arrival)."""
        self.arrival[scorer] = next(self.arrivals)
        self.reach[scorer] = self.reach_blocks(num_prompt, max_tokens, num_draft_tokens)

    def spare(self, queued: Sequence[Need]) -> int:
        """Blocks left once the rows queued for the next step have taken theirs."""
        return self.pool.available - self.wanted(queued)

    def admit(self, scorer: TargetScorer, num_prompt: int, queued: Sequence[Need]) -> bool:
        """Whether a new request (the oldest waiting) starts now, beside the `queued` rows; if so
        it runs from now on (with `reach` admission, holding its reach)."""
        if self.admission == "reach":
            if self.reserved + self.reach[scorer] > self.pool.num_blocks:
                return False
            self.reserved += self.reach[scorer]
        elif blocks_for(session_positions(num_prompt, 0), self.pool.block_size) > self.spare(queued):
            return False  # its prompt and a verify row of the most drafts
        self.running.add(scorer)
        return True

    def make_room(self, needs: Sequence[Need]) -> None:
        """Preempt the youngest running sessions (those waiting on a draft round too) until this
        step's rows of the others fit."""
        running_needs = list(needs)
        while self.wanted(running_needs) > self.pool.available:
            running = sorted(self.running, key=self.arrival.__getitem__)
            if len(running) <= 1:  # refused by check_reach: a lone session always fits
                raise RuntimeError(f"KV pool of {self.pool.num_blocks} blocks short for one session")
            self.preempt(running[-1])
            running_needs = [need for need in running_needs if need.scorer in self.running]

    def wanted(self, needs: Sequence[Need]) -> int:
        """The blocks a step of `needs` takes beyond what their sessions hold (rejected positions
        of the last step are cropped first)."""
        return sum(need.scorer.cache.blocks_wanted(need.positions, self.pool.block_size) for need in needs)

    def preempt(self, scorer: TargetScorer) -> None:
        self.preempt_session(scorer)
        self.running.discard(scorer)
        self.preempted.add(scorer)
        self.preemptions += 1

    def resumable(self, scorer: TargetScorer, num_new: int, queued: Sequence[Need]) -> bool:
        """Whether a preempted session's positions (`cached_ids`) and the `num_new` its next row
        adds fit beside the `queued` rows (its cached blocks not counted: the recompute itself
        may evict them)."""
        return blocks_for(len(scorer.cached_ids) + num_new, self.pool.block_size) <= self.spare(queued)

    def resume(self, scorer: TargetScorer) -> list[int]:
        """The session runs again: the tokens to prefill (`TargetScorer.recompute`)."""
        self.preempted.discard(scorer)
        self.running.add(scorer)
        return self.recompute_session(scorer)

    def leave(self, scorer: TargetScorer) -> None:
        """A request is done: its blocks go back now, not when its objects are collected."""
        scorer.cache.drop()
        if scorer in self.running and self.admission == "reach":
            self.reserved -= self.reach[scorer]
        self.running.discard(scorer)
        self.preempted.discard(scorer)
        self.reach.pop(scorer, None)
        self.arrival.pop(scorer, None)

    def oldest(self, waiting: Sequence[TargetScorer]) -> TargetScorer | None:
        return min(waiting, key=self.arrival.__getitem__, default=None)
