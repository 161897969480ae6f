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
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlparse

import grpc
import httpx

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc

from .hostile_inputs import GRPC_CASES, http_cases
from .worker import LOOPBACK, ROLES, Role, worker_handle

DRAFT_LOSS_BOUND_S = 1.0  # a request during a draft outage may take target-only + this
SOAK_VARIANTS = [  # (path, stream, fields): the soak cycles through them
    ("/v1/chat/completions", True, {"policy": {"name": "greedy"}, "drafter": "pld"}),
    ("/v1/completions", False, {"policy": {"name": "typical"}, "drafter": "mla"}),
    ("/v1/chat/completions", False, {"policy": {"name": "fly"}, "drafter": "model"}),
    ("/v1/completions", True, {"policy": {"name": "rejection"}, "drafter": "model", "temperature": 0.8}),
    ("/v1/chat/completions", False, {"policy": {"name": "ears"}, "drafter": "none", "temperature": 0.8}),
]


@dataclass
class Outcome:
    """One HTTP request's answer, as the probe saw it."""

    stream: bool
    status: int = 0
    latency_s: float = 0.0
    first_event_s: Optional[float] = None
    finish_reason: Optional[str] = None
    done: bool = False  # a stream's [DONE]
    error: Optional[dict] = None  # a failed request's OpenAI error object, or a stream's error event
    retry_after: Optional[str] = None
    speculative: dict = field(default_factory=dict)
    problem: Optional[str] = None  # hung, or the connection failed

    @property
    def unavailable(self) -> bool:
        """The documented answer while the target worker is down."""
        code = (self.error or {}).get("code")
        if self.status == 503:
            return code == "worker_unavailable" and self.retry_after is not None
        return self.status == 200 and self.done and code == "worker_unavailable"

    def failure(self, target_down: bool = False) -> Optional[str]:
        if self.problem:
            return self.problem
        if target_down and self.unavailable:
            return None
        if self.status != 200 or self.error:
            return f"status {self.status}: {(self.error or {}).get('message', '')[:120]}"
        if self.finish_reason is None or (self.stream and not self.done):
            return "lost: the stream ended without finish_reason and [DONE]"
        return None


@dataclass
class Report:
    inputs: list[tuple[str, str, str]] = field(default_factory=list)  # (input, expected, got)
    checks: list[tuple[str, str, bool]] = field(default_factory=list)  # (check, result, passed)
    failures: list[str] = field(default_factory=list)

    def check(self, name: str, result: str, problems: list[str]) -> None:
        self.checks.append((name, result, not problems))
        self.failures += [f"{name}: {problem}" for problem in problems]


class LocalCluster:
    """The probe's hold on the service's Ray cluster: kills a worker's rank 0 (Serve's health check
    then restarts the worker's replica), waits for the restarted replica, and reads the RSS of
    this machine's Ray processes (its workers' ranks named by role)."""

    def __init__(self, address: str, app_name: str):
        import ray

        if not ray.is_initialized():
            ray.init(address=address, namespace="specdec", log_to_driver=False)
        self.app_name = app_name
        self.killed: dict[str, str] = {}  # role: the address its killed replica served

    async def kill(self, role: Role) -> float:
        """Kill the worker's rank 0; returns when, on the probe's clock."""
        import ray

        handle = worker_handle(role, self.app_name)
        self.killed[role] = await handle.get_address.remote()
        ranks = await handle.rank_handles.remote()
        await asyncio.to_thread(ray.kill, ranks[0], no_restart=True)
        return time.perf_counter()

    async def back(self, role: Role) -> float:
        """When a new replica of the worker answered, on the probe's clock."""
        handle = worker_handle(role, self.app_name)
        while True:
            try:
                if await asyncio.wait_for(handle.get_address.remote(), 1.0) != self.killed[role]:
                    return time.perf_counter()
            except Exception:  # noqa: BLE001 - no replica ready yet (or the call timed out): ask again
                pass
            await asyncio.sleep(0.25)

    def memory(self) -> dict[str, float]:
        """RSS in MiB per Ray actor process on this machine, keyed by role or process title."""
        import psutil

        roles = {}
        for role in ROLES:
            try:
                pids = worker_handle(role, self.app_name).pids.remote().result(timeout_s=30)
            except Exception:  # noqa: BLE001 - a worker that is down is left out of the table
                continue
            roles.update({pid: f"{role} worker" + (f" rank {rank}" if rank else "") for rank, pid in enumerate(pids)})
        rss = {}
        for process in psutil.process_iter(["pid", "cmdline", "memory_info"]):
            title = (process.info["cmdline"] or [""])[0]
            if title.startswith("ray::") and not title.startswith("ray::IDLE"):
                name = roles.get(process.info["pid"], title.split()[0].split(".")[0])  # not the method it runs
                rss[f"{name} (pid {process.info['pid']})"] = process.info["memory_info"].rss / 2**20
        return rss


class Probe:
    def __init__(self, endpoint: str, grpc_address: Optional[str], api_key: Optional[str], timeout_s: float):
        host = urlparse(endpoint).hostname
        if host not in LOOPBACK:
            raise ValueError(f"the probe kills workers and reads process memory: loopback only, not {host!r}")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=endpoint.rstrip("/"),
            timeout=timeout_s,
            headers=self.headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self.grpc_address = grpc_address
        self.timeout_s = timeout_s
        self.model = ""
        self.report = Report()

    # ------------------------------------------------------------------ requests

    def body(self, path: str, index: int = 0, **fields) -> dict:
        prompt = f"Write a short note about topic number {index}."
        base = {"model": self.model, "max_tokens": 32, "temperature": 0}
        if path.endswith("chat/completions"):
            return {**base, "messages": [{"role": "user", "content": prompt}], **fields}
        return {**base, "prompt": prompt, **fields}

    async def call(
        self, path: str, body: dict, first_event: Optional[asyncio.Event] = None, hang_up: bool = False
    ) -> Outcome:
        """Send one request and read all of it: a stream up to [DONE] (setting `first_event` at its
        first event), or with `hang_up` only up to its first event."""
        outcome, start = Outcome(stream=bool(body.get("stream"))), time.perf_counter()
        try:
            if outcome.stream:
                await self._read_stream(path, body, outcome, start, first_event, hang_up)
            else:
                response = await self.http.post(path, json=body)
                self._read_status(response, outcome)
                payload = response.json()
                if response.status_code == 200:
                    outcome.finish_reason = payload["choices"][0]["finish_reason"]
                    outcome.speculative = payload.get("speculative") or {}
        except httpx.TimeoutException:
            outcome.problem = f"hung: no answer within {self.timeout_s:.0f} s"
        except (httpx.HTTPError, ValueError, KeyError) as error:
            outcome.problem = f"lost: {type(error).__name__}: {error}"
        outcome.latency_s = time.perf_counter() - start
        return outcome

    @staticmethod
    def _read_status(response: httpx.Response, outcome: Outcome) -> None:
        outcome.status = response.status_code
        outcome.retry_after = response.headers.get("retry-after")
        if response.status_code != 200:
            outcome.error = response.json().get("error")

    async def _read_stream(self, path, body, outcome, start, first_event, hang_up) -> None:
        async with self.http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                self._read_status(response, outcome)
                return
            outcome.status = 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outcome.done = True
                    break
                event = json.loads(line[len("data: ") :])
                if outcome.first_event_s is None:
                    outcome.first_event_s = time.perf_counter() - start
                    if first_event is not None:
                        first_event.set()
                    if hang_up:
                        return
                if "error" in event:
                    outcome.error = event["error"]
                    continue
                outcome.finish_reason = event["choices"][0].get("finish_reason") or outcome.finish_reason
                outcome.speculative = event.get("speculative") or outcome.speculative

    async def sessions(self) -> dict:
        return (await self.http.get("/health")).json().get("sessions", {})

    async def wait_for_no_sessions(self, timeout_s: float = 30.0) -> tuple[dict, float]:
        start = time.perf_counter()
        counts = await self.sessions()
        while any(counts.get(role) for role in ROLES) and time.perf_counter() - start < timeout_s:
            await asyncio.sleep(0.25)
            counts = await self.sessions()
        return counts, time.perf_counter() - start

    # ------------------------------------------------------------------ phases

    async def hostile_inputs(self) -> None:
        bases = {path: self.body(path, max_tokens=8) for path in ("/v1/completions", "/v1/chat/completions")}
        problems = []
        for case in http_cases():
            if isinstance(case.body, bytes):
                content = {"content": case.body, "headers": {"Content-Type": "application/json"}}
            else:
                content = {"json": {**bases[case.path], **case.body}}
            response = await self.http.post(case.path, **content)
            try:
                error = response.json().get("error")
            except ValueError:
                error = None
            got = f"{response.status_code} {(error or {}).get('param')}"
            self.report.inputs.append((case.label, f"{case.status} {case.param}", got))
            wrong = case.check(response.status_code, error, response.text)
            problems += [f"{case.label}: {wrong}"] if wrong else []
        for fields in GRPC_CASES if self.grpc_address else ():
            code, details = await asyncio.to_thread(self._grpc_call, pb.GenerateRequest(**fields))
            self.report.inputs.append((f"gRPC {fields}", "INVALID_ARGUMENT", code))
            if code != "INVALID_ARGUMENT" or "Traceback" in details or 'File "' in details:
                problems.append(f"gRPC {fields}: {code} {details[:120]}")
        for path, base in bases.items():
            good = await self.call(path, base)
            problems += [f"a good request after them: {good.failure()}"] if good.failure() else []
        codes = collections.Counter(got.split()[0] for _, _, got in self.report.inputs)
        self.report.check(
            "hostile inputs",
            f"{len(self.report.inputs)} tried, {len(problems)} wrong; answers "
            f"{', '.join(f'{code} x{count}' for code, count in sorted(codes.items()))}; the next good request succeeds",
            problems,
        )

    def _grpc_call(self, message: pb.GenerateRequest) -> tuple[str, str]:
        metadata = tuple((key.lower(), value) for key, value in self.headers.items())
        with grpc.insecure_channel(self.grpc_address) as channel:
            try:
                pb_grpc.SpecdecStub(channel).GenerateUnary(message, timeout=self.timeout_s, metadata=metadata)
            except grpc.RpcError as error:
                return error.code().name, error.details() or ""
        return "OK", ""

    def start_streams(
        self, count: int, path: str, first_event: Optional[asyncio.Event] = None, hang_up: bool = False, **fields
    ) -> list[asyncio.Task]:
        """`count` streams of distinct prompts, running."""
        return [
            asyncio.create_task(self.call(path, self.body(path, index, stream=True, **fields), first_event, hang_up))
            for index in range(count)
        ]

    async def concurrent_streams(self, count: int) -> None:
        outcomes = await asyncio.gather(*self.start_streams(count, "/v1/chat/completions"))
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
            *self.start_streams(count - count // 2, "/v1/chat/completions", hang_up=True, max_tokens=200),
            *self.start_streams(count // 2, "/v1/completions", hang_up=True, max_tokens=200),
        )
        counts, waited_s = await self.wait_for_no_sessions()
        left = {role: counts.get(role) for role in ROLES}
        problems = [f"sessions left open: {left}"] if any(left.values()) else []
        self.report.check(
            "client disconnects",
            f"{count} streams dropped after their first event; sessions after {waited_s:.1f} s: {left}",
            problems,
        )

    async def draft_kill(self, cluster: LocalCluster) -> None:
        path = "/v1/completions"
        probe_body = self.body(path, drafter="model")
        target_only_s = max([(await self.call(path, dict(probe_body, drafter="none"))).latency_s for _ in range(3)])
        first_event = asyncio.Event()
        streams = self.start_streams(4, path, first_event, drafter="model")
        await first_event.wait()
        killed_at = await cluster.kill("draft")
        outcomes = await asyncio.gather(*streams)
        problems = [outcome.failure() for outcome in outcomes if outcome.failure()]
        fallbacks = sum(bool(outcome.speculative.get("draft_fallback")) for outcome in outcomes)
        latencies, resumed_s = [], None
        while time.perf_counter() - killed_at < 120:
            outcome = await self.call(path, probe_body)
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
        streams = self.start_streams(4, path, first_event, drafter="pld", max_tokens=400)
        await first_event.wait()
        killed_at = await cluster.kill("target")
        restarted = asyncio.create_task(cluster.back("target"))
        outcomes = await asyncio.gather(*streams)
        problems = [outcome.failure(target_down=True) for outcome in outcomes if outcome.failure(target_down=True)]
        ended_with_error = sum(outcome.unavailable for outcome in outcomes)
        statuses, health, answered_s = [], set(), None
        while time.perf_counter() - killed_at < 180:
            outcome = await self.call(path, self.body(path, max_tokens=4))
            statuses.append(outcome.status)
            if outcome.failure(target_down=True):
                problems.append(outcome.failure(target_down=True))
            elif outcome.status == 200:
                answered_s = time.perf_counter() - killed_at
                break
            health.add((await self.http.get("/health")).status_code)
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

        async def client() -> None:
            while not queue.empty():
                index = queue.get_nowait()
                path, stream, fields = SOAK_VARIANTS[index % len(SOAK_VARIANTS)]
                outcomes.append(
                    await self.call(path, self.body(path, index, stream=stream, max_tokens=8, seed=index, **fields))
                )

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed_s = time.perf_counter() - start
        counts, _ = await self.wait_for_no_sessions()
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
        models = (await self.http.get("/v1/models")).json()
        self.model = models["data"][0]["id"]
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
        await self.http.aclose()
        return self.report
