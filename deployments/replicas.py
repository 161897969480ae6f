"""Where a worker deployment's replicas serve, as its Serve handle says, for the requests of one
server replica. Asking the handle costs a round trip through Serve's router, which on a loaded
machine took over half a second (64 streams on 2 cores): a request takes an address the handle
has given (the replicas known, in turn) and the directory asks again in the background at most
every `refresh_s`; only with none known does a request wait for the answer. Each answer forgets
the replicas the handle has not named for `keep_s`: a replica that died is given out until its
successor is named (its requests fail as they would anyway: 503 for the target, target-only for
the draft), and a failed answer (none ready in time) forgets nothing."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Awaitable, Callable, Optional

from .errors import WorkerUnavailable


class ReplicaDirectory:
    def __init__(self, role: str, lookup: Callable[[], Awaitable[str]], refresh_s: float = 1.0, keep_s: float = 5.0):
        """`lookup()`: one replica's address from the handle (raises when none is ready in time)."""
        self.role, self.lookup = role, lookup
        self.refresh_s, self.keep_s = refresh_s, keep_s
        self.seen: dict[str, float] = {}  # address: when the handle last named it
        self.asked_at = float("-inf")
        self.asking: Optional[asyncio.Task] = None
        self.turn = itertools.count()

    async def pick(self) -> str:
        """On the caller's event loop (always the same one): a replica's address for one request."""
        if self.asking is None and (not self.seen or time.monotonic() - self.asked_at >= self.refresh_s):
            self.asked_at = time.monotonic()
            self.asking = asyncio.ensure_future(self._ask())
            self.asking.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved
        if self.seen:
            known = list(self.seen)
            return known[next(self.turn) % len(known)]
        return await asyncio.shield(self.asking)

    async def _ask(self) -> str:
        try:
            address = await self.lookup()
        except Exception as error:  # noqa: BLE001 - none ready (restarting) or the call failed: say which
            raise WorkerUnavailable(f"no {self.role} worker replica ready ({type(error).__name__})") from None
        finally:
            self.asking = None
        now = time.monotonic()
        self.seen = {known: named_at for known, named_at in self.seen.items() if now - named_at < self.keep_s}
        self.seen[address] = now
        return address
