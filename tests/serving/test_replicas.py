"""replicas.py: which worker replica a request gets, from a handle that is slow or down at times
(a fake handle here; test_serve.py runs the real one)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.coordination.replicas import FIRST_ANSWER_S, ReplicaDirectory
from deployments.ingress.error_replies import WorkerUnavailable

WAIT_S, REFRESH_TIMEOUT_S = 2.0, 0.05  # a request's wait for a first replica; a refresh's bound


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
    return ReplicaDirectory(role, handle.lookup, REFRESH_TIMEOUT_S, **timing)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_reuse_what_the_handle_said_and_it_is_asked_again_in_the_background():
    async def run():
        handle = Handle("a:1", "b:2")
        directory = directory_over(handle, refresh_s=0.05, keep_s=10)
        assert await directory.pick(WAIT_S) == "a:1" and handle.asked == 1  # none known: the first waits
        assert [await directory.pick(WAIT_S) for _ in range(5)] == ["a:1"] * 5 and handle.asked == 1
        await asyncio.sleep(0.06)
        assert await directory.pick(WAIT_S) == "a:1"  # answered at once; the handle is asked meanwhile
        await settle()
        assert handle.asked == 2 and sorted({await directory.pick(WAIT_S) for _ in range(4)}) == ["a:1", "b:2"]
        # a first answer may take long (a cold handle, workers loading); a refresh no longer than its bound
        assert handle.timeouts == [FIRST_ANSWER_S, REFRESH_TIMEOUT_S]

    asyncio.run(run())


def test_with_none_known_a_request_waits_for_a_slow_first_answer():
    """A cold handle or workers still loading answer later than a refresh may: the request that
    came first is served, and so is one that came meanwhile (one question is out)."""

    async def run():
        handle = Handle("a:1", delay_s=4 * REFRESH_TIMEOUT_S)
        directory = directory_over(handle)
        assert await asyncio.gather(directory.pick(WAIT_S), directory.pick(WAIT_S)) == ["a:1", "a:1"]
        assert handle.asked == 1

    asyncio.run(run())


def test_with_none_known_failed_answers_are_asked_again_until_the_wait_is_over():
    """A handle of a deployment with no replica fails at once: the request asks again, and is
    told only when its wait is over (or served when a replica appears meanwhile)."""

    async def run():
        handle = Handle(RuntimeError("no replica"), RuntimeError("no replica"), "a:1")
        assert await directory_over(handle).pick(WAIT_S) == "a:1" and handle.asked == 3
        never = Handle(RuntimeError("no replica"))
        with pytest.raises(WorkerUnavailable, match=r"no draft worker replica ready \(RuntimeError\)"):
            await directory_over(never, "draft").pick(0.5)
        assert never.asked > 1

    asyncio.run(run())


def test_a_short_wait_does_not_cut_the_first_question_short():
    """A health check or a draft lookup waits a refresh's time; a request of a worker whose
    admission_wait_s is 0 not at all: the question goes on, and the next request finds the replica."""

    async def run():
        handle = Handle("a:1", delay_s=4 * REFRESH_TIMEOUT_S)
        directory = directory_over(handle)
        with pytest.raises(WorkerUnavailable, match="no target worker replica ready within 0.05 s"):
            await directory.pick(REFRESH_TIMEOUT_S)
        with pytest.raises(WorkerUnavailable, match="within 0 s"):
            await directory.pick(0.0)
        await asyncio.sleep(6 * REFRESH_TIMEOUT_S)  # the question it started was answered meanwhile
        assert await directory.pick(0.0) == "a:1" and handle.asked == 1

    asyncio.run(run())


def test_a_failed_answer_forgets_nothing():
    async def run():
        handle = Handle("a:1", TimeoutError(), TimeoutError())
        directory = directory_over(handle, refresh_s=0.0, keep_s=10)
        assert await directory.pick(WAIT_S) == "a:1"
        for _ in range(3):
            assert await directory.pick(WAIT_S) == "a:1"
            await settle()
        assert handle.asked == 4

    asyncio.run(run())


def test_a_replica_the_handle_no_longer_names_is_given_out_no_more_after_keep_s():
    """After a rollout the handle names the new replica only: once keep_s has passed since it named
    the old one, an idle server's next request waits for the handle's word (a refresh's time)."""

    async def run():
        handle = Handle("a:1", "b:2")
        directory = directory_over(handle, keep_s=0.05)
        assert await directory.pick(WAIT_S) == "a:1"
        await asyncio.sleep(0.06)
        assert {await directory.pick(WAIT_S) for _ in range(4)} == {"b:2"}

    asyncio.run(run())


def test_where_the_handle_says_nothing_in_time_the_replicas_named_before_are_given_out():
    """A slow handle (or none ready while a worker restarts) does not hold requests beyond a
    refresh's time: they take what was named before (a dead replica fails its request at once)."""

    async def run():
        handle = Handle("a:1", TimeoutError())
        directory = directory_over(handle, keep_s=0.05)
        assert await directory.pick(WAIT_S) == "a:1"
        await asyncio.sleep(0.06)
        assert [await directory.pick(WAIT_S) for _ in range(3)] == ["a:1"] * 3

    asyncio.run(run())
