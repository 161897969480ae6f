"""The served engine: validates a request (specdec_core's Frontend), opens a session on the
draft worker and on the target worker, and runs specdec_core's speculative loop against them
over gRPC. It holds no model weights (only the tokenizer and the target's config) and knows
nothing of Ray: the server points it at workers with `connect` and gives it a `MetricsSink`.

Every request's loop runs on one event loop of its own (the coordinator, event_loop.py) over
grpc.aio stubs: a request in flight is a suspended coroutine, so streams never wait for a free
thread and never serialize. The ingresses reach it with `open` (from an event loop) and
`stream` (from a thread)."""

from __future__ import annotations

import contextlib
import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Optional, Protocol

import grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.drafters import HeadsDrafter, validate_drafter
from specdec_core.engine import speculative_loop
from specdec_core.frontend import Frontend, PreparedRequest
from specdec_core.profile import TargetProfile
from specdec_core.request import GenerationRequest, StreamChunk

from .auth import SendSecret
from .event_loop import EventLoopThread
from .proxies import RemoteDrafter, RemoteTarget, classify
from .servicers import MESSAGE_LIMITS

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


class RemoteEngine:
    def __init__(
        self,
        frontend: Frontend,
        addresses: dict[str, str],
        deadline_s: float = 30.0,
        metrics: Optional[MetricsSink] = None,
        secret: Optional[str] = None,
    ):
        self.frontend = copy.copy(frontend)  # its profile and heads are the target worker's, asked of it
        self.frontend.profile = lambda: self.profiles.get(self.stubs["target"])
        self.frontend.num_heads = lambda: self.heads_counts.get(self.stubs["target"], 0)
        self.deadline_s = deadline_s
        self.metrics = metrics or NoMetrics()  # told of each finished request; the ingresses tell it of failures
        self.secret = secret  # the workers' shared secret, sent with every call
        self.coordinator = EventLoopThread("specdec-coordinator")
        self.stubs: dict[str, object] = {}
        self.channels: list[grpc.aio.Channel] = []  # every one opened, closed with the engine
        self.profiles: dict[object, Optional[TargetProfile]] = {}  # per target stub: its worker's own
        self.heads_counts: dict[object, int] = {}  # likewise its heads
        for role, address in addresses.items():
            self.connect(role, address)

    def connect(self, role: str, address: str) -> None:
        """Send the next requests of `role` ("draft" or "target") to the worker at `address`;
        requests in flight keep the channel they started on. Not from the coordinator's loop."""
        self.coordinator.run(self._connect(role, address))

    async def _connect(self, role: str, address: str) -> None:  # an aio channel belongs to the loop it is made on
        interceptors = [SendSecret(self.secret)] if self.secret else None
        channel = grpc.aio.insecure_channel(address, options=MESSAGE_LIMITS, interceptors=interceptors)
        self.channels.append(channel)
        self.stubs[role] = STUBS[role](channel)

    async def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """On the coordinator: `request` validated (SpecdecError) with its defaults, the target's
        profile asked of its worker first, once per connection."""
        while (stub := self.stubs["target"]) not in self.profiles:
            try:
                reply = await stub.Profile(pb.Empty(), timeout=self.deadline_s)
            except grpc.RpcError as error:
                raise classify(error, "target") from None
            profile = TargetProfile.model_validate_json(reply.profile_json) if reply.profile_json else None
            self.profiles, self.heads_counts = {stub: profile}, {stub: reply.num_heads}
        return self.frontend.prepare(request)

    async def open(self, request: GenerationRequest, request_id: Optional[str] = None) -> AsyncIterator[StreamChunk]:
        """From any event loop: validates `request` now, then decodes it on the coordinator as
        the chunks are read; `request_id` names its worker sessions."""
        arrival = time.perf_counter()
        prepared = await self.coordinator.arun(self.prepare(request))
        return self.coordinator.aiterate(self.decode(prepared, request_id or uuid.uuid4().hex, arrival))

    def stream(self, request: GenerationRequest, request_id: Optional[str] = None) -> Iterator[StreamChunk]:
        """`open` for a caller on a plain thread."""
        arrival = time.perf_counter()
        prepared = self.coordinator.run(self.prepare(request))
        return self.coordinator.iterate(self.decode(prepared, request_id or uuid.uuid4().hex, arrival))

    async def decode(self, request: PreparedRequest, session_id: str, arrival: float) -> AsyncIterator[StreamChunk]:
        target = RemoteTarget(self.stubs["target"], session_id, self.deadline_s)
        remote_drafter = None  # the heads drafter uses no draft worker: the heads run on the target's
        if request.drafter.name == HeadsDrafter.name:
            drafter = HeadsDrafter(target, validate_drafter(request.drafter.name, request.drafter.params))
        else:
            drafter = remote_drafter = RemoteDrafter(
                self.stubs["draft"], session_id, request.drafter, request.policy.needs_draft_logits(), self.deadline_s
            )
        timings, last_chunk_at = RequestTimings(), arrival
        loop = speculative_loop(request, drafter, target, self.frontend.output(request))
        try:
            async with contextlib.aclosing(loop) as chunks:
                async for chunk in chunks:
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
                        chunk.metrics.update(
                            wire_bytes_per_step=round(received / steps, 1),
                            full_logits_bytes_per_step=round(target.full_rows_bytes / steps, 1),
                            draft_fallback=remote_drafter is not None and remote_drafter.failed is not None,
                        )
                        timings.latency_s = now - arrival
                        self.metrics.finished(request, chunk.metrics, timings)
                    yield chunk
        finally:  # also on client disconnect (closed or cancelled): free both sessions
            await target.release()
            if remote_drafter is not None:
                await remote_drafter.release()

    async def count_sessions(self) -> dict[str, Optional[int]]:
        """From any event loop: open sessions per worker; None for a worker that does not answer."""
        return await self.coordinator.arun(self._count_sessions())

    def session_counts(self) -> dict[str, Optional[int]]:
        """`count_sessions` for a caller on a plain thread."""
        return self.coordinator.run(self._count_sessions())

    async def _count_sessions(self) -> dict[str, Optional[int]]:
        counts: dict[str, Optional[int]] = {}
        for role, stub in self.stubs.items():
            try:
                counts[role] = (await stub.Stats(pb.Empty(), timeout=self.deadline_s)).sessions
            except grpc.RpcError:
                counts[role] = None
        return counts

    def close(self) -> None:
        """Close the channels and stop the coordinator (requests still in flight fail)."""
        self.coordinator.run(self._close_channels())
        self.coordinator.stop()

    async def _close_channels(self) -> None:
        for channel in self.channels:
            await channel.close()
