"""`specdec probe`'s KV pressure: chats that together need twice the target worker's KV pool, at
once, against a target that admits them on demand (pool_scheduler.py). Each must complete, some
must be preempted (their streams pause, then go on), a preempted chat's output must equal the
same chat sent alone, and every block must come back."""

from __future__ import annotations

import asyncio

from .probe_client import ProbeClient
from .probe_cluster import HANDLE_TIMEOUT_S, LocalCluster

PATH = "/v1/chat/completions"
PROMPT_ROOM = 64  # positions a probe chat's prompt takes, its chat template included, at most


async def kv_pressure(client: ProbeClient, cluster: LocalCluster, count: int) -> tuple[str, str, list[str]]:
    """The check's name, its result and its problems."""
    name = f"{count} chats under KV pressure"
    try:
        before = await cluster.stats("target")
    except asyncio.TimeoutError:  # a simulated cluster's replies to another driver (probe_cluster.py)
        return name, "not run", [f"the target worker's stats did not come back within {HANDLE_TIMEOUT_S:.0f} s"]
    positions = before.get("kv_pool_positions", 0)
    if not positions:
        return name, "skipped: the target's KV pool has no fixed size (kv_budget_mb; kv_admission reach)", []
    # each chat reaches half the pool: `count` of them need count / 2 pools
    max_tokens = positions // 2 - PROMPT_ROOM
    if max_tokens < PROMPT_ROOM:
        return name, "not run", [f"a pool of {positions} positions is too small to fill with chats"]
    bodies = [
        client.body(PATH, index, stream=True, max_tokens=max_tokens, ignore_eos=True, drafter="pld")
        for index in range(count)
    ]
    outcomes = await asyncio.gather(*(client.call(PATH, body) for body in bodies))
    problems = [f"chat {index}: {outcome.failure()}" for index, outcome in enumerate(outcomes) if outcome.failure()]
    preempted = [(body, outcome) for body, outcome in zip(bodies, outcomes) if outcome.speculative.get("preemptions")]
    for body, outcome in preempted:  # alone: nothing else in the pool, nothing preempts it
        alone = await client.call(PATH, body)
        if alone.failure() or alone.text != outcome.text:
            problems.append(f"a preempted chat's output differs from it alone ({alone.failure() or 'other text'})")
    await client.wait_for_no_sessions()
    try:
        after = await cluster.stats("target")
    except asyncio.TimeoutError:
        return name, "no stats after", [f"the target worker's stats did not come back within {HANDLE_TIMEOUT_S:.0f} s"]
    if not preempted:
        problems.append(f"no chat was preempted: {count} of {max_tokens} tokens in a pool of {positions} positions")
    if after.get("kv_reserved_bytes"):
        problems.append(f"blocks held after every chat ended: {after['kv_reserved_bytes']:.0f} bytes")
    times = sum(outcome.speculative["preemptions"] for _, outcome in preempted)
    result = (
        f"{sum(not outcome.failure() for outcome in outcomes)}/{count} completed, {max_tokens} tokens "
        f"each in a pool of {positions} positions; {len(preempted)} preempted {times} times (the worker counted "
        f"{after.get('preemptions', 0) - before.get('preemptions', 0)}), each as it was alone; KV held after: "
        f"{after.get('kv_reserved_bytes', 0):.0f} bytes"
    )
    return name, result, problems
