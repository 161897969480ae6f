"""Answers a worker holds for their callers: a call waits for its answer at most until just before
its deadline, and where the answer is not ready (a target session waiting for KV blocks,
pool_scheduler.py) it returns without one and the answer is held; the caller asks again for it
with a new deadline. A paused session so never fails on a deadline, and a gone or hung worker is
still found by one."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

from specdec_core.api.errors import SpecdecError


class HeldAnswers:
    def __init__(self):
        self.futures: dict[str, Future] = {}  # by session: one call in flight each
        self.lock = threading.Lock()

    def wait(
        self, session_id: str, future: Future, wait_s: Optional[float], may_hold: Callable[[], bool]
    ) -> Optional[Any]:
        """The answer within `wait_s` (None: as long as it takes), else, where `may_hold()`, None
        and it is held; where not, the answer whenever it comes (past the caller's deadline)."""
        try:
            return future.result(timeout=wait_s)
        except TimeoutError:
            if not may_hold():
                return future.result()
            with self.lock:
                self.futures[session_id] = future
            return None

    def take(self, session_id: str) -> Future:
        with self.lock:
            future = self.futures.pop(session_id, None)
        if future is None:
            raise SpecdecError(f"session {session_id!r} has no answer held")
        return future

    def drop(self, session_id: str) -> None:
        with self.lock:
            self.futures.pop(session_id, None)
