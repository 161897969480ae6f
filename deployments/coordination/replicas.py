"""Where a worker deployment's replicas serve, as its Serve handle says, for the requests of one
server replica. Asking the handle costs a round trip through Serve's router, which on a loaded
machine took over half a second (64 streams on 2 cores): a request takes an address the handle
named within the last `keep_s` (those, in turn), and the directory asks again in the background
at most every `refresh_s`, each time within `refresh_timeout_s`. A replica the handle stops
naming (stopped by a rollout, or dead) is given out no more once `keep_s` has passed since it was
last named; a stopping worker replica serves at least that long (worker.py).

With none named that recently, a request waits for the handle's answer:
- with some named before (an idle server): up to `refresh_timeout_s`, then it takes one of them
  anyway (the handle is slow or has none ready: a replica that died fails its request as it
  would have: 503 for the target, target-only for the draft);
- with none ever named (the service starting, or this server replica new): up to its `wait_s`
  (the target's: the worker's `admission_wait_s`), asking again while the handle fails, then
  WorkerUnavailable. A cold handle or workers still loading their model take longer to answer
  than a refresh may, and a request that arrives then should be served, not refused. The question
  itself runs on for `FIRST_ANSWER_S` at least, so that a short wait still finds the replica for
  the requests after it."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Awaitable, Callable, Optional

from ..ingress.error_replies import WorkerUnavailable

# between two failed first answers: a handle of a deployment with no replica may fail at once
RETRY_PAUSE_S = 0.2
REFRESH_S, KEEP_S = 1.0, 5.0
# how long a stopping worker replica serves on (worker.py): servers give it out up to KEEP_S after
# the handle last named it, and its requests then need a moment to reach it
FORGET_S = KEEP_S + 1.0
FIRST_ANSWER_S = 30.0  # how long a first question may take (a cold handle, workers loading)


class ReplicaDirectory:
    def __init__(
        self,
        role: str,
        lookup: Callable[[float], Awaitable[str]],
        refresh_timeout_s: float,
        refresh_s: float = REFRESH_S,
        keep_s: float = KEEP_S,
    ):
        """`lookup(timeout_s)`: one replica's address from the handle (raises when none is ready
        within `timeout_s`)."""
        self.role, self.lookup = role, lookup
        self.refresh_timeout_s, self.refresh_s, self.keep_s = refresh_timeout_s, refresh_s, keep_s
        self.named: dict[str, float] = {}  # address: when the handle last named it
        self.asked_at = float("-inf")
        self.asking: Optional[asyncio.Task] = None
        self.turn = itertools.count()

    async def pick(self, wait_s: float) -> str:
        """On the caller's event loop (always the same one): a replica's address for one request,
        waiting up to `wait_s` where the handle never named one."""
        deadline = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            recent = [address for address, named_at in self.named.items() if now - named_at < self.keep_s]
            if not recent or now - self.asked_at >= self.refresh_s:
                self.ask()
            if recent:
                return self.take(recent)
            if self.named:  # named before, not lately: wait a refresh's time for the handle's word
                try:
                    return await asyncio.wait_for(asyncio.shield(self.asking), self.refresh_timeout_s)
                except (asyncio.TimeoutError, WorkerUnavailable):
                    return self.take(list(self.named))
            try:
                return await asyncio.wait_for(asyncio.shield(self.asking), deadline - time.monotonic())
            except asyncio.TimeoutError:
                raise WorkerUnavailable(f"no {self.role} worker replica ready within {wait_s:g} s") from None
            except WorkerUnavailable:
                if time.monotonic() + RETRY_PAUSE_S >= deadline:
                    raise
                await asyncio.sleep(RETRY_PAUSE_S)

    def take(self, addresses: list[str]) -> str:
        return addresses[next(self.turn) % len(addresses)]

    def ask(self) -> None:
        """On the caller's event loop: ask the handle in the background, unless a question is out
        (a first one for as long as a first answer may take)."""
        if self.asking is not None:
            return
        self.asked_at = time.monotonic()
        timeout_s = self.refresh_timeout_s if self.named else max(FIRST_ANSWER_S, self.refresh_timeout_s)
        self.asking = asyncio.ensure_future(self._answer(timeout_s))
        self.asking.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved

    async def _answer(self, timeout_s: float) -> str:
        try:
            address = await self.lookup(timeout_s)
        except Exception as error:  # noqa: BLE001 - none ready (restarting) or the call failed: say which
            raise WorkerUnavailable(f"no {self.role} worker replica ready ({type(error).__name__})") from None
        finally:
            self.asking = None
        now = time.monotonic()
        self.named = {known: named_at for known, named_at in self.named.items() if now - named_at < self.keep_s}
        self.named[address] = now
        return address
