"""An asyncio event loop on a daemon thread, and the bridges that reach it from other threads and
other loops. The coordinator's gRPC channels and every request's decoding loop live on it, so
requests in flight cost a suspended coroutine each, not a thread blocked on a stub."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from typing import Any, AsyncIterator, Awaitable, Coroutine, Iterator, Optional, TypeVar

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


async def next_item(items: AsyncIterator[Item]) -> tuple[bool, Any]:
    """(done, item): StopAsyncIteration does not cross a future."""
    try:
        return False, await items.__anext__()
    except StopAsyncIteration:
        return True, None


class GeneratorSteps:
    """An async generator stepped from another loop, on its own: a close waits for the step in
    flight. A consumer cancelled while it waits may leave the generator anywhere: mid-step (the
    cancellation reaches it), not yet stepped (the step was cancelled before it ran) or suspended
    at a yield whose item never arrived (the step had ended); the close after covers all three."""

    def __init__(self, items: AsyncIterator[Any]):
        self.items = items
        self.stepping: Optional[asyncio.Event] = None  # set while a step runs

    async def next(self) -> tuple[bool, Any]:
        self.stepping = stepping = asyncio.Event()
        try:
            return await next_item(self.items)
        finally:
            stepping.set()

    async def close(self) -> None:
        if self.stepping is not None:
            await self.stepping.wait()
        await self.items.aclose()


class EventLoopThread:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, work: Coroutine[Any, Any, Result]) -> Future:
        """Start `work` on the loop; the caller does not wait (failures are logged)."""
        future = asyncio.run_coroutine_threadsafe(work, self.loop)
        future.add_done_callback(log_failure)
        return future

    def run(self, work: Coroutine[Any, Any, Result]) -> Result:
        """From another thread: run `work` on the loop and wait for its result."""
        if threading.current_thread() is self.thread:
            work.close()
            raise RuntimeError("EventLoopThread.run called on its own loop: await the work instead")
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

    def arun(self, work: Coroutine[Any, Any, Result]) -> Awaitable[Result]:
        """From any event loop (this one too): await `work` run on this loop; cancelling the
        await cancels the work."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, self.loop))

    def iterate(self, items: AsyncIterator[Item]) -> Iterator[Item]:
        """From another thread: iterate an async generator that runs on the loop; closing the
        iterator closes the generator (its cleanup done when `close` returns)."""
        try:
            while True:
                done, item = self.run(next_item(items))
                if done:
                    return
                yield item
        finally:
            self.run(items.aclose())

    async def aiterate(self, items: AsyncIterator[Item]) -> AsyncIterator[Item]:
        """From any event loop: iterate an async generator that runs on this loop. A consumer
        that stops (closes, or is cancelled while waiting) has the generator closed on this loop,
        once a step in flight has ended, without waiting for its cleanup (which a cancelled
        consumer could not await)."""
        steps = GeneratorSteps(items)
        try:
            while True:
                done, item = await self.arun(steps.next())
                if done:
                    return
                yield item
        finally:
            self.submit(steps.close())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("background work failed", exc_info=future.exception())
