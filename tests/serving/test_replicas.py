"""replicas.py: which worker replica a request gets, from a handle that is slow or down at times
(a fake handle here; test_serve.py runs the real one)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.errors import WorkerUnavailable
from deployments.replicas import ReplicaDirectory


class Handle:
    """Answers with the next of `answers` (an exception is raised), counting the questions."""

    def __init__(self, *answers):
        self.answers, self.asked = list(answers), 0

    async def lookup(self) -> str:
        self.asked += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        await asyncio.sleep(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_reuse_what_the_handle_said_and_it_is_asked_again_in_the_background():
    async def run():
        handle = Handle("a:1", "b:2")
        directory = ReplicaDirectory("target", handle.lookup, refresh_s=0.05, keep_s=10)
        assert await directory.pick() == "a:1" and handle.asked == 1  # none known: the first waits
        assert [await directory.pick() for _ in range(5)] == ["a:1"] * 5 and handle.asked == 1
        await asyncio.sleep(0.06)
        assert await directory.pick() == "a:1"  # answered at once; the handle is asked meanwhile
        await settle()
        assert handle.asked == 2 and sorted({await directory.pick() for _ in range(4)}) == ["a:1", "b:2"]

    asyncio.run(run())


def test_a_failed_answer_forgets_nothing_and_with_none_known_the_request_is_told():
    async def run():
        handle = Handle("a:1", TimeoutError(), TimeoutError())
        directory = ReplicaDirectory("target", handle.lookup, refresh_s=0.0, keep_s=10)
        assert await directory.pick() == "a:1"
        for _ in range(3):
            assert await directory.pick() == "a:1"
            await settle()
        empty = ReplicaDirectory("draft", Handle(TimeoutError()).lookup)
        with pytest.raises(WorkerUnavailable, match="no draft worker replica ready"):
            await empty.pick()

    asyncio.run(run())


def test_a_replica_the_handle_no_longer_names_is_forgotten_after_keep_s():
    async def run():
        handle = Handle("a:1", "b:2")
        directory = ReplicaDirectory("target", handle.lookup, refresh_s=0.0, keep_s=0.05)
        assert await directory.pick() == "a:1"
        await asyncio.sleep(0.06)
        await directory.pick()  # asks: "b:2" named, "a:1" not for longer than keep_s
        await settle()
        assert {await directory.pick() for _ in range(4)} == {"b:2"}

    asyncio.run(run())
