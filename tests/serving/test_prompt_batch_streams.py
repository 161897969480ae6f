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
