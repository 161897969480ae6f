"""Admission by KV memory: a worker opens sessions while their KV caches fit its budget. By reach,
each session reserves what it can need at most (prompt, max_tokens and one block of drafts) when
it opens and frees it when it ends. Beyond the budget a bounded number of sessions wait, each for
a bounded time, for others to end; past either bound the caller gets `Overloaded` (gRPC
RESOURCE_EXHAUSTED; the server answers HTTP 503 with Retry-After) and the admitted sessions go on
undisturbed. On demand (a target worker's default) nothing is reserved here: the target's pool
scheduler admits sessions by what they hold, within the same bounds (pool_scheduler.py)."""

from __future__ import annotations

import threading
import time
from typing import Optional

from specdec_core.api.errors import SpecdecError


class Overloaded(RuntimeError):
    """No KV memory for another session now, and the queue for it is full or took too long."""


class Admission:
    def __init__(self, budget_bytes: Optional[float], max_waiting: int, wait_s: float, on_demand: bool = False):
        """`budget_bytes` None: no limit (sessions are still counted)."""
        self.budget_bytes, self.max_waiting, self.wait_s = budget_bytes, max_waiting, wait_s
        self.on_demand = on_demand
        self.reserved: dict[str, float] = {}
        self.waiting = 0
        self.freed = threading.Condition()

    @property
    def reserved_bytes(self) -> float:
        with self.freed:  # a re-entrant lock: `fits` holds it already
            return sum(self.reserved.values())

    def fits(self, nbytes: float) -> bool:
        return self.budget_bytes is None or self.reserved_bytes + nbytes <= self.budget_bytes

    def admit(self, session_id: str, nbytes: float) -> None:
        """Reserve `nbytes` (the session's reach) for the session, waiting for room if the queue
        has a place; on demand, only refuse a reach beyond the whole budget."""
        if self.budget_bytes is not None and nbytes > self.budget_bytes:
            raise SpecdecError(
                f"the request needs {nbytes / 2**20:.1f} MiB of KV cache, more than this worker's "
                f"{self.budget_bytes / 2**20:.1f} MiB: shorten the prompt or max_tokens"
            )
        if self.on_demand:
            return
        with self.freed:
            if not self.fits(nbytes) or self.waiting:
                if self.waiting >= self.max_waiting:
                    raise Overloaded(f"{len(self.reserved)} sessions hold the KV budget and {self.waiting} wait")
                self.waiting += 1
                deadline = time.monotonic() + self.wait_s
                try:
                    while not self.fits(nbytes):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise Overloaded(f"no KV memory freed within {self.wait_s:g} s")
                        self.freed.wait(left)
                finally:
                    self.waiting -= 1
            self.reserved[session_id] = nbytes

    def release(self, session_id: str) -> None:
        with self.freed:
            if self.reserved.pop(session_id, None) is not None:
                self.freed.notify_all()
