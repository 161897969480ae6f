"""`specdec probe`: the reliability suite, run against a service on this machine. In order:
hostile inputs (HTTP both endpoints, gRPC), concurrent streams, client disconnects, a draft
worker and a target worker killed mid-stream, then the simulated nodes that hold them lost
(probe_faults.py, through Ray), chats that need twice the target's KV pool (probe_pressure.py), a
`serve deploy` of a changed config while streams run (drain_check.py), and a soak with each Ray
process's RSS before and after. Every request has a deadline. A failure is a lost or hung
request, a status other than the expected one (a 503 with Retry-After, or a stream's
worker_unavailable error event, only while the target is down or the config changes), a session
or a rank, placement group or KV block left held, or a request slowed by the draft's loss beyond
target-only + 1 s."""

from __future__ import annotations

import asyncio
import collections
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from protos import specdec_pb2 as pb

from ..workers.worker import LOOPBACK, ROLES
from .deploy_check import app_status
from .drain_check import counted, redeploy, ride_through
from .hostile_inputs import GRPC_CASES, http_cases
from .probe_client import Outcome, ProbeClient
from .probe_cluster import LocalCluster
from .probe_faults import node_loss, worker_kill
from .probe_pressure import kv_pressure

PHASES = ("inputs", "streams", "disconnects", "kills", "node-loss", "kv-pressure", "redeploy", "soak")  # in order
REDEPLOY_TOKENS = 200  # each stream's, through a redeploy
SOAK_VARIANTS = [  # (path, stream, fields): the soak cycles through them
    ("/v1/chat/completions", True, {"policy": {"name": "greedy"}, "drafter": "pld"}),
    ("/v1/completions", False, {"policy": {"name": "typical"}, "drafter": "mla"}),
    ("/v1/chat/completions", False, {"policy": {"name": "fly"}, "drafter": "model"}),
    ("/v1/completions", True, {"policy": {"name": "rejection"}, "drafter": "model", "temperature": 0.8}),
    ("/v1/chat/completions", False, {"policy": {"name": "ears"}, "drafter": "none", "temperature": 0.8}),
]


@dataclass
class ProbeCounts:
    """How much each phase sends."""

    streams: int = 64
    disconnects: int = 16
    kv_chats: int = 4
    redeploy_streams: int = 16
    soak: int = 1000
    soak_concurrency: int = 8


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

    def __init__(self, client: ProbeClient):
        host = client.http.base_url.host
        if host not in LOOPBACK:
            raise ValueError(f"the probe kills workers and reads process memory: loopback only, not {host!r}")
        self.client = client
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

    async def kv_pressure(self, cluster: LocalCluster, count: int) -> None:
        self.report.check(*await kv_pressure(self.client, cluster, count))

    async def redeploy(self, config: Path, app: str, streams: int) -> None:
        """Streams through `serve deploy CONFIG`: each completes or ends with an error event; the
        requests meanwhile get 200 or 503 + Retry-After; the app runs the new config after."""
        name, (act, running) = f"serve deploy while {streams} streams run", redeploy(config, app)
        try:
            drain = await ride_through(self.client, streams, REDEPLOY_TOKENS, f"serve deploy {config}", act, running)
            running_after = await asyncio.to_thread(app_status, app) == "RUNNING"
        except subprocess.CalledProcessError as error:  # serve deploy or serve status failed
            stderr = error.stderr.decode() if isinstance(error.stderr, bytes) else error.stderr or ""
            self.report.check(name, "not run", [f"{' '.join(error.cmd)}: {stderr[-300:]}"])
            return
        problems = [
            f"{count} streams {end}"
            for end, count in drain.streams.items()
            if end != "completed" and not end.startswith("error event")
        ]
        problems += [
            f"{count} requests got {status}"
            for status, count in drain.requests.items()
            if status not in ("200", "503 + Retry-After")
        ]
        if drain.after_s is None or not running_after:
            problems.append(f"the app was not RUNNING on the new config within {self.client.timeout_s:.0f} s")
        self.report.check(
            name,
            f"streams: {counted(drain.streams)}; requests meanwhile: {counted(drain.requests)}; RUNNING again "
            f"after {drain.after_s} s; "
            + (
                "the same output throughout" if drain.first_new_s is None else f"new output after {drain.first_new_s} s"
            ),
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
        counts: ProbeCounts,
        phases: tuple[str, ...],
        cluster: Optional[LocalCluster],
        redeploy_config: Optional[Path] = None,
        announce: Callable[[str], None] = lambda phase: None,
    ) -> Report:
        """The `phases` asked for (`announce`d as they start); kills, KV pressure, the redeploy and
        the memory table need `cluster`, the redeploy a changed config too."""
        models = (await self.client.http.get("/v1/models")).json()
        self.client.model = models["data"][0]["id"]
        memory = cluster.memory if cluster else dict
        runs = {
            "inputs": ("hostile inputs", self.hostile_inputs),
            "streams": (f"{counts.streams} concurrent streams", lambda: self.concurrent_streams(counts.streams)),
            "disconnects": (f"{counts.disconnects} client disconnects", lambda: self.disconnects(counts.disconnects)),
            "soak": (
                f"soak of {counts.soak} requests",
                lambda: self.soak(counts.soak, counts.soak_concurrency, memory),
            ),
        }
        if cluster is not None:
            runs["kills"] = ("worker kills", lambda: self.faults(worker_kill, cluster))
            runs["node-loss"] = ("node loss", lambda: self.faults(node_loss, cluster))
            runs["kv-pressure"] = ("KV pressure", lambda: self.kv_pressure(cluster, counts.kv_chats))
            if redeploy_config is not None:
                streams = counts.redeploy_streams
                runs["redeploy"] = ("serve deploy", lambda: self.redeploy(redeploy_config, cluster.app_name, streams))
        for phase in (phase for phase in PHASES if phase in phases):
            if phase not in runs:  # asked for, but what it needs is missing
                needs = "--redeploy CONFIG" if cluster is not None else "Ray (not --no-kills)"
                self.report.checks.append((phase, f"not run: it needs {needs}", True))
                continue
            name, run = runs[phase]
            announce(name)
            await run()
        await self.client.http.aclose()
        return self.report

    async def faults(self, check, cluster: LocalCluster) -> None:
        """`check` (probe_faults.py) on the draft worker, then on the target worker."""
        for role in ("draft", "target"):
            self.report.check(*await check(self.client, cluster, role))
