"""Many requests decoded together in one process: each runs its own speculative loop, and their
model calls are gathered so that every step is one draft round and one target forward over all
of them, as a worker's step batcher does (deployments/workers/steps.py) but without threads or gRPC. The
GPU report and the in-process benchmarks use it to measure a step at a given concurrency.

Invariant: a step runs only when every live loop waits on a model call, so each forward holds
every session that has work for it; between forwards the loops verify and commit in turn."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..api.request import Completion, GenerationRequest
from ..drafters.model import propose_step
from ..target.scorer import Row, TargetScorer, forward_rows
from ..trees.tree import Topology
from .engine import SpeculativeEngine, speculative_loop


@dataclass
class StepTimes:
    """Seconds spent in the steps' forwards (each timed to the device's end) and in all."""

    draft_s: list[float] = field(default_factory=list)  # per draft round
    target_s: list[float] = field(default_factory=list)  # per target forward
    target_rows: list[int] = field(default_factory=list)  # sessions in each target forward
    wall_s: float = 0.0


class Lockstep:
    """Gathers the loops' calls: target rows (`forward_rows`) and proposals (`propose_step`, as a
    draft worker's step: the model drafters' forwards in lockstep)."""

    def __init__(self, engine: SpeculativeEngine, times: StepTimes):
        self.engine, self.times = engine, times
        self.live = 0  # loops not finished
        self.rows: list[tuple[Row, asyncio.Future]] = []
        self.proposals: list[tuple[Any, asyncio.Future]] = []

    def wait(self, queue: list, item: Any) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        queue.append((item, future))
        self.run_if_all_wait()
        return future

    def run_if_all_wait(self) -> None:
        if not self.live or len(self.rows) + len(self.proposals) < self.live:
            return
        proposals, self.proposals = self.proposals, []
        rows, self.rows = self.rows, []
        if proposals:
            model = self.engine.draft_model
            blocks = self.timed(self.times.draft_s, propose_step, model, [item for item, _ in proposals])
            for (_, future), block in zip(proposals, blocks):
                future.set_result(block)
        if rows:
            self.times.target_rows.append(len(rows))
            blocks = self.timed(self.times.target_s, forward_rows, [row for row, _ in rows])
            for (_, future), block in zip(rows, blocks):
                future.set_result(block)

    def timed(self, into: list[float], call: Callable, *args: Any) -> Any:
        clock = time.perf_counter()
        result = call(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the forward's own time, not the next host wait's
        into.append(time.perf_counter() - clock)
        return result


class LockstepTarget:
    """A `TargetSession` whose scores wait for the step's one target forward."""

    def __init__(self, step: Lockstep, scorer: TargetScorer):
        self.step, self.scorer = step, scorer

    async def reset(self, *args: Any, **kwargs: Any) -> Any:
        return self.scorer.reset(*args, **kwargs)  # a prompt prefills alone, on arrival

    async def score(self, tokens: Sequence[int]):
        return await self.step.wait(self.step.rows, Row(self.scorer, tokens))

    async def score_tree(self, tokens: Sequence[int], tree: Topology):
        return await self.step.wait(self.step.rows, Row(self.scorer, tokens, tree=tree))

    def commit(self, num_keep: int) -> None:
        self.scorer.commit(num_keep)

    def commit_path(self, nodes: Sequence[int]) -> None:
        self.scorer.commit_path(nodes)

    async def guess(self, root_token: int, tree: str):
        return self.scorer.guess(root_token, tree)


class LockstepDraft:
    """A `DraftSession` whose proposals join the step's draft round."""

    def __init__(self, step: Lockstep, drafter: Any):
        self.step, self.drafter = step, drafter

    async def reset(self, prompt_ids: Sequence[int], sampling: Any) -> None:
        self.drafter.reset(prompt_ids, sampling)

    async def propose(self, max_tokens: int, batch_rows: int = 1, after: Sequence[int] = ()):
        return await self.step.wait(self.step.proposals, (self.drafter, max_tokens, batch_rows, after))

    def commit(self, new_tokens: Sequence[int]) -> None:
        self.drafter.commit(new_tokens)


def complete_together(
    engine: SpeculativeEngine, requests: Sequence[GenerationRequest], times: Optional[StepTimes] = None
) -> list[Completion]:
    """Decode `requests` at once, each step batched over all of them; `times` collects the steps'."""
    times = times if times is not None else StepTimes()
    step = Lockstep(engine, times)
    prepared = [engine.frontend.prepare(request) for request in requests]  # bad input fails before any work

    async def one(request) -> Completion:
        drafter, target = engine.sessions(
            request, functools.partial(LockstepTarget, step), functools.partial(LockstepDraft, step), run_ahead=False
        )
        try:
            chunks = [
                chunk async for chunk in speculative_loop(request, drafter, target, engine.frontend.output(request))
            ]
        finally:
            step.live -= 1
            step.run_if_all_wait()
        return Completion.from_chunks(chunks)

    async def all_of_them() -> list[Completion]:
        step.live = len(prepared)
        return await asyncio.gather(*(one(request) for request in prepared))

    clock = time.perf_counter()
    completions = asyncio.run(all_of_them())
    times.wall_s = time.perf_counter() - clock
    return completions
