"""Per-request sessions of a worker, keyed by request id: freed on Release, or once idle for
`idle_timeout_s` (a server replica that died mid-request never releases). Idle sessions are
dropped when a session is opened or the table is inspected, so no thread is needed."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional


class SessionTable:
    def __init__(self, idle_timeout_s: float, on_expire: Optional[Callable[[str], None]] = None):
        """`on_expire(session_id)` is told of each session dropped for idleness."""
        self.idle_timeout_s = idle_timeout_s
        self.on_expire = on_expire
        self.sessions: dict[str, tuple[Any, float]] = {}  # id -> (session, last use)
        self.requests = 0
        self.lock = threading.Lock()

    def put(self, session_id: str, session: Any) -> None:
        with self.lock:
            self._drop_idle()
            self.sessions[session_id] = (session, time.monotonic())
            self.requests += 1

    def get(self, session_id: str) -> Optional[Any]:
        """The session, or None when it was released or has expired."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None:
                return None
            now = time.monotonic()
            if now - entry[1] > self.idle_timeout_s:
                self._expire(session_id)
                return None
            self.sessions[session_id] = (entry[0], now)
            return entry[0]

    def release(self, session_id: str) -> None:
        with self.lock:
            self.sessions.pop(session_id, None)

    def count(self, which: Callable[[Any], bool]) -> int:
        """Open sessions that `which(session)` picks."""
        with self.lock:
            self._drop_idle()
            return sum(1 for session, _ in self.sessions.values() if which(session))

    def counts(self) -> tuple[int, int]:
        """(open sessions, requests served)."""
        with self.lock:
            self._drop_idle()
            return len(self.sessions), self.requests

    def _drop_idle(self) -> None:
        cutoff = time.monotonic() - self.idle_timeout_s
        for session_id in [sid for sid, (_, used) in self.sessions.items() if used < cutoff]:
            self._expire(session_id)

    def _expire(self, session_id: str) -> None:
        del self.sessions[session_id]
        if self.on_expire is not None:
            self.on_expire(session_id)
