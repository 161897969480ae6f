"""The client-facing gRPC API (`specdec.Specdec` in protos/specdec.proto), served through Ray
Serve's gRPC ingress, which calls a deployment's methods by RPC name: a deployment inherits
`GrpcIngress` and sets `self.engine` (a RemoteEngine).

Status codes mirror the HTTP ones: INVALID_ARGUMENT for bad input, UNAVAILABLE for a target
worker that is gone or late, INTERNAL with the request id (traceback logged) for a bug."""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

import grpc

from protos import specdec_pb2 as pb
from specdec_core.errors import SpecdecError
from specdec_core.request import ComponentSpec, GenerationRequest

from .errors import describe
from .wire import sampling_from_proto

STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}


def component_or_none(message: pb.Component) -> ComponentSpec | None:
    if not message.name:
        return None
    try:
        params = json.loads(message.params_json or "{}")
    except ValueError as error:
        raise SpecdecError(f"params_json of {message.name!r} is not JSON: {error}") from None
    return ComponentSpec(name=message.name, params=params)


def request_from_message(message: pb.GenerateRequest) -> GenerationRequest:
    """Unset parts of the speculative setup are left to the serving engine's defaults."""
    prompt: dict[str, Any] = (
        {"messages": [{"role": m.role, "content": m.content} for m in message.messages]}
        if message.messages
        else {"prompt": message.prompt}
    )
    return GenerationRequest(
        **prompt,
        **({"sampling": sampling_from_proto(message.sampling)} if message.HasField("sampling") else {}),
        policy=component_or_none(message.policy),
        drafter=component_or_none(message.drafter),
        num_draft_tokens=message.num_draft_tokens or None,
    )


class GrpcIngress:
    engine: Any

    def Generate(self, message: pb.GenerateRequest, grpc_context=None) -> Iterator[pb.GenerateChunk]:
        request_id = uuid.uuid4().hex
        try:
            chunks = self.engine.stream(request_from_message(message), request_id)
            for chunk in chunks:
                yield pb.GenerateChunk(
                    token_ids=chunk.token_ids,
                    text=chunk.text,
                    finish_reason=chunk.finish_reason or "",
                    metrics_json=json.dumps(chunk.metrics) if chunk.metrics is not None else "",
                )
        except Exception as error:  # noqa: BLE001 - mapped to a status by `describe` (bugs logged there)
            failure = describe(error, request_id)
            grpc_context.set_code(STATUS[failure.kind])
            grpc_context.set_details(failure.message)

    def GenerateUnary(self, message: pb.GenerateRequest, grpc_context=None) -> pb.GenerateChunk:
        chunks = list(self.Generate(message, grpc_context))
        if not chunks:
            return pb.GenerateChunk()
        return pb.GenerateChunk(
            token_ids=[token for chunk in chunks for token in chunk.token_ids],
            text="".join(chunk.text for chunk in chunks),
            finish_reason=chunks[-1].finish_reason,
            metrics_json=chunks[-1].metrics_json,
        )
