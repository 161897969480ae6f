"""The client-facing gRPC API (`specdec.Specdec` in protos/specdec.proto). Each server replica
serves it itself, bound to the configured host: Ray Serve's own gRPC proxy (Ray 2.60,
`serve/_private/grpc_util.py: start_grpc_server`) always listens on `[::]`, every interface,
whatever the config says. Replicas on one node share the port (SO_REUSEPORT, the kernel spreads
connections); beyond `max_ongoing_requests` streams a replica answers RESOURCE_EXHAUSTED. It is
a grpc.aio server on the engine's coordinator loop, so a stream holds no thread.

Status codes mirror the HTTP ones: INVALID_ARGUMENT for bad input, UNAUTHENTICATED without the
API key, UNAVAILABLE for a target worker that is gone or late, INTERNAL with the request id
(traceback logged, never sent) for a bug. Every reply carries `x-request-id` metadata."""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any, AsyncIterator, Optional

import grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.api.errors import SpecdecError
from specdec_core.api.request import ComponentSpec, GenerationRequest, LogProb, StreamChunk, TokenLogProbs

from ..config import AppConfig
from ..coordination.wire import sampling_from_proto
from .auth import bearer_matches, metadata_value
from .error_replies import describe

STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "internal": grpc.StatusCode.INTERNAL,
}


def component_or_none(message: pb.Component) -> Optional[ComponentSpec]:
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
        run_ahead=message.run_ahead if message.HasField("run_ahead") else None,
    )


def log_prob_message(entry: LogProb) -> pb.LogProb:
    return pb.LogProb(token_id=entry.token_id, token=entry.token, log_prob=entry.log_prob)


def token_log_probs_message(entry: TokenLogProbs) -> pb.TokenLogProbs:
    return pb.TokenLogProbs(chosen=log_prob_message(entry.chosen), top=[log_prob_message(top) for top in entry.top])


def chunk_message(chunk: StreamChunk) -> pb.GenerateChunk:
    message = pb.GenerateChunk(
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=chunk.finish_reason or "",
        metrics_json=json.dumps(chunk.metrics) if chunk.metrics is not None else "",
        log_probs=[token_log_probs_message(entry) for entry in chunk.log_probs or ()],
        prompt_log_probs=[token_log_probs_message(entry) for entry in chunk.prompt_log_probs or ()],
        prompt_tokens=chunk.prompt_tokens,
    )
    if isinstance(chunk.stop_reason, int):
        message.stop_token_id = chunk.stop_reason
    elif isinstance(chunk.stop_reason, str):
        message.stop_string = chunk.stop_reason
    return message


class SpecdecGrpcService(pb_grpc.SpecdecServicer):
    def __init__(self, engine: Any, api_key: Optional[str] = None):
        self.engine = engine  # a RemoteEngine
        self.api_key = api_key

    async def Generate(
        self, message: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        request_id = uuid.uuid4().hex
        await context.send_initial_metadata((("x-request-id", request_id),))
        authorization = metadata_value(context.invocation_metadata(), "authorization")
        if self.api_key and not bearer_matches(authorization, self.api_key):
            self.engine.metrics.failed("grpc", grpc.StatusCode.UNAUTHENTICATED.name)
            message = "invalid or missing API key (authorization: Bearer ...)"
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        try:
            # closed here when the client leaves, not when collected: closing releases its sessions
            async with contextlib.aclosing(await self.engine.open(request_from_message(message), request_id)) as chunks:
                async for chunk in chunks:
                    yield chunk_message(chunk)
        except Exception as error:  # noqa: BLE001 - mapped to a status by `describe` (bugs logged there)
            failure = describe(error, request_id)
            self.engine.metrics.failed("grpc", STATUS[failure.kind].name)
            await context.abort(STATUS[failure.kind], failure.message)

    async def GenerateUnary(self, message: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateChunk:
        reply, text = pb.GenerateChunk(), ""
        async for chunk in self.Generate(message, context):
            text += chunk.text
            reply.MergeFrom(chunk)  # lists grow; the fields a chunk sets (the last one's finish) win
        reply.text = text
        return reply


class GrpcIngress:
    """The gRPC API on config.host:config.grpc_port (0: a free port, see `port`), up to
    `max_ongoing_requests` streams, served on the engine's coordinator loop."""

    def __init__(self, engine: Any, config: AppConfig):
        self.coordinator = engine.coordinator
        self.server, self.port = self.coordinator.run(self._start(engine, config))

    @staticmethod
    async def _start(engine: Any, config: AppConfig) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(
            maximum_concurrent_rpcs=config.max_ongoing_requests, options=[("grpc.so_reuseport", 1)]
        )
        pb_grpc.add_SpecdecServicer_to_server(SpecdecGrpcService(engine, config.api_key), server)
        port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
        await server.start()
        return server, port

    def stop(self) -> None:
        self.coordinator.run(self.server.stop(None))
