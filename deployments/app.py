"""The Ray Serve application.

  HTTP (OpenAI API) / gRPC (Specdec.Generate) --> SpecdecCoordinator deployment (no weights:
  tokenizer + speculative loop) --gRPC--> draft worker actor (draft model, PLD, MLA)
                                     \\--gRPC--> target worker actor (target model)

Workers are named Ray actors, each serving its gRPC service on its own port; coordinator
replicas share them. `build_app(args)` is the entry point for `serve run` YAMLs."""


import asyncio
import json
import logging
import os
from typing import Any, AsyncIterator, Iterator, Optional

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve

from protos import specdec_pb2 as pb
from specdec_core.engine import ComponentSpec, GenerationRequest, StreamChunk
from specdec_core.errors import SpecdecError, format_validation_errors

from .config import AppConfig
from .openai_api import ChatCompletionRequest, CompletionRequest, ResponseBuilder, error_body

logger = logging.getLogger(__name__)

WORKER_NAMESPACE = "specdec"

# Serve's proxy readiness/health checks default to 5-10 s; on a busy 2-core machine starting
# two model workers they time out and Serve kills a healthy proxy. Set before Ray starts.
SERVE_ENV_DEFAULTS = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


def apply_serve_env_defaults() -> None:
    for key, value in SERVE_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


@ray.remote
class WorkerActor:
    """Hosts one model behind a gRPC service ("draft": Drafter, "target": Target)."""

    def __init__(self, kind: str, config: dict):
        from protos import specdec_pb2_grpc as pb_grpc
        from specdec_core.models import configure_cpu, load_model

        from .workers import DraftServicer, TargetServicer, on_torch_thread, start_server

        app_config = AppConfig(**config)
        resources = app_config.draft_worker if kind == "draft" else app_config.target_worker
        on_torch_thread(configure_cpu, app_config.torch_threads or max(1, int(resources.num_cpus)))
        model_spec = app_config.draft if kind == "draft" else app_config.target
        model = on_torch_thread(load_model, model_spec) if model_spec else None
        if kind == "draft":
            servicer = DraftServicer(model, app_config.session_idle_timeout_s)
            add = pb_grpc.add_DrafterServicer_to_server
        else:
            servicer = TargetServicer(model, app_config.session_idle_timeout_s)
            add = pb_grpc.add_TargetServicer_to_server
        bind_host = "127.0.0.1" if app_config.host in ("127.0.0.1", "localhost") else "0.0.0.0"
        self.server, port = start_server(servicer, add, host=bind_host)
        node_ip = "127.0.0.1" if bind_host == "127.0.0.1" else ray.util.get_node_ip_address()
        self.address = f"{node_ip}:{port}"

    def get_address(self) -> str:
        return self.address


def worker(kind: str, config: AppConfig):
    resources = config.draft_worker if kind == "draft" else config.target_worker
    return WorkerActor.options(
        name=f"{config.model_name}-{kind}-worker",
        namespace=WORKER_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=resources.num_cpus,
        num_gpus=resources.num_gpus,
        max_restarts=-1,
    ).remote(kind, config.model_dump())


api = FastAPI(title="specdec", description="OpenAI-compatible speculative decoding")


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"] if part != "body") or None
    message = format_validation_errors(error.errors(), "body")
    return JSONResponse(status_code=400, content=error_body(message, param=param))


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class SpecdecCoordinator:
    """Validates requests, runs the speculative loop against the workers, streams results."""

    def __init__(self, config: dict):
        from ray.serve.metrics import Counter

        from specdec_core.engine import Frontend
        from specdec_core.models import configure_cpu, load_tokenizer, resolve_source

        from .coordinator import Coordinator

        from transformers import AutoConfig, GenerationConfig

        configure_cpu(1)  # verify is small; the cores belong to the workers
        self.config = AppConfig(**config)
        source = resolve_source(self.config.target.source)
        generation_config = GenerationConfig.from_pretrained(source) if os.path.exists(os.path.join(source, "generation_config.json")) else None
        frontend = Frontend(load_tokenizer(self.config.target), AutoConfig.from_pretrained(source), generation_config)
        draft_address = ray.get(worker("draft", self.config).get_address.remote())
        target_address = ray.get(worker("target", self.config).get_address.remote())
        self.coordinator = Coordinator(frontend, draft_address, target_address, self.config.rpc_deadline_s)
        tags = ("policy",)
        self.counters = {
            name: Counter(f"spec_decode_{name}", description=f"speculative decoding: {name}", tag_keys=tags)
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "draft_fallbacks")
        }

    # ------------------------------------------------------------------ shared plumbing

    def _record(self, request: GenerationRequest, metrics: dict) -> None:
        tags = {"policy": request.policy.name}
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if metrics[f"spec_decode_{name}"] > 0:  # Ray counters reject increments of 0
                self.counters[name].inc(metrics[f"spec_decode_{name}"], tags)
        if metrics.get("draft_fallback"):
            self.counters["draft_fallbacks"].inc(1, tags)
            self._reconnect_draft()

    def _reconnect_draft(self) -> None:
        """The draft actor restarts on failure (max_restarts=-1) on a new port: look it up again
        so later requests speculate again. If it is not back yet, the next fallback retries."""
        try:
            self.coordinator.connect_draft(ray.get(worker("draft", self.config).get_address.remote(), timeout=60))
        except (ray.exceptions.RayError, TimeoutError) as error:
            logger.warning("draft worker not reachable yet: %s", error)

    def _chunks(self, request: GenerationRequest) -> Iterator[StreamChunk]:
        for chunk in self.coordinator.stream(request):
            if chunk.metrics is not None:
                self._record(request, chunk.metrics)
            yield chunk

    async def _body(self, http_request: Request, model_cls) -> Any:
        raw = await http_request.body()
        if len(raw) > self.config.max_body_bytes:
            return JSONResponse(status_code=413, content=error_body(f"request body exceeds {self.config.max_body_bytes} bytes"))
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError as error:
            return JSONResponse(status_code=400, content=error_body(f"malformed JSON: {error}"))
        if not isinstance(payload, dict):
            return JSONResponse(status_code=400, content=error_body("request body must be a JSON object"))
        try:
            parsed = model_cls(**payload)
            if parsed.model is not None and parsed.model != self.config.model_name:
                return JSONResponse(status_code=404, content=error_body(f"model {parsed.model!r} not found; serving {self.config.model_name!r}", code="model_not_found"))
            request = parsed.to_generation_request(self.config)
            self.coordinator.validate(request)
        except ValidationError as error:
            message = format_validation_errors(error.errors(), "body")
            return JSONResponse(status_code=400, content=error_body(message))
        except (SpecdecError, ValueError) as error:
            return JSONResponse(status_code=400, content=error_body(str(error)))
        return parsed, request

    async def _respond(self, http_request: Request, model_cls, chat: bool):
        parsed_or_error = await self._body(http_request, model_cls)
        if isinstance(parsed_or_error, JSONResponse):
            return parsed_or_error
        parsed, request = parsed_or_error
        builder = ResponseBuilder(chat, self.config.model_name)
        if not parsed.stream:
            chunks = await asyncio.get_running_loop().run_in_executor(None, lambda: list(self._chunks(request)))
            return JSONResponse(builder.full(chunks))
        return StreamingResponse(self._sse(builder, request, http_request), media_type="text/event-stream")

    async def _sse(self, builder: ResponseBuilder, request: GenerationRequest, http_request: Request) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        chunks = self._chunks(request)
        try:
            while (chunk := await loop.run_in_executor(None, next, chunks, None)) is not None:
                yield f"data: {json.dumps(builder.chunk(chunk))}\n\n"
                if await http_request.is_disconnected():
                    return
            yield "data: [DONE]\n\n"
        finally:  # disconnect or cancellation: close the loop so both sessions are released
            await loop.run_in_executor(None, chunks.close)

    # ------------------------------------------------------------------ HTTP routes

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "sessions": self.coordinator.session_counts()}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model", "owned_by": "specdec"}]}

    @api.post("/v1/completions")
    async def completions(self, http_request: Request):
        return await self._respond(http_request, CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, http_request: Request):
        return await self._respond(http_request, ChatCompletionRequest, chat=True)

    # ------------------------------------------------------------------ gRPC (Serve gRPC ingress)

    def _grpc_request(self, message: pb.GenerateRequest) -> GenerationRequest:
        from .wire import sampling_from_proto

        fields: dict[str, Any] = {}
        if message.messages:
            fields["messages"] = [{"role": m.role, "content": m.content} for m in message.messages]
        else:
            fields["prompt"] = message.prompt
        sampling = sampling_from_proto(message.sampling) if message.HasField("sampling") else None
        policy = self.config.default_policy
        if message.policy.name:
            policy = ComponentSpec(name=message.policy.name, params=json.loads(message.policy.params_json or "{}"))
        elif sampling is not None and sampling.temperature > 0:
            policy = self.config.default_sampling_policy
        drafter = self.config.default_drafter
        if message.drafter.name:
            drafter = ComponentSpec(name=message.drafter.name, params=json.loads(message.drafter.params_json or "{}"))
        return GenerationRequest(
            **fields,
            **({"sampling": sampling} if sampling is not None else {}),
            policy=policy,
            drafter=drafter,
            num_draft_tokens=message.num_draft_tokens or self.config.default_num_draft_tokens,
        )

    def Generate(self, message: pb.GenerateRequest, grpc_context=None) -> Iterator[pb.GenerateChunk]:
        import grpc

        try:
            request = self._grpc_request(message)
            self.coordinator.validate(request)
        except (ValidationError, SpecdecError, ValueError) as error:
            grpc_context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            grpc_context.set_details(str(error))
            return
        for chunk in self._chunks(request):
            yield pb.GenerateChunk(
                token_ids=chunk.token_ids,
                text=chunk.text,
                finish_reason=chunk.finish_reason or "",
                metrics_json=json.dumps(chunk.metrics) if chunk.metrics is not None else "",
            )

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


def build_app(args: Optional[dict] = None):
    """Serve application builder (`import_path: deployments.app:build_app`)."""
    config = AppConfig(**(args or {}))
    return SpecdecCoordinator.options(
        num_replicas=config.coordinator_replicas, max_ongoing_requests=config.max_ongoing_requests
    ).bind(config.model_dump())
