"""The verifier coordinator: validates a request, opens a session on the draft worker and on
the target worker, and runs specdec_core's speculative loop against them over gRPC. It holds
no model weights (only the tokenizer and the target's config)."""

from __future__ import annotations

import uuid
from typing import Iterator, Optional

import grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.engine import Frontend, GenerationRequest, StreamChunk, speculative_loop

from .remote import CHANNEL_OPTIONS, RemoteDrafter, RemoteTarget, metrics_with_wire


class Coordinator:
    def __init__(self, frontend: Frontend, draft_address: str, target_address: str, deadline_s: float = 30.0):
        self.frontend = frontend
        self.deadline_s = deadline_s
        self.connect_draft(draft_address)
        self.target_stub = pb_grpc.TargetStub(grpc.insecure_channel(target_address, options=CHANNEL_OPTIONS))

    def connect_draft(self, draft_address: str) -> None:
        """(Re)connect to a draft worker, e.g. after it was restarted on a new port."""
        self.draft_stub = pb_grpc.DrafterStub(grpc.insecure_channel(draft_address, options=CHANNEL_OPTIONS))

    def validate(self, request: GenerationRequest) -> None:
        """Raise SpecdecError for a bad request before any session is opened."""
        self.frontend.validate(request)

    def stream(self, request: GenerationRequest, request_id: Optional[str] = None) -> Iterator[StreamChunk]:
        prompt_ids, policy = self.frontend.validate(request)
        session_id = request_id or uuid.uuid4().hex
        target = RemoteTarget(self.target_stub, session_id, self.deadline_s)
        drafter = RemoteDrafter(self.draft_stub, session_id, request.drafter, policy.needs_draft_logits(), self.deadline_s)
        try:
            loop = speculative_loop(
                prompt_ids, policy, drafter, target, request.num_draft_tokens, self.frontend.output(request)
            )
            for chunk in loop:
                if chunk.metrics is not None:
                    chunk.metrics = metrics_with_wire(chunk.metrics, target, drafter)
                yield chunk
        finally:  # also on client disconnect (GeneratorExit): free both sessions
            target.release()
            drafter.release()

    def session_counts(self) -> dict[str, int]:
        return {
            "draft": self.draft_stub.Stats(pb.Empty(), timeout=self.deadline_s).sessions,
            "target": self.target_stub.Stats(pb.Empty(), timeout=self.deadline_s).sessions,
        }
