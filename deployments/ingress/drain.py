"""A server replica's drain before its service stops (SIGTERM to `specdec serve`): from the moment
it begins, a new request gets 503 with Retry-After and /health says "draining" (a load balancer
sends the client elsewhere), while the streams in flight go on; one still running when the grace
period ends is ended with an error event, never cut. `specdec serve` begins it through the Ray
cluster's KV store, which every server replica of the model watches, then waits for the
sessions to end (at most the grace period) before it shuts Serve down."""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from .error_replies import WorkerUnavailable

NAMESPACE = "specdec"
WATCH_EVERY_S = 0.5


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


def drain_key(model_name: str) -> str:
    return f"drain:{model_name}"


def begin_drain(model_name: str, grace_s: float) -> None:
    """(`specdec serve`, connected to the cluster.) Every server replica of the model drains, and
    ends the streams still running `grace_s` from now."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(drain_key(model_name), str(time.time() + grace_s).encode(), overwrite=True, namespace=NAMESPACE)


def clear_drain(model_name: str) -> None:
    """A new start serves: no drain left over from an earlier stop on the same cluster."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(drain_key(model_name), namespace=NAMESPACE)


async def watch_for_drain(drain: Drain, model_name: str, executor) -> None:
    """(A server replica, on its coordinator loop.) Begin the drain once `begin_drain` asks."""
    from ray.experimental.internal_kv import _internal_kv_get

    loop = asyncio.get_running_loop()
    while not drain.draining:
        value = await loop.run_in_executor(
            executor, lambda: _internal_kv_get(drain_key(model_name), namespace=NAMESPACE)
        )
        if value is not None:
            drain.deadline = float(value)
            return
        await asyncio.sleep(WATCH_EVERY_S)
