"""Where a worker deployment's replicas serve, as its Serve handle says, for the requests of one
server replica. Asking the handle costs a round trip through Serve's router, which on a loaded
machine took over half a second (64 streams on 2 cores): a request takes an address the handle
has given (the replicas known, in turn) and the directory asks again in the background at most
every `refresh_s`, each time within `refresh_timeout_s`. Each answer forgets the replicas the
handle has not named for `keep_s`: a replica that died is given out until its successor is named
(its requests fail as they would anyway: 503 for the target, target-only for the draft), and a
failed answer (none ready in time) forgets nothing.

With none known (the service starting, or this server replica new), a request waits for the
handle's first answer, up to `first_wait_s`: a cold handle or workers still loading their model
take longer to answer than a refresh may, and a request that arrives then should be served, not
refused. A failed first answer is asked again until the request's wait is over; then it is told
(WorkerUnavailable: 503 with Retry-After for the target, target-only for the draft)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Awaitable, Callable, Optional

from .errors import WorkerUnavailable

# between two failed first answers: a handle of a deployment with no replica may fail at once
RETRY_PAUSE_S = 0.2
REFRESH_S, KEEP_S = 1.0, 5.0
# how long a server may still give out a replica after the handle last named it: a stopping
# worker replica serves at least this long (worker.py), so that no request reaches it gone
FORGET_S = REFRESH_S + KEEP_S


class ReplicaDirectory:
    def __init__(
        self,
        role: str,
        lookup: Callable[[float], Awaitable[str]],
        first_wait_s: float,
        refresh_timeout_s: float,
        refresh_s: float = REFRESH_S,
        keep_s: float = KEEP_S,
    ):
        """`lookup(timeout_s)`: one replica's address from the handle (raises when none is ready
        within `timeout_s`)."""
        self.role, self.lookup = role, lookup
        self.first_wait_s, self.refresh_timeout_s = first_wait_s, refresh_timeout_s
        self.refresh_s, self.keep_s = refresh_s, keep_s
        self.seen: dict[str, float] = {}  # address: when the handle last named it
        self.asked_at = float("-inf")
        self.asking: Optional[asyncio.Task] = None
        self.turn = itertools.count()

    async def pick(self, wait: bool = True) -> str:
        """On the caller's event loop (always the same one): a replica's address for one request.
        With none known it waits up to `first_wait_s` for one (`wait`), or only as long as a
        refresh may take (a health check: it answers quickly, and the question goes on)."""
        wait_s = self.first_wait_s if wait else self.refresh_timeout_s
        deadline = time.monotonic() + wait_s
        while True:
            if not self.seen or time.monotonic() - self.asked_at >= self.refresh_s:
                self.ask()
            if self.seen:
                known = list(self.seen)
                return known[next(self.turn) % len(known)]
            try:
                return await asyncio.wait_for(asyncio.shield(self.asking), deadline - time.monotonic())
            except asyncio.TimeoutError:
                raise WorkerUnavailable(f"no {self.role} worker replica ready within {wait_s:g} s") from None
            except WorkerUnavailable:
                if time.monotonic() + RETRY_PAUSE_S >= deadline:
                    raise
                await asyncio.sleep(RETRY_PAUSE_S)

    def ask(self) -> None:
        """On the caller's event loop: ask the handle in the background, unless a question is out
        (with none known, for as long as a first answer may take)."""
        if self.asking is not None:
            return
        self.asked_at = time.monotonic()
        self.asking = asyncio.ensure_future(self._answer(self.refresh_timeout_s if self.seen else self.first_wait_s))
        self.asking.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved

    async def _answer(self, timeout_s: float) -> str:
        try:
            address = await self.lookup(timeout_s)
        except Exception as error:  # noqa: BLE001 - none ready (restarting) or the call failed: say which
            raise WorkerUnavailable(f"no {self.role} worker replica ready ({type(error).__name__})") from None
        finally:
            self.asking = None
        now = time.monotonic()
        self.seen = {known: named_at for known, named_at in self.seen.items() if now - named_at < self.keep_s}
        self.seen[address] = now
        return address
