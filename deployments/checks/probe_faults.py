"""`specdec probe`'s faults mid-stream, through Ray (probe_cluster.py): a worker's rank 0 killed,
or the simulated node that holds it lost. A draft worker's fault fails no request: its streams
finish target-only, a request meanwhile takes at most target-only + the client's draft_slack_s, and
speculation resumes. A target worker's fault ends its streams with an error event and [DONE],
requests get 503 + Retry-After until the service answers 200 again. After a node's loss the
ranks alive and the placement groups come back to their counts before it."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from ..workers.worker import Role
from .probe_client import ProbeClient, first_event_or_end
from .probe_cluster import LocalCluster, NodeNotLosable

REBUILT_S = 180.0  # a lost node's worker is running on another node this long after at most
Fault = Callable[[], Awaitable[float]]  # does it; returns when, on the probe's clock
Check = tuple[str, str, list[str]]  # a check's name, its result, its problems


async def streams_under_way(client: ProbeClient, path: str, **fields) -> list[asyncio.Task]:
    """4 streams, once one has its first event (or all have ended: refused, failed)."""
    first_event = asyncio.Event()
    streams = client.start_streams(4, path, first_event, **fields)
    await first_event_or_end(first_event, streams, client.timeout_s)
    return streams


async def draft_fault(client: ProbeClient, cluster: LocalCluster, fault: Fault, name: str) -> Check:
    path = "/v1/completions"
    probe_body = client.body(path, drafter="model")
    target_only_s = max([(await client.call(path, dict(probe_body, drafter="none"))).latency_s for _ in range(3)])
    streams = await streams_under_way(client, path, drafter="model")
    fault_at = await fault()
    outcomes = await asyncio.gather(*streams)
    problems = [outcome.failure() for outcome in outcomes if outcome.failure()]
    fallbacks = sum(bool(outcome.speculative.get("draft_fallback")) for outcome in outcomes)
    latencies, resumed_s = [], None
    while time.perf_counter() - fault_at < 120:
        outcome = await client.call(path, probe_body)
        latencies.append(outcome.latency_s)
        if outcome.failure():
            problems.append(outcome.failure())
        elif not outcome.speculative.get("draft_fallback"):
            resumed_s = time.perf_counter() - fault_at
            break
        await asyncio.sleep(0.25)
    worst = max(latencies, default=float("nan"))
    if worst > target_only_s + client.draft_slack_s:
        problems.append(f"a request took {worst:.2f} s, target-only {target_only_s:.2f} s")
    if resumed_s is None:
        problems.append("speculation did not resume within 120 s")
    result = (
        f"{len(outcomes)} streams finished ({fallbacks} target-only); {len(latencies)} requests while it "
        f"restarted: worst {worst:.2f} s (target-only {target_only_s:.2f} s); speculation back "
        f"{resumed_s or float('nan'):.1f} s after"
    )
    return name, result, problems


async def target_fault(client: ProbeClient, cluster: LocalCluster, fault: Fault, name: str) -> Check:
    path = "/v1/chat/completions"
    streams = await streams_under_way(client, path, drafter="pld", max_tokens=400)
    fault_at = await fault()
    restarted = asyncio.create_task(cluster.back("target"))
    outcomes = await asyncio.gather(*streams)
    problems = [outcome.failure(target_down=True) for outcome in outcomes if outcome.failure(target_down=True)]
    ended_with_error = sum(outcome.unavailable for outcome in outcomes)
    statuses, health, answered_s = [], set(), None
    while time.perf_counter() - fault_at < 180:
        outcome = await client.call(path, client.body(path, max_tokens=4))
        statuses.append(outcome.status)
        if outcome.failure(target_down=True):
            problems.append(outcome.failure(target_down=True))
        elif outcome.status == 200:
            answered_s = time.perf_counter() - fault_at
            break
        health.add((await client.http.get("/health")).status_code)
        await asyncio.sleep(0.25)
    restarted_s = await restarted - fault_at if restarted.done() else None
    restarted.cancel()  # still looking: the service answered first, or never
    if answered_s is None:
        problems.append("the service did not answer 200 within 180 s")
    result = (
        f"{ended_with_error}/{len(outcomes)} streams ended with an error event + [DONE]; "
        f"{statuses.count(503)} requests got 503 + Retry-After (/health {sorted(health)}); actor back "
        f"{restarted_s or float('nan'):.1f} s after, service 200 at {answered_s or float('nan'):.1f} s "
        f"({(answered_s or 0) - (restarted_s or 0):.1f} s after the actor)"
    )
    return name, result, problems


FAULT_CHECKS = {"draft": draft_fault, "target": target_fault}


async def worker_kill(client: ProbeClient, cluster: LocalCluster, role: Role) -> Check:
    """`role`'s rank 0 killed mid-stream (Serve's health check restarts its replica)."""
    return await FAULT_CHECKS[role](client, cluster, lambda: cluster.kill(role), f"{role} worker killed mid-stream")


async def node_loss(client: ProbeClient, cluster: LocalCluster, role: Role) -> Check:
    """The simulated node of `role`'s rank 0 lost mid-stream; then the worker rebuilt on another
    node (REBUILT_S at most), and what the workers hold back to its count before (60 s more)."""
    name = f"{role} worker's node lost mid-stream"
    try:
        node_id = await cluster.node_of(role)
    except NodeNotLosable as reason:  # asked for (never by default): not losing it fails the check
        return name, f"not run: {reason}", [f"the {role} worker's node cannot be lost: {reason}"]
    before, lost = await cluster.held(), {}

    async def lose() -> float:
        lost["at"] = await cluster.lose_node(role, node_id)
        return lost["at"]

    _, result, problems = await FAULT_CHECKS[role](client, cluster, lose, name)
    try:
        rebuilt_s = f"{await asyncio.wait_for(cluster.back(role), REBUILT_S) - lost['at']:.1f} s"
    except asyncio.TimeoutError:
        rebuilt_s = "never"
        problems.append(f"the {role} worker was not rebuilt on another node within {REBUILT_S:.0f} s")
    deadline = time.perf_counter() + 60
    while (held := await cluster.held()) != before and time.perf_counter() < deadline:
        await asyncio.sleep(1)
    if held != before:
        problems.append(f"ranks alive and placement groups {held}, before the loss {before}")
    return name, f"{result}; rebuilt within {rebuilt_s}; ranks alive and placement groups {before} -> {held}", problems
