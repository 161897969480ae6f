"""gRPC proxies with the session interface of specdec_core's drafter and target scorer, so the
coordinator runs `specdec_core.engine.speculative_loop` unchanged. A step costs one round trip
per worker: `commit` is held and sent with the next Propose / Score. Every call carries a
deadline. A failing draft worker does not fail the request: the drafter proxy falls back to
proposing nothing (target-only decoding) and counts the fallback."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import grpc
import torch

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.compact import expand_rows
from specdec_core.drafters.base import Drafter
from specdec_core.engine import ComponentSpec
from specdec_core.errors import SpecdecError
from specdec_core.policies import AcceptancePolicy
from specdec_core.sampling import SamplingParams
from specdec_core.types import DraftBlock, TargetBlock

from .wire import component_to_proto, sampling_to_proto, tensor_from_proto

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
DRAFTER_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)


def raise_user_errors(error: grpc.RpcError) -> None:
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        raise SpecdecError(error.details()) from None
    raise error


class RemoteTarget:
    """TargetScorer's session interface, served by a target worker."""

    def __init__(self, stub: pb_grpc.TargetStub, session_id: str, deadline_s: float):
        self.stub = stub
        self.session_id = session_id
        self.deadline_s = deadline_s
        self.bytes_received = 0
        self.full_rows_bytes = 0  # what full fp32 rows would have cost
        self.pending_keep = 0  # a commit not yet sent: it rides on the next Score

    def reset(self, prompt_ids: Sequence[int], policy: AcceptancePolicy, sampling: SamplingParams) -> None:
        request = pb.TargetReset(
            session_id=self.session_id,
            prompt_ids=list(prompt_ids),
            sampling=sampling_to_proto(sampling),
            policy=component_to_proto(ComponentSpec(name=policy.name, params=policy.params.model_dump())),
        )
        try:
            self.stub.Reset(request, timeout=self.deadline_s * 10)  # prefill of a long prompt
        except grpc.RpcError as error:
            raise_user_errors(error)

    def score(self, tokens: Sequence[int]) -> TargetBlock:
        request = pb.ScoreRequest(session_id=self.session_id, tokens=list(tokens), commit_keep=self.pending_keep)
        reply = self.stub.Score(request, timeout=self.deadline_s)
        self.pending_keep = 0
        self.bytes_received += reply.ByteSize()
        self.full_rows_bytes += len(tokens) * reply.vocab_size * 4
        if reply.HasField("logits"):
            logits = tensor_from_proto(reply.logits)
        else:
            logits = expand_rows(tensor_from_proto(reply.top_ids), tensor_from_proto(reply.top_log_probs), reply.vocab_size)
        features = {name: tensor_from_proto(tensor) for name, tensor in reply.features.items()}
        return TargetBlock(logits=logits, features=features)

    def commit(self, num_keep: int) -> None:
        self.pending_keep = num_keep

    def release(self) -> None:
        try:
            self.stub.Release(pb.SessionRef(session_id=self.session_id), timeout=self.deadline_s)
        except grpc.RpcError as error:
            logger.warning("releasing target session %s failed: %s", self.session_id, error)


class RemoteDrafter(Drafter):
    """A drafter session on a draft worker; falls back to no drafts if the worker fails."""

    name = "remote"

    def __init__(self, stub: pb_grpc.DrafterStub, session_id: str, spec: ComponentSpec, with_logits: bool, deadline_s: float):
        super().__init__()
        self.stub = stub
        self.session_id = session_id
        self.spec = spec
        self.with_logits = with_logits
        self.deadline_s = deadline_s
        self.failed: Optional[str] = None
        self.bytes_received = 0
        self.pending_tokens: list[int] = []  # committed, not yet sent: they ride on the next Propose

    def _fail(self, error: grpc.RpcError) -> None:
        if error.code() not in DRAFTER_FAILURES:
            raise error
        self.failed = f"{error.code().name}: {error.details()}"
        logger.warning("draft worker failed for %s (%s); continuing target-only", self.session_id, self.failed)

    def reset(self, prompt_ids, sampling, generator) -> None:
        request = pb.DraftReset(
            session_id=self.session_id,
            prompt_ids=list(prompt_ids),
            sampling=sampling_to_proto(sampling),
            drafter=component_to_proto(self.spec),
            with_logits=self.with_logits,
        )
        try:
            self.stub.Reset(request, timeout=self.deadline_s * 10)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise_user_errors(error)
            self._fail(error)

    def propose(self, max_tokens: int) -> DraftBlock:
        if self.failed or max_tokens <= 0:
            return DraftBlock.empty()
        request = pb.ProposeRequest(session_id=self.session_id, max_tokens=max_tokens, commit_tokens=self.pending_tokens)
        try:
            reply = self.stub.Propose(request, timeout=self.deadline_s)
        except grpc.RpcError as error:
            self._fail(error)
            return DraftBlock.empty()
        self.pending_tokens = []
        self.bytes_received += reply.ByteSize()
        logits = tensor_from_proto(reply.logits) if reply.HasField("logits") else None
        token_probs = torch.tensor(list(reply.token_probs)) if reply.token_probs else None
        return DraftBlock(torch.tensor(list(reply.tokens), dtype=torch.long), logits, token_probs)

    def commit(self, new_tokens: Sequence[int]) -> None:
        self.pending_tokens.extend(new_tokens)

    def release(self) -> None:
        if self.failed:
            return
        try:
            self.stub.Release(pb.SessionRef(session_id=self.session_id), timeout=self.deadline_s)
        except grpc.RpcError as error:
            logger.warning("releasing draft session %s failed: %s", self.session_id, error)


def metrics_with_wire(metrics: dict, target: RemoteTarget, drafter: RemoteDrafter) -> dict:
    steps = max(metrics.get("num_steps", 0), 1)
    return {
        **metrics,
        "wire_bytes_per_step": round((target.bytes_received + drafter.bytes_received) / steps, 1),
        "full_logits_bytes_per_step": round(target.full_rows_bytes / steps, 1),
        "draft_fallback": drafter.failed is not None,
    }
