"""A server replica's drain before its service stops (SIGTERM to `specdec serve`): from the moment
it begins, a new request gets 503 with Retry-After and /health says "draining" (a load balancer
sends the client elsewhere), while the streams in flight go on; one still running when the grace
period ends is ended with an error event, never cut. `specdec serve` begins it through the Ray
cluster's KV store, which every server replica of the application watches, then waits for the
sessions to end (at most the grace period) before it shuts Serve down."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from .error_replies import WorkerUnavailable

WATCH_EVERY_S = 0.5
logger = logging.getLogger(__name__)


class ShuttingDown(WorkerUnavailable):
    """This server replica is draining: a retry reaches another one, or the service once back."""


class Drain:
    def __init__(self):
        self.deadline: Optional[float] = None  # wall clock: streams still running then are ended

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def refuse_new(self) -> None:
        if self.draining:
            raise ShuttingDown("the server is shutting down: retry on another replica, or later")

    def check_stream(self) -> None:
        """Between a stream's chunks: past the grace period, it ends (an error event)."""
        if self.draining and time.time() > self.deadline:
            raise ShuttingDown("the server shut down before the request finished (its grace period ended)")


def drain_key(app_name: str) -> str:
    return f"drain:{app_name}"


def cluster_store():
    """Ray's KV store and the project's namespace in it (imported only where a cluster is)."""
    from ray.experimental import internal_kv

    from ..coordination.startup_log import NAMESPACE

    return internal_kv, NAMESPACE


def begin_drain(app_name: str, grace_s: float) -> None:
    """(`specdec serve`, connected to the cluster.) Every server replica of the Serve application
    drains, and ends the streams still running `grace_s` from now."""
    store, namespace = cluster_store()
    store._internal_kv_put(
        drain_key(app_name), str(time.time() + grace_s).encode(), overwrite=True, namespace=namespace
    )


def clear_drain(app_name: str) -> None:
    """No drain left for the application's next replicas (after a stop, and before a start)."""
    store, namespace = cluster_store()
    store._internal_kv_del(drain_key(app_name), namespace=namespace)


async def watch_for_drain(drain: Drain, app_name: str) -> None:
    """(A server replica, on its coordinator loop.) Begin the drain once `begin_drain` asks; a
    failed look (the cluster's store briefly unreachable) is logged and tried again."""
    store, namespace = cluster_store()

    def look() -> Optional[bytes]:
        return store._internal_kv_get(drain_key(app_name), namespace=namespace)

    loop, reader = asyncio.get_running_loop(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="drain-watch")
    try:
        while not drain.draining:
            try:
                value = await loop.run_in_executor(reader, look)
                if value is not None:
                    drain.deadline = float(value)
            except Exception:  # noqa: BLE001 - logged; the next look may succeed
                logger.exception("looking for a drain of %s failed", app_name)
            await asyncio.sleep(WATCH_EVERY_S)
    finally:
        reader.shutdown(wait=False)
