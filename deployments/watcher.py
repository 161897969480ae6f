"""Keeps an engine pointed at its workers, off the request path: a background thread looks up
each worker's current address every `interval_s` and reconnects the engine when a restarted
worker came back on a new port. Requests never wait on a lookup."""

from __future__ import annotations

import logging
import threading
from typing import Callable

logger = logging.getLogger(__name__)


class WorkerWatcher:
    def __init__(
        self,
        resolve: Callable[[str], str],
        connect: Callable[[str, str], None],
        addresses: dict[str, str],
        interval_s: float,
    ):
        """`resolve(role)` returns the worker's address now (raises while it is down);
        `connect(role, address)` repoints the engine; `addresses`: where it points now."""
        self.resolve = resolve
        self.connect = connect
        self.addresses = dict(addresses)
        self.interval_s = interval_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="worker-watcher", daemon=True)
        self.thread.start()

    def check(self) -> None:
        """One round: reconnect every worker whose address changed."""
        for role, known in list(self.addresses.items()):
            try:
                address = self.resolve(role)
            except Exception as error:  # noqa: BLE001 - a worker that is down or restarting; next round retries
                logger.warning("%s worker not reachable: %s", role, error)
                continue
            if address != known:
                logger.info("%s worker moved from %s to %s; reconnecting", role, known, address)
                self.connect(role, address)
                self.addresses[role] = address

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()

    def _watch(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.check()
