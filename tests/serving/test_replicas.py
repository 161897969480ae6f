"""replicas.py: which worker replica a request gets, from a handle that is slow or down at times
(a fake handle here; test_serve.py runs the real one)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.errors import WorkerUnavailable
from deployments.replicas import ReplicaDirectory

FIRST_WAIT_S, REFRESH_TIMEOUT_S = 2.0, 0.05


class Handle:
    """Answers with the next of `answers` (an exception is raised) after `delay_s`, counting the
    questions and noting the timeout each was asked with. A delay past the timeout is Serve's
    TimeoutError."""

    def __init__(self, *answers, delay_s: float = 0.0):
        self.answers, self.delay_s = list(answers), delay_s
        self.timeouts: list[float] = []

    @property
    def asked(self) -> int:
        return len(self.timeouts)

    async def lookup(self, timeout_s: float) -> str:
        self.timeouts.append(timeout_s)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        await asyncio.sleep(min(self.delay_s, timeout_s))
        if self.delay_s > timeout_s:
            raise TimeoutError()
        if isinstance(answer, Exception):
            raise answer
        return answer


def directory_over(handle: Handle, role: str = "target", **timing) -> ReplicaDirectory:
    return ReplicaDirectory(role, handle.lookup, FIRST_WAIT_S, REFRESH_TIMEOUT_S, **timing)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_reuse_what_the_handle_said_and_it_is_asked_again_in_the_background():
    async def run():
        handle = Handle("a:1", "b:2")
        directory = directory_over(handle, refresh_s=0.05, keep_s=10)
        assert await directory.pick() == "a:1" and handle.asked == 1  # none known: the first waits
        assert [await directory.pick() for _ in range(5)] == ["a:1"] * 5 and handle.asked == 1
        await asyncio.sleep(0.06)
        assert await directory.pick() == "a:1"  # answered at once; the handle is asked meanwhile
        await settle()
        assert handle.asked == 2 and sorted({await directory.pick() for _ in range(4)}) == ["a:1", "b:2"]
        # a first answer may take as long as a request waits for one; a refresh no longer than its own bound
        assert handle.timeouts == [FIRST_WAIT_S, REFRESH_TIMEOUT_S]

    asyncio.run(run())


def test_with_none_known_a_request_waits_for_a_slow_first_answer():
    """A cold handle or workers still loading answer later than a refresh may: the request that
    came first is served, and so is one that came meanwhile (one question is out)."""

    async def run():
        handle = Handle("a:1", delay_s=4 * REFRESH_TIMEOUT_S)
        directory = directory_over(handle)
        assert await asyncio.gather(directory.pick(), directory.pick()) == ["a:1", "a:1"]
        assert handle.asked == 1

    asyncio.run(run())


def test_with_none_known_failed_answers_are_asked_again_until_the_wait_is_over():
    """A handle of a deployment with no replica fails at once: the request asks again, and is
    told only when its wait is over (or served when a replica appears meanwhile)."""

    async def run():
        handle = Handle(RuntimeError("no replica"), RuntimeError("no replica"), "a:1")
        assert await directory_over(handle).pick() == "a:1" and handle.asked == 3
        never = Handle(RuntimeError("no replica"))
        directory = ReplicaDirectory("draft", never.lookup, first_wait_s=0.5, refresh_timeout_s=REFRESH_TIMEOUT_S)
        with pytest.raises(WorkerUnavailable, match=r"no draft worker replica ready \(RuntimeError\)"):
            await directory.pick()
        assert never.asked > 1

    asyncio.run(run())


def test_a_health_check_does_not_wait_for_a_first_answer_and_the_question_goes_on():
    async def run():
        handle = Handle("a:1", delay_s=4 * REFRESH_TIMEOUT_S)
        directory = directory_over(handle)
        with pytest.raises(WorkerUnavailable, match="no target worker replica ready within 0.05 s"):
            await directory.pick(wait=False)
        await asyncio.sleep(6 * REFRESH_TIMEOUT_S)  # the question it started was answered meanwhile
        assert await directory.pick(wait=False) == "a:1" and handle.asked == 1

    asyncio.run(run())


def test_a_failed_answer_forgets_nothing():
    async def run():
        handle = Handle("a:1", TimeoutError(), TimeoutError())
        directory = directory_over(handle, refresh_s=0.0, keep_s=10)
        assert await directory.pick() == "a:1"
        for _ in range(3):
            assert await directory.pick() == "a:1"
            await settle()
        assert handle.asked == 4

    asyncio.run(run())


def test_a_replica_the_handle_no_longer_names_is_forgotten_after_keep_s():
    async def run():
        handle = Handle("a:1", "b:2")
        directory = directory_over(handle, refresh_s=0.0, keep_s=0.05)
        assert await directory.pick() == "a:1"
        await asyncio.sleep(0.06)
        await directory.pick()  # asks: "b:2" named, "a:1" not for longer than keep_s
        await settle()
        assert {await directory.pick() for _ in range(4)} == {"b:2"}

    asyncio.run(run())
