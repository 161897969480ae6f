"""Many requests decoded together in one process: each runs its own speculative loop, and their
model calls are gathered so that every step is one draft round and one target forward over all
of them, and their sampled chains' and trees' verdicts one decision (policies/step_verdicts.py), as a
worker's step batcher does (deployments/workers/steps.py) but without threads or gRPC. The
GPU report and the in-process benchmarks use it to measure a step at a given concurrency.

With a fixed KV pool (`kv_room.py`), requests wait to be admitted, and a step's rows may preempt
the youngest sessions, which wait (their row parked) until they resume.

Invariant: a step runs only when every live loop waits on a model call, a sampled verdict, its
admission or its resumption, so each forward holds every session that has work for it, and each
decision every sampled chain and tree; between them the loops commit in turn."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..api.request import Completion, GenerationRequest
from ..drafters.model import propose_step
from ..policies.sampled_chains import Check
from ..policies.step_verdicts import decide_together
from ..runtime.batching import fix_pool
from ..runtime.model_runner import runner_of
from ..target.scorer import Row, TargetScorer, forward_rows
from ..trees.tree import Topology
from .engine import SpeculativeEngine, speculative_loop
from .kv_room import Admission, KVRoom, Need
from .stage_types import DraftBlock, Verdict


@dataclass
class Arrival:
    """A request waiting for the KV pool to admit it: its session and its reset's arguments."""

    scorer: TargetScorer
    reset: tuple  # prompt_ids, policy, sampling, heads_kind
    future: asyncio.Future  # its prefill's result (Prefilled) once admitted


@dataclass
class StepTimes:
    """Seconds spent in the steps' forwards (each timed to the device's end) and in all."""

    draft_s: list[float] = field(default_factory=list)  # per draft round, and per heads guess
    target_s: list[float] = field(default_factory=list)  # per target forward
    target_rows: list[int] = field(default_factory=list)  # sessions in each target forward
    wall_s: float = 0.0


class Lockstep:
    """Gathers the loops' calls: target rows (`forward_rows`) and proposals (`propose_step`, as a
    draft worker's step: the model drafters' forwards in lockstep)."""

    def __init__(self, engine: SpeculativeEngine, times: StepTimes, room: Optional[KVRoom] = None):
        self.engine, self.times, self.room = engine, times, room
        self.live = 0  # loops not finished
        self.rows: list[tuple[Row, asyncio.Future]] = []
        self.proposals: list[tuple[Any, asyncio.Future]] = []
        self.checks: list[tuple[Check, asyncio.Future]] = []  # sampled chains to decide together
        self.parked: list[tuple[Row, asyncio.Future]] = []  # rows of preempted sessions
        self.arriving: list[Arrival] = []

    def wait(self, queue: list, item: Any) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        preempted = queue is self.rows and self.room is not None and item.scorer in self.room.preempted
        (self.parked if preempted else queue).append((item, future))
        self.run_if_all_wait()
        return future

    def run_if_all_wait(self) -> None:
        while self.live and self.waiting() >= self.live:
            if not self.step():
                raise RuntimeError("every session waits and none can run")  # a bug: never a hang

    def waiting(self) -> int:
        """Loops waiting on the step (a step swaps its queues for new ones)."""
        return sum(map(len, (self.rows, self.proposals, self.checks, self.parked, self.arriving)))

    def step(self) -> bool:
        """The verdicts that wait, one draft round and one target forward over what waits, then
        whom the pool lets in; False where nothing could run."""
        checks, self.checks = self.checks, []
        proposals, self.proposals = self.proposals, []
        rows, self.rows = self.rows, []
        if checks:
            for (_, future), verdict in zip(checks, decide_together([check for check, _ in checks])):
                future.set_result(verdict)
        if proposals:
            model = self.engine.draft_model
            blocks = self.timed(self.times.draft_s, propose_step, model, [item for item, _ in proposals])
            for (_, future), block in zip(proposals, blocks):
                future.set_result(block)
        if rows and self.room is not None:
            self.room.make_room([Need.of(row) for row, _ in rows])
            self.parked += [(row, future) for row, future in rows if row.scorer in self.room.preempted]
            rows = [(row, future) for row, future in rows if row.scorer not in self.room.preempted]
        if rows:
            self.times.target_rows.append(len(rows))
            blocks = self.timed(self.times.target_s, forward_rows, [row for row, _ in rows])
            for (_, future), block in zip(rows, blocks):
                future.set_result(block)
        return self.let_in() or bool(checks or proposals or rows)

    def let_in(self) -> bool:
        """Resume preempted sessions and admit new requests, oldest first, while they fit beside
        the rows queued; a resumed session's parked row joins the next step."""
        let = False
        while self.room is not None:
            queued = [Need.of(row) for row, _ in self.rows]
            oldest = self.room.oldest([*self.room.preempted, *(arrival.scorer for arrival in self.arriving)])
            parked = next((entry for entry in self.parked if entry[0].scorer is oldest), None)
            arrival = next((arrival for arrival in self.arriving if arrival.scorer is oldest), None)
            if parked is not None and self.room.resumable(oldest, len(parked[0].tokens), queued):
                self.parked.remove(parked)
                oldest.prefill(self.room.resume(oldest))
                self.rows.append(parked)
            elif arrival is not None and self.room.admit(oldest, len(arrival.reset[0]), queued):
                self.arriving.remove(arrival)
                self.start(arrival)
            else:  # none waits, or the oldest does not fit yet (or its row is on its way)
                return let
            let = True
        return let

    def start(self, arrival: Arrival) -> None:
        """An admitted request's prefill, now: the next admission sees the blocks it took."""
        try:
            arrival.future.set_result(arrival.scorer.reset(*arrival.reset))
        except Exception as error:  # noqa: BLE001 - to the request's own loop, which raises it
            arrival.future.set_exception(error)

    async def decide(self, check: Check) -> Verdict:
        """A loop's verify: sampled chains and trees wait to be decided with the step's others, the
        rest at once."""
        if not check.decided_together:
            return check.verdict()
        return await self.wait(self.checks, check)

    def leave(self, scorer: TargetScorer) -> None:
        """A loop is done: its KV goes back to the pool for those waiting (and whatever it had
        queued, where it ended by an error, is dropped)."""
        if self.room is not None:
            self.room.leave(scorer)
        self.rows = [entry for entry in self.rows if entry[0].scorer is not scorer]
        self.parked = [entry for entry in self.parked if entry[0].scorer is not scorer]
        self.arriving = [arrival for arrival in self.arriving if arrival.scorer is not scorer]
        self.live -= 1
        self.run_if_all_wait()

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

    async def reset(self, *args: Any) -> Any:
        """A prompt prefills alone, on arrival, or when the KV pool admits it (kv_room.py)."""
        if self.step.room is None:
            return self.scorer.reset(*args)
        future = asyncio.get_running_loop().create_future()
        self.step.arriving.append(Arrival(self.scorer, args, future))
        self.step.run_if_all_wait()
        return await future

    async def score(self, tokens: Sequence[int], draft: Optional[DraftBlock] = None):
        return await self.step.wait(self.step.rows, Row(self.scorer, tokens))

    async def score_tree(self, tokens: Sequence[int], tree: Topology, draft: Optional[DraftBlock] = None):
        return await self.step.wait(self.step.rows, Row(self.scorer, tokens, tree=tree))

    def commit(self, num_keep: int) -> None:
        self.scorer.commit(num_keep)

    def commit_path(self, nodes: Sequence[int]) -> None:
        self.scorer.commit_path(nodes)

    async def guess(self, root_token: int, tree: str):
        """The heads' guess, each request's own call (not batched), timed as the draft's."""
        return self.step.timed(self.step.times.draft_s, self.scorer.guess, root_token, tree)


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
    engine: SpeculativeEngine,
    requests: Sequence[GenerationRequest],
    times: Optional[StepTimes] = None,
    kv_positions: Optional[int] = None,
    admission: Admission = "on_demand",
) -> list[Completion]:
    """Decode `requests` at once, each step batched over all of them; `times` collects the steps'.
    `kv_positions`: the target's pool fixed to hold that many, shared by `admission` (kv_room.py),
    for these requests only."""
    times = times if times is not None else StepTimes()
    prepared = [engine.frontend.prepare(request) for request in requests]  # bad input fails before any work
    runner = runner_of(engine.target_model.model)
    kept_pool = runner.pool
    room = None
    if kv_positions:  # a budget of one "byte" a position: a pool of kv_positions positions
        room = KVRoom(fix_pool(engine.target_model, kv_positions, 1.0), admission)
        room.pool.prefix_caching = kept_pool.prefix_caching if kept_pool is not None else True
    step = Lockstep(engine, times, room)

    def reach(request) -> tuple[int, int, int]:
        return len(request.prompt_ids), request.sampling.max_tokens, request.num_draft_tokens

    async def one(request) -> Completion:
        drafter, target = engine.sessions(
            request, functools.partial(LockstepTarget, step), functools.partial(LockstepDraft, step), run_ahead=False
        )
        if room is not None:
            room.arrive(target.scorer, *reach(request))
        try:
            chunks = [
                chunk
                async for chunk in speculative_loop(
                    request, drafter, target, engine.frontend.output(request), step.decide
                )
            ]
        finally:
            step.leave(target.scorer)
        return Completion.from_chunks(chunks)

    async def all_of_them() -> list[Completion]:
        step.live = len(prepared)
        return await asyncio.gather(*(one(request) for request in prepared))

    clock = time.perf_counter()
    try:
        for request in prepared if room is not None else ():
            room.check_reach(*reach(request))  # before any work, as bad input
        completions = asyncio.run(all_of_them())
    finally:
        if room is not None:
            runner.pool = kept_pool
    times.wall_s = time.perf_counter() - clock
    return completions
