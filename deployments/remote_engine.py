"""The served engine: validates a request (specdec_core's Frontend), opens a session on the
draft worker and on the target worker, and runs specdec_core's speculative loop against them
over gRPC. It holds no model weights (only the tokenizer and the target's config) and knows
nothing of Ray: the server points it at workers with `connect` and gives it a `MetricsSink`."""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol

import grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.engine import speculative_loop
from specdec_core.frontend import Frontend, PreparedRequest
from specdec_core.profile import TargetProfile
from specdec_core.request import GenerationRequest, StreamChunk

from .auth import SendSecret
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
        self.frontend = copy.copy(frontend)  # its profile is the target worker's, asked of it
        self.deadline_s = deadline_s
        self.metrics = metrics or NoMetrics()  # told of each finished request; the ingresses tell it of failures
        self.secret = secret  # the workers' shared secret, sent with every call
        self.stubs: dict[str, object] = {}
        for role, address in addresses.items():
            self.connect(role, address)
        self.profiles: dict[object, Optional[TargetProfile]] = {}  # per target stub: a worker's own
        self.frontend.profile = self.target_profile

    def target_profile(self) -> Optional[TargetProfile]:
        """The target worker's profile, asked of it once per connection (first need only)."""
        stub = self.stubs["target"]
        if stub not in self.profiles:
            try:
                reply = stub.Profile(pb.Empty(), timeout=self.deadline_s)
            except grpc.RpcError as error:
                raise classify(error, "target") from None
            self.profiles = {
                stub: TargetProfile.model_validate_json(reply.profile_json) if reply.profile_json else None
            }
        return self.profiles[stub]

    def connect(self, role: str, address: str) -> None:
        """Send the next requests of `role` ("draft" or "target") to the worker at `address`;
        requests in flight keep the channel they started on."""
        channel = grpc.insecure_channel(address, options=MESSAGE_LIMITS)
        if self.secret:
            channel = grpc.intercept_channel(channel, SendSecret(self.secret))
        self.stubs[role] = STUBS[role](channel)

    def stream(self, request: GenerationRequest, request_id: Optional[str] = None) -> Iterator[StreamChunk]:
        """Validates `request` now (SpecdecError), then decodes it as the iterator is consumed;
        `request_id` names its worker sessions."""
        arrival = time.perf_counter()
        prepared = self.frontend.prepare(request)
        return self._decode(prepared, request_id or uuid.uuid4().hex, arrival)

    def _decode(self, request: PreparedRequest, session_id: str, arrival: float) -> Iterator[StreamChunk]:
        target = RemoteTarget(self.stubs["target"], session_id, self.deadline_s)
        drafter = RemoteDrafter(
            self.stubs["draft"], session_id, request.drafter, request.policy.needs_draft_logits(), self.deadline_s
        )
        timings, last_chunk_at = RequestTimings(), arrival
        try:
            for chunk in speculative_loop(request, drafter, target, self.frontend.output(request.sampling)):
                now = time.perf_counter()
                if chunk.token_ids:
                    if timings.time_to_first_token_s is None:
                        timings.time_to_first_token_s = now - arrival
                    else:
                        timings.inter_token_latencies_s.append(now - last_chunk_at)
                    last_chunk_at = now
                if chunk.metrics is not None:
                    steps = max(chunk.metrics["num_steps"], 1)
                    chunk.metrics.update(
                        wire_bytes_per_step=round((target.bytes_received + drafter.bytes_received) / steps, 1),
                        full_logits_bytes_per_step=round(target.full_rows_bytes / steps, 1),
                        draft_fallback=drafter.failed is not None,
                    )
                    timings.latency_s = now - arrival
                    self.metrics.finished(request, chunk.metrics, timings)
                yield chunk
        finally:  # also on client disconnect (GeneratorExit): free both sessions
            target.release()
            drafter.release()

    def session_counts(self) -> dict[str, Optional[int]]:
        """Open sessions per worker; None for a worker that does not answer."""
        counts: dict[str, Optional[int]] = {}
        for role, stub in self.stubs.items():
            try:
                counts[role] = stub.Stats(pb.Empty(), timeout=self.deadline_s).sessions
            except grpc.RpcError:
                counts[role] = None
        return counts
