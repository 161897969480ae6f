"""How the HTTP ingress merges a prompt batch's streams (deployments/ingress/http_ingress.py):
closing the merge closes every stream at once, whether it was waiting on the worker or on a slow
reader, since a stream's close is what releases its worker sessions."""

from __future__ import annotations

import asyncio
import gc

import pytest

pytest.importorskip("fastapi")

from deployments.ingress.http_ingress import merged  # noqa: E402


def test_closing_a_merge_closes_every_stream_without_the_garbage_collector():
    closed: list[int] = []

    async def stream(index: int, chunks: int):
        try:
            for chunk in range(chunks):
                await asyncio.sleep(0)
                yield chunk
        finally:  # stands for releasing the stream's sessions
            closed.append(index)

    async def read_one_then_leave() -> None:
        streams = [stream(index, chunks=1000) for index in range(3)]
        chunks = merged(streams, limit=3)
        await anext(chunks)
        for _ in range(10):  # the queue fills: pumps now wait on it, their streams at a yield
            await asyncio.sleep(0)
        await chunks.aclose()
        assert sorted(closed) == [0, 1, 2]  # here: asyncio.run closes what is left as it ends

    gc.disable()  # a stream left suspended would be closed only when collected
    try:
        asyncio.run(read_one_then_leave())
    finally:
        gc.enable()


@pytest.mark.parametrize("when", ["after its step ended", "while its step runs"])
def test_a_consumer_cancelled_while_it_waits_has_the_coordinators_stream_closed(when):
    """EventLoopThread.aiterate: a stream decodes on the coordinator's loop and is read from the
    HTTP loop. A reader cancelled while it waits for the next chunk (a client gone) has the stream
    closed on the coordinator's loop, whether the step had already produced the chunk (the stream
    then waits at a yield for a reader that will not come) or is still running; without the
    garbage collector."""
    import threading
    import time

    from deployments.coordination.event_loop import EventLoopThread

    coordinator, closed = EventLoopThread("test-coordinator"), threading.Event()

    async def stream():
        try:
            for chunk in range(1000):
                await asyncio.sleep(0 if when == "after its step ended" else 0.05)
                yield chunk
        finally:  # stands for releasing the stream's sessions
            closed.set()

    async def reader() -> bool:
        source = stream()  # held, as a reference cycle would hold it: only an explicit close ends it
        chunks = coordinator.aiterate(source)
        waiting = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0)  # the step is sent to the coordinator
        time.sleep(0.2 if when == "after its step ended" else 0.01)  # this loop busy: the chunk is not taken
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await chunks.aclose()
        return await asyncio.to_thread(closed.wait, 5)

    gc.disable()
    try:
        assert asyncio.run(reader())
    finally:
        gc.enable()
        coordinator.stop()
