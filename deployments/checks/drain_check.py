"""What `specdec drain-check` measures: streams in flight while the service changes under them,
through `serve deploy` of a changed config onto the running app, or SIGTERM to the `specdec
serve` process that runs it. For each: how every stream ended (completed, an error event, cut
without [DONE], hung), what the requests sent meanwhile got (status, Retry-After, the new
config's output), and when the new config's replicas served (`serve status` RUNNING) or the
process had exited."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import httpx

from .deploy_check import SERVE_COMMAND, app_status, first_listing, service_url, specdec_serve, stopped
from .probe_client import Outcome, ProbeClient, first_event_or_end

PATH = "/v1/chat/completions"
SEND_EVERY_S = 0.5


@dataclass
class Drain:
    event: str  # what was done to the service
    streams: Counter = field(default_factory=Counter)  # how the streams in flight ended
    requests: Counter = field(default_factory=Counter)  # what the requests sent after it got
    after_s: Optional[float] = None  # a deploy: when the app was RUNNING again; SIGTERM: when the process exited
    first_new_s: Optional[float] = None  # a deploy: when a reply first carried other output
    failures: list[str] = field(default_factory=list)  # the first few streams that did not complete


def counted(counter: Counter) -> str:
    """A Counter's counts, as "3 x 200, 1 x 503"."""
    return ", ".join(f"{count} x {what}" for what, count in sorted(counter.items()))


def stream_end(outcome: Outcome) -> str:
    """How a stream ended: completed, `error event: CODE`, `status N`, cut, or hung."""
    if outcome.problem:
        return "hung" if outcome.problem.startswith("hung") else "cut"
    if outcome.status != 200:
        return f"status {status_label(outcome.status, outcome.retry_after is not None)}"
    if outcome.error:
        return f"error event: {outcome.error.get('code')}"
    return "completed" if outcome.done and outcome.finish_reason else "cut"


def status_label(status: int, retry_after: bool) -> str:
    return f"{status}{' + Retry-After' if retry_after else ''}"


async def send(http: httpx.AsyncClient, body: dict) -> tuple[str, Optional[str]]:
    """One request after the event: what it got, and its output where it got 200."""
    try:
        response = await http.post(PATH, json=body)
    except httpx.ConnectError:
        return "refused", None
    except httpx.HTTPError:
        return "cut", None
    if response.status_code == 200:
        return "200", response.json()["choices"][0]["message"]["content"]
    return status_label(response.status_code, "retry-after" in response.headers), None


async def ride_through(
    client: ProbeClient, streams: int, max_tokens: int, event: str, act: Callable[[], None], ended: Callable[[], bool]
) -> Drain:
    """Start `streams` streams; once each has its first event (or has failed), `act()`, and send a
    request every SEND_EVERY_S until `ended()` and every stream has ended, at most the client's
    timeout (past it `after_s` stays None, and a stream still open counts as hung)."""
    firsts = [asyncio.Event() for _ in range(streams)]
    tasks = [
        asyncio.create_task(client.call(PATH, client.body(PATH, index, stream=True, max_tokens=max_tokens), first))
        for index, first in enumerate(firsts)
    ]
    for task, first in zip(tasks, firsts):
        await first_event_or_end(first, [task], client.timeout_s)
    probe = client.body(PATH, streams, max_tokens=8)
    _, before = await send(client.http, probe)
    loop, drain, began = asyncio.get_running_loop(), Drain(event), time.perf_counter()
    await loop.run_in_executor(None, act)
    while time.perf_counter() - began < client.timeout_s:
        if drain.after_s is None and await loop.run_in_executor(None, ended):
            drain.after_s = round(time.perf_counter() - began, 1)
        if drain.after_s is not None and all(task.done() for task in tasks):
            break
        status, output = await send(client.http, probe)
        drain.requests[status] += 1
        if output is not None and output != before and drain.first_new_s is None:
            drain.first_new_s = round(time.perf_counter() - began, 1)
        await asyncio.sleep(SEND_EVERY_S)
    for task in tasks:
        if not task.done():  # still open past the timeout
            task.cancel()
            drain.streams["hung"] += 1
            continue
        end = stream_end(task.result())
        drain.streams[end] += 1
        if end != "completed" and len(drain.failures) < 3:
            drain.failures.append(f"{end}: {task.result().error or task.result().problem}")
    return drain


def redeploy(config: Path, app: str) -> tuple[Callable[[], None], Callable[[], bool]]:
    """`serve deploy CONFIG` onto the running `app`, and whether its update has begun and ended."""
    deployed = {"began": False}

    def act() -> None:
        subprocess.run([*SERVE_COMMAND, "deploy", str(config)], check=True, capture_output=True)

    def running() -> bool:  # DEPLOYING, then RUNNING (or DEPLOY_FAILED)
        status = app_status(app)
        deployed["began"] = deployed["began"] or status != "RUNNING"
        return deployed["began"] and status in ("RUNNING", "DEPLOY_FAILED")

    return act, running


def deploy_drain(config: Path, app: str, streams: int, max_tokens: int, timeout_s: float) -> Drain:
    """`serve deploy CONFIG` onto the running app while `streams` streams run."""
    url, model = service_url(config)
    act, running = redeploy(config, app)
    return asyncio.run(measured(url, model, streams, max_tokens, timeout_s, f"serve deploy {config}", act, running))


def sigterm_drain(config: Path, streams: int, max_tokens: int, timeout_s: float) -> Drain:
    """`specdec serve --config CONFIG` started here; SIGTERM to it while `streams` streams run."""
    url, model = service_url(config)
    stopped(url)
    process = specdec_serve(config)
    try:
        if first_listing(url, model, time.perf_counter(), timeout_s).chat_status != 200:
            raise RuntimeError(f"specdec serve --config {config} did not serve within {timeout_s:g} s")
        act = lambda: process.send_signal(signal.SIGTERM)  # noqa: E731
        exited = lambda: process.poll() is not None  # noqa: E731
        return asyncio.run(
            measured(url, model, streams, max_tokens, timeout_s, "SIGTERM to specdec serve", act, exited)
        )
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


async def measured(url, model, streams, max_tokens, timeout_s, event, act, ended) -> Drain:
    client = ProbeClient(url, None, os.environ.get("SPECDEC_API_KEY"), timeout_s)
    client.model = model
    try:
        return await ride_through(client, streams, max_tokens, event, act, ended)
    finally:
        await client.http.aclose()
