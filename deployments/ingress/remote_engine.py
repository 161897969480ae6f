"""The served engine: validates a request (specdec_core's Frontend), opens a session on the
draft worker and on the target worker, and runs specdec_core's speculative loop against them
over gRPC. It holds no model weights (only the tokenizer and the target's config) and knows
nothing of Ray: the server gives it `locate`, which names a worker replica for each request,
and a `MetricsSink`.

Every request's loop runs on one event loop of its own (the coordinator, event_loop.py) over
grpc.aio stubs: a request in flight is a suspended coroutine, so streams never wait for a free
thread and never serialize. The ingresses reach it with `open` (from an event loop) and
`stream` (from a thread)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Optional, Protocol, Sequence

import grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.api.request import GenerationRequest, StreamChunk
from specdec_core.calibration.profile_types import TargetProfile
from specdec_core.drafters import DraftSource, drafter_source, make_drafter
from specdec_core.loop.engine import speculative_loop
from specdec_core.loop.frontend import Frontend, PreparedRequest
from specdec_core.loop.run_ahead import RunAhead
from specdec_core.target.verdicts import decides_on_target

from ..coordination.event_loop import EventLoopThread
from ..coordination.proxies import RemoteDrafter, RemoteTarget, classify
from ..workers.servicers import MESSAGE_LIMITS
from .auth import SendSecret
from .drain import Drain
from .error_replies import WorkerUnavailable

STUBS = {"draft": pb_grpc.DrafterStub, "target": pb_grpc.TargetStub}


@dataclass
class RequestTimings:
    """A finished request's latencies, from its arrival (after parsing) to its chunks."""

    latency_s: float = 0.0
    time_to_first_token_s: Optional[float] = None
    inter_token_latencies_s: list[float] = field(default_factory=list)  # between successive chunks with tokens


class MetricsSink(Protocol):
    def finished(self, request: PreparedRequest, metrics: dict, timings: RequestTimings) -> None:
        """A request finished: its metrics (the last chunk's) and its timings."""

    def failed(self, protocol: str, status: str) -> None:
        """A request failed: `protocol` "http" or "grpc", `status` its code."""


class NoMetrics:
    def finished(self, request: PreparedRequest, metrics: dict, timings: RequestTimings) -> None:
        pass

    def failed(self, protocol: str, status: str) -> None:
        pass


# (a role, "draft" or "target"; whether to wait for a replica when none was found yet) -> a worker's
# address for one request: a health check and a draft do not wait (replicas.py)
Locate = Callable[[str, bool], Awaitable[str]]
HEALTH_DEADLINE_S = 5.0  # a health check's question to a worker: one slower is reported down
MAX_WORKER_CHANNELS = 64  # replicas' channels kept open; the least recently used go first


def fixed_addresses(addresses: dict[str, str]) -> Locate:
    """Workers that stay where they are (tests, in-process servers)."""

    async def locate(role: str, wait: bool = True) -> str:
        return addresses[role]

    return locate


class RemoteEngine:
    def __init__(
        self,
        frontend: Frontend,
        locate: Locate,
        deadline_s: float = 30.0,
        metrics: Optional[MetricsSink] = None,
        secret: Optional[str] = None,
    ):
        """`locate(role, wait)`: a worker replica's gRPC address for one request (WorkerUnavailable
        when there is none); a request keeps the replicas it was given for all its calls."""
        self.frontend = copy.copy(frontend)  # its profile and heads are the target worker's, asked of it
        self.frontend.profile = lambda: self.profiles[self.consulted][0]
        self.frontend.heads = lambda: dict(self.profiles[self.consulted][1].heads)
        self.frontend.target_device = lambda: self.profiles[self.consulted][1].device_type or "cpu"
        self.locate = locate
        self.deadline_s = deadline_s
        self.metrics = metrics or NoMetrics()  # told of each finished request; the ingresses tell it of failures
        self.secret = secret  # the workers' shared secret, sent with every call
        self.coordinator = EventLoopThread("specdec-coordinator")
        self.stubs: OrderedDict[tuple[str, str], Any] = OrderedDict()  # (role, address), least recently used first
        self.addresses: dict[Any, str] = {}  # stub -> its replica's address
        self.channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        # per target stub: its profile and the Profile reply it came in (heads, device type)
        self.profiles: dict[Any, tuple[Optional[TargetProfile], Any]] = {}
        self.consulted: Any = None  # the target stub whose profile `prepare` reads
        self.drain = Drain()  # a draining replica takes no new request and ends its streams on time

    async def stub(self, role: str, wait: bool = True) -> Any:
        """On the coordinator (an aio channel belongs to the loop it is made on): a stub for a
        replica of `role`'s worker (`wait`: see `Locate`)."""
        key = (role, await self.locate(role, wait))
        if key in self.stubs:
            self.stubs.move_to_end(key)
            return self.stubs[key]
        interceptors = [SendSecret(self.secret)] if self.secret else None
        self.channels[key] = grpc.aio.insecure_channel(key[1], options=MESSAGE_LIMITS, interceptors=interceptors)
        self.stubs[key] = STUBS[role](self.channels[key])
        self.addresses[self.stubs[key]] = key[1]
        while len(self.stubs) > MAX_WORKER_CHANNELS:  # a restarted replica's old address is never given again
            old, stub = self.stubs.popitem(last=False)
            self.profiles.pop(stub, None)
            self.addresses.pop(stub, None)
            await self.channels.pop(old).close()
        return self.stubs[key]

    async def prepare(self, request: GenerationRequest) -> tuple[PreparedRequest, Any]:
        """On the coordinator: `request` validated (SpecdecError) with its defaults, and the target
        replica that will decode it, whose profile (asked once per replica) fills them in."""
        stub = await self.stub("target")
        if stub not in self.profiles:
            try:
                reply = await stub.Profile(pb.Empty(), timeout=self.deadline_s)
            except grpc.RpcError as error:
                raise classify(error, "target") from None
            profile = TargetProfile.model_validate_json(reply.profile_json) if reply.profile_json else None
            self.profiles[stub] = (profile, reply)
        self.consulted = stub  # read by frontend.prepare, with no await between
        return self.frontend.prepare(request), stub

    async def open(self, request: GenerationRequest, request_id: Optional[str] = None) -> AsyncIterator[StreamChunk]:
        """From any event loop: validates `request` now, then decodes it on the coordinator as
        the chunks are read; `request_id` names its worker sessions."""
        arrival = time.perf_counter()
        self.drain.refuse_new()
        prepared, target = await self.coordinator.arun(self.prepare(request))
        return self.coordinator.aiterate(self.decode(prepared, target, request_id or uuid.uuid4().hex, arrival))

    def stream(self, request: GenerationRequest, request_id: Optional[str] = None) -> Iterator[StreamChunk]:
        """`open` for a caller on a plain thread."""
        arrival = time.perf_counter()
        self.drain.refuse_new()
        prepared, target = self.coordinator.run(self.prepare(request))
        return self.coordinator.iterate(self.decode(prepared, target, request_id or uuid.uuid4().hex, arrival))

    async def decode(
        self, request: PreparedRequest, target_stub: Any, session_id: str, arrival: float
    ) -> AsyncIterator[StreamChunk]:
        target = RemoteTarget(target_stub, session_id, self.deadline_s)
        remote_drafter = None  # a drafter of the target's heads uses no draft worker: they run on the target's
        if drafter_source(request.drafter.name) is DraftSource.TARGET_HEADS:
            drafter = make_drafter(request.drafter.name, request.drafter.params, target=target)
        else:
            drafter = remote_drafter = RemoteDrafter(
                None, session_id, request.drafter, request.policy.needs_draft_logits(), self.deadline_s
            )
            if remote_drafter.remote:
                try:  # a draft worker not found at once only means target-only: the request does not wait
                    remote_drafter.stub = await self.stub("draft", wait=False)
                except WorkerUnavailable as error:  # the request goes on target-only
                    remote_drafter.fall_back(str(error))
            if request.run_ahead:  # the draft worker drafts while the target verifies
                drafter = RunAhead(remote_drafter, asyncio.ensure_future)
                # and sends its blocks on to the target where the target decides verdicts itself: from
                # the rows alone (not rows the server processes: the target holds them raw), asked at
                # Reset; or a sampled session's, as its Reset says
                rows_decide = request.policy.decided_by_target_rows(request.sampling)
                target.asks_forwarded = rows_decide and not request.sampling.processes_logits
                remote_drafter.forward_to = (self.addresses[target_stub], target)
        output = self.frontend.output(request)
        if decides_on_target(request.policy, request.sampling):  # the rows stay there: only verdicts travel
            target.verdict_stop_ids = sorted(output.stop_ids) if request.sampling.min_tokens else []
        timings, last_chunk_at = RequestTimings(), arrival
        loop = speculative_loop(request, drafter, target, output)
        try:
            async with contextlib.aclosing(loop) as chunks:
                async for chunk in chunks:
                    self.drain.check_stream()
                    now = time.perf_counter()
                    if chunk.token_ids:
                        if timings.time_to_first_token_s is None:
                            timings.time_to_first_token_s = now - arrival
                        else:
                            timings.inter_token_latencies_s.append(now - last_chunk_at)
                        last_chunk_at = now
                    if chunk.metrics is not None:
                        steps = max(chunk.metrics["num_steps"], 1)
                        received = target.bytes_received + (remote_drafter.bytes_received if remote_drafter else 0)
                        if "run_ahead" in chunk.metrics:
                            chunk.metrics["run_ahead"]["forwarded"] = target.forwarded_blocks
                        chunk.metrics.update(
                            wire_bytes_per_step=round(received / steps, 1),
                            full_logits_bytes_per_step=round(target.full_rows_bytes / steps, 1),
                            draft_fallback=remote_drafter is not None and remote_drafter.failed is not None,
                            verdicts_on_target=target.decides_verdicts,
                        )
                        timings.latency_s = now - arrival
                        self.metrics.finished(request, chunk.metrics, timings)
                    yield chunk
        finally:  # also on client disconnect (closed or cancelled): free both sessions
            await target.release()
            if isinstance(drafter, RunAhead):  # a proposal still out: release the session after it
                await drafter.settle()
            if remote_drafter is not None:
                await remote_drafter.release()

    async def count_sessions(self, roles: Sequence[str] = tuple(STUBS)) -> dict[str, Optional[int]]:
        """From any event loop: open sessions per worker of `roles`; None for a worker that does
        not answer within HEALTH_DEADLINE_S."""
        return await self.coordinator.arun(self._count_sessions(roles))

    def session_counts(self) -> dict[str, Optional[int]]:
        """`count_sessions` for a caller on a plain thread."""
        return self.coordinator.run(self._count_sessions(tuple(STUBS)))

    async def _count_sessions(self, roles: Sequence[str]) -> dict[str, Optional[int]]:
        """Of one replica of each worker (the one `locate` gives, without waiting for one), asked
        at once."""

        async def count(role: str) -> Optional[int]:
            try:
                stub = await self.stub(role, wait=False)
                return (await stub.Stats(pb.Empty(), timeout=HEALTH_DEADLINE_S)).sessions
            except (grpc.RpcError, WorkerUnavailable):
                return None

        return dict(zip(roles, await asyncio.gather(*map(count, roles))))

    def close(self) -> None:
        """Close the channels and stop the coordinator (requests still in flight fail)."""
        self.coordinator.run(self._close_channels())
        self.coordinator.stop()

    async def _close_channels(self) -> None:
        for channel in self.channels.values():
            await channel.close()
