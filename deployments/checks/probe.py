"""`specdec probe`: the reliability suite, run against a service on this machine. In order:
hostile inputs (HTTP both endpoints, gRPC), concurrent streams, client disconnects, a draft
worker and a target worker killed mid-stream (through Ray), and a soak with each Ray process's
RSS before and after. Every request has a deadline. A failure is a lost or hung request, a
status other than the expected one (a 503 with Retry-After, or a stream's worker_unavailable
error event, only while the target is down), a session left open, or a request slowed by the
draft loss beyond target-only + 1 s."""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlparse

from protos import specdec_pb2 as pb

from ..workers.worker import LOOPBACK, ROLES
from .hostile_inputs import GRPC_CASES, http_cases
from .probe_client import Outcome, ProbeClient
from .probe_cluster import LocalCluster

DRAFT_LOSS_BOUND_S = 1.0  # a request during a draft outage may take target-only + this
SOAK_VARIANTS = [  # (path, stream, fields): the soak cycles through them
    ("/v1/chat/completions", True, {"policy": {"name": "greedy"}, "drafter": "pld"}),
    ("/v1/completions", False, {"policy": {"name": "typical"}, "drafter": "mla"}),
    ("/v1/chat/completions", False, {"policy": {"name": "fly"}, "drafter": "model"}),
    ("/v1/completions", True, {"policy": {"name": "rejection"}, "drafter": "model", "temperature": 0.8}),
    ("/v1/chat/completions", False, {"policy": {"name": "ears"}, "drafter": "none", "temperature": 0.8}),
]


@dataclass
class Report:
    """What the phases found, as `specdec probe` prints it."""

    inputs: list[tuple[str, str, str]] = field(default_factory=list)  # (input, expected, got)
    checks: list[tuple[str, str, bool]] = field(default_factory=list)  # (check, result, passed)
    failures: list[str] = field(default_factory=list)

    def check(self, name: str, result: str, problems: list[str]) -> None:
        self.checks.append((name, result, not problems))
        self.failures += [f"{name}: {problem}" for problem in problems]


class Probe:
    """The suite's phases, each sending its requests through `client` and adding its check to `report`."""

    def __init__(self, endpoint: str, grpc_address: Optional[str], api_key: Optional[str], timeout_s: float):
        host = urlparse(endpoint).hostname
        if host not in LOOPBACK:
            raise ValueError(f"the probe kills workers and reads process memory: loopback only, not {host!r}")
        self.client = ProbeClient(endpoint, grpc_address, api_key, timeout_s)
        self.report = Report()

    async def hostile_inputs(self) -> None:
        bases = {path: self.client.body(path, max_tokens=8) for path in ("/v1/completions", "/v1/chat/completions")}
        problems = []
        for case in http_cases():
            if isinstance(case.body, bytes):
                content = {"content": case.body, "headers": {"Content-Type": "application/json"}}
            else:
                content = {"json": {**bases[case.path], **case.body}}
            response = await self.client.http.post(case.path, **content)
            try:
                error = response.json().get("error")
            except ValueError:
                error = None
            got = f"{response.status_code} {(error or {}).get('param')}"
            self.report.inputs.append((case.label, f"{case.status} {case.param}", got))
            wrong = case.check(response.status_code, error, response.text)
            problems += [f"{case.label}: {wrong}"] if wrong else []
        for fields in GRPC_CASES if self.client.grpc_address else ():
            code, details = await asyncio.to_thread(self.client.grpc_generate, pb.GenerateRequest(**fields))
            self.report.inputs.append((f"gRPC {fields}", "INVALID_ARGUMENT", code))
            if code != "INVALID_ARGUMENT" or "Traceback" in details or 'File "' in details:
                problems.append(f"gRPC {fields}: {code} {details[:120]}")
        for path, base in bases.items():
            good = await self.client.call(path, base)
            problems += [f"a good request after them: {good.failure()}"] if good.failure() else []
        codes = collections.Counter(got.split()[0] for _, _, got in self.report.inputs)
        self.report.check(
            "hostile inputs",
            f"{len(self.report.inputs)} tried, {len(problems)} wrong; answers "
            f"{', '.join(f'{code} x{count}' for code, count in sorted(codes.items()))}; the next good request succeeds",
            problems,
        )

    async def concurrent_streams(self, count: int) -> None:
        outcomes = await asyncio.gather(*self.client.start_streams(count, "/v1/chat/completions"))
        latencies = [outcome.latency_s for outcome in outcomes]
        firsts = [outcome.first_event_s for outcome in outcomes if outcome.first_event_s is not None]
        problems = [outcome.failure() for outcome in outcomes if outcome.failure()]
        self.report.check(
            f"{count} concurrent streams",
            f"{count - len(problems)}/{count} completed; latency p50 {statistics.median(latencies):.2f} s, "
            f"max {max(latencies):.2f} s; first event p50 {statistics.median(firsts or [0]):.2f} s",
            problems,
        )

    async def disconnects(self, count: int) -> None:
        await asyncio.gather(
            *self.client.start_streams(count - count // 2, "/v1/chat/completions", hang_up=True, max_tokens=200),
            *self.client.start_streams(count // 2, "/v1/completions", hang_up=True, max_tokens=200),
        )
        counts, waited_s = await self.client.wait_for_no_sessions()
        left = {role: counts.get(role) for role in ROLES}
        problems = [f"sessions left open: {left}"] if any(left.values()) else []
        self.report.check(
            "client disconnects",
            f"{count} streams dropped after their first event; sessions after {waited_s:.1f} s: {left}",
            problems,
        )

    async def draft_kill(self, cluster: LocalCluster) -> None:
        path = "/v1/completions"
        probe_body = self.client.body(path, drafter="model")
        target_only_s = max(
            [(await self.client.call(path, dict(probe_body, drafter="none"))).latency_s for _ in range(3)]
        )
        first_event = asyncio.Event()
        streams = self.client.start_streams(4, path, first_event, drafter="model")
        await first_event.wait()
        killed_at = await cluster.kill("draft")
        outcomes = await asyncio.gather(*streams)
        problems = [outcome.failure() for outcome in outcomes if outcome.failure()]
        fallbacks = sum(bool(outcome.speculative.get("draft_fallback")) for outcome in outcomes)
        latencies, resumed_s = [], None
        while time.perf_counter() - killed_at < 120:
            outcome = await self.client.call(path, probe_body)
            latencies.append(outcome.latency_s)
            if outcome.failure():
                problems.append(outcome.failure())
            elif not outcome.speculative.get("draft_fallback"):
                resumed_s = time.perf_counter() - killed_at
                break
            await asyncio.sleep(0.25)
        worst = max(latencies)
        if worst > target_only_s + DRAFT_LOSS_BOUND_S:
            problems.append(f"a request took {worst:.2f} s, target-only {target_only_s:.2f} s")
        if resumed_s is None:
            problems.append("speculation did not resume within 120 s")
        self.report.check(
            "draft worker killed mid-stream",
            f"{len(outcomes)} streams finished ({fallbacks} target-only); {len(latencies)} requests while it "
            f"restarted: worst {worst:.2f} s (target-only {target_only_s:.2f} s); speculation back "
            f"{resumed_s or float('nan'):.1f} s after the kill",
            problems,
        )

    async def target_kill(self, cluster: LocalCluster) -> None:
        path = "/v1/chat/completions"
        first_event = asyncio.Event()
        streams = self.client.start_streams(4, path, first_event, drafter="pld", max_tokens=400)
        await first_event.wait()
        killed_at = await cluster.kill("target")
        restarted = asyncio.create_task(cluster.back("target"))
        outcomes = await asyncio.gather(*streams)
        problems = [outcome.failure(target_down=True) for outcome in outcomes if outcome.failure(target_down=True)]
        ended_with_error = sum(outcome.unavailable for outcome in outcomes)
        statuses, health, answered_s = [], set(), None
        while time.perf_counter() - killed_at < 180:
            outcome = await self.client.call(path, self.client.body(path, max_tokens=4))
            statuses.append(outcome.status)
            if outcome.failure(target_down=True):
                problems.append(outcome.failure(target_down=True))
            elif outcome.status == 200:
                answered_s = time.perf_counter() - killed_at
                break
            health.add((await self.client.http.get("/health")).status_code)
            await asyncio.sleep(0.25)
        restarted_s = await restarted - killed_at if restarted.done() else None
        if answered_s is None:
            problems.append("the service did not answer 200 within 180 s")
        self.report.check(
            "target worker killed mid-stream",
            f"{ended_with_error}/{len(outcomes)} streams ended with an error event + [DONE]; "
            f"{statuses.count(503)} requests got 503 + Retry-After (/health {sorted(health)}); actor back "
            f"{restarted_s or float('nan'):.1f} s after the kill, service 200 at {answered_s or float('nan'):.1f} s "
            f"({(answered_s or 0) - (restarted_s or 0):.1f} s after the actor)",
            problems,
        )

    async def soak(self, count: int, concurrency: int, memory: Callable[[], dict[str, float]]) -> None:
        before = await asyncio.to_thread(memory)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(count):
            queue.put_nowait(index)
        outcomes: list[Outcome] = []

        async def soak_client() -> None:
            while not queue.empty():
                index = queue.get_nowait()
                path, stream, fields = SOAK_VARIANTS[index % len(SOAK_VARIANTS)]
                body = self.client.body(path, index, stream=stream, max_tokens=8, seed=index, **fields)
                outcomes.append(await self.client.call(path, body))

        start = time.perf_counter()
        await asyncio.gather(*(soak_client() for _ in range(concurrency)))
        elapsed_s = time.perf_counter() - start
        counts, _ = await self.client.wait_for_no_sessions()
        after = await asyncio.to_thread(memory)
        problems = [outcome.failure() for outcome in outcomes if outcome.failure()]
        left = {role: counts.get(role) for role in ROLES}
        problems += [f"sessions left open: {left}"] if any(left.values()) else []
        self.report.check(
            f"soak of {count} requests",
            f"{count - len(problems)}/{count} completed in {elapsed_s:.0f} s, {concurrency} at a time; "
            f"sessions after: {left}",
            problems,
        )
        for name in sorted(set(before) | set(after)):
            rss = f"RSS {before.get(name, float('nan')):.0f} -> {after.get(name, float('nan')):.0f} MiB"
            self.report.checks.append((f"  {name}", rss, True))

    async def run(
        self,
        streams: int,
        disconnects: int,
        soak: int,
        soak_concurrency: int,
        cluster: Optional[LocalCluster],
        announce: Callable[[str], None] = lambda phase: None,
    ) -> Report:
        """All phases (`announce`d as they start); the kills and the memory table need `cluster`."""
        models = (await self.client.http.get("/v1/models")).json()
        self.client.model = models["data"][0]["id"]
        phases = [
            ("hostile inputs", self.hostile_inputs()),
            (f"{streams} concurrent streams", self.concurrent_streams(streams)),
            (f"{disconnects} client disconnects", self.disconnects(disconnects)),
        ]
        if cluster is not None:
            phases += [
                ("draft worker kill", self.draft_kill(cluster)),
                ("target worker kill", self.target_kill(cluster)),
            ]
        phases.append(
            (f"soak of {soak} requests", self.soak(soak, soak_concurrency, cluster.memory if cluster else dict))
        )
        for name, phase in phases:
            announce(name)
            await phase
        await self.client.http.aclose()
        return self.report
