"""The OpenAI-compatible HTTP API: a FastAPI app over an engine with `open(request,
request_id)`, `count_sessions()` and `metrics` (RemoteEngine), all awaited: no request holds a
thread. The Serve deployment builds it per replica
(server.py); tests build it over in-process workers.

Status codes: bad input 400 (404 unknown model, 413 oversized body); a target worker that is
gone or late 503 with Retry-After; anything else is a bug: 500 with the request id, whose
traceback is logged. A stream that fails after its first chunk ends with an SSE event carrying
the same error object, then `[DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from specdec_core.api.request import Completion, StreamChunk

from ..config import AppConfig
from .auth import bearer_matches
from .error_replies import WorkerUnavailable, describe
from .openai_api import ChatCompletionRequest, CompletionRequest
from .openai_responses import ResponseBuilder, error_body
from .remote_engine import MetricsSink
from .tokenize_api import DetokenizeRequest, TokenizeRequest
from .tool_calls import auto_tool_parser

RETRY_AFTER_S = 5
GUARDED_PATHS = ("/v1", "/tokenize", "/detokenize")  # what the API key guards (not /health)


def failure(error: Exception, request_id: str) -> tuple[int, dict, dict]:
    """(status, body, headers) for an error raised while serving `request_id`."""
    described = describe(error, request_id)
    if described.kind == "invalid":
        return 400, error_body(described.message, param=described.param), {}
    if described.kind in ("unavailable", "overloaded"):
        code = "worker_unavailable" if described.kind == "unavailable" else "overloaded"
        return 503, error_body(described.message, "server_error", code=code), {"Retry-After": str(RETRY_AFTER_S)}
    return 500, error_body(described.message, "server_error", code="internal_error"), {}


def error_response(error: Exception, request_id: str) -> JSONResponse:
    status, body, headers = failure(error, request_id)
    return JSONResponse(status_code=status, content=body, headers=headers)


def client_request_id(header: Optional[str]) -> Optional[str]:
    """A client's own x-request-id, if it is a plain token (it names worker sessions and logs)."""
    if header and len(header) <= 64 and all(char.isalnum() or char in "-_." for char in header):
        return header
    return None


def build_http_app(engine: Any, config: AppConfig) -> FastAPI:
    api = FastAPI(title="specdec", description="OpenAI-compatible speculative decoding")

    @api.middleware("http")
    async def authenticate_and_tag(http_request: Request, call_next):
        """Every /v1 call (and tokenization) needs the API key when one is configured (/health
        stays open for probes); every response carries its request id."""
        request_id = client_request_id(http_request.headers.get("x-request-id")) or uuid.uuid4().hex
        http_request.state.request_id = request_id
        if (
            config.api_key
            and http_request.url.path.startswith(GUARDED_PATHS)
            and not bearer_matches(http_request.headers.get("authorization"), config.api_key)
        ):
            body = error_body("invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
            response = JSONResponse(status_code=401, content=body)
        else:
            response = await call_next(http_request)
        response.headers["x-request-id"] = request_id
        if response.status_code >= 400 and http_request.url.path.startswith(GUARDED_PATHS):
            engine.metrics.failed("http", str(response.status_code))
        return response

    async def parse(
        http_request: Request, model_cls: type[BaseModel], request_id: str
    ) -> Union[BaseModel, JSONResponse]:
        raw = await http_request.body()
        if len(raw) > config.max_body_bytes:
            return JSONResponse(
                status_code=413, content=error_body(f"request body exceeds {config.max_body_bytes} bytes")
            )
        try:
            payload = json.loads(raw)
        except (ValueError, RecursionError) as error:  # bad JSON or UTF-8, or nesting past Python's limit
            return JSONResponse(status_code=400, content=error_body(f"malformed JSON: {error}"))
        if not isinstance(payload, dict):
            return JSONResponse(status_code=400, content=error_body("request body must be a JSON object"))
        try:
            parsed = model_cls(**payload)
        except ValidationError as error:
            return error_response(error, request_id)
        if parsed.model is not None and parsed.model != config.model_name:
            message = f"model {parsed.model!r} not found; serving {config.model_name!r}"
            return JSONResponse(status_code=404, content=error_body(message, code="model_not_found"))
        return parsed

    async def respond(http_request: Request, model_cls: type[BaseModel], chat: bool):
        request_id = http_request.state.request_id
        parsed = await parse(http_request, model_cls, request_id)
        if isinstance(parsed, JSONResponse):
            return parsed
        try:  # every prompt is validated in `open` before any decodes; a streamed request's first
            # chunk carries a prefill: a failure there keeps its status
            tool_parser = auto_tool_parser(parsed, engine.frontend) if chat else None
            requests = parsed.to_generation_requests()
            ids = [request_id] if len(requests) == 1 else [f"{request_id}-{index}" for index in range(len(requests))]
            streams = [await engine.open(request, session_id) for request, session_id in zip(requests, ids)]
            streams = prefilled_once(streams, parsed.n)
            builder = ResponseBuilder(
                parsed, parsed.echoes(engine.frontend.decode), chat, config.model_name, request_id, tool_parser
            )
            chunks = merged(streams, config.max_ongoing_requests)
            if not parsed.stream:
                return JSONResponse(builder.full(await collect_completions(chunks, len(requests))))
            first = await anext(chunks, None)
        except Exception as error:  # noqa: BLE001 - mapped to 400 / 503 / 500 (logged) by `failure`
            return error_response(error, request_id)
        events = server_sent_events(builder, first, chunks, http_request, request_id, engine.metrics)
        return StreamingResponse(events, media_type="text/event-stream")

    @api.get("/health")
    async def health():
        """503 while no target worker answers, or while this replica drains (drain.py); "degraded"
        without a draft worker, whose absence only means target-only decoding."""
        sessions = await engine.count_sessions()
        down = sorted(role for role, count in sessions.items() if count is None)
        body = {"status": "degraded" if down else "ok", "down": down, "sessions": sessions}
        if "target" in down or engine.drain.draining:
            status = "draining" if engine.drain.draining else "unavailable"
            return JSONResponse(status_code=503, content={**body, "status": status})
        return body

    @api.get("/v1/models")
    async def models(http_request: Request):
        """The model is listed once a target worker answers, as /health says (vLLM lists it once
        it is loaded): clients check this before their first request."""
        if (await engine.count_sessions(("target",)))["target"] is None:
            starting = WorkerUnavailable("no target worker is ready yet")
            return error_response(starting, http_request.state.request_id)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "owned_by": "specdec"}]}

    async def answer(http_request: Request, model_cls: type[BaseModel]):
        """A request the front end answers alone (no worker): /tokenize, /detokenize."""
        parsed = await parse(http_request, model_cls, http_request.state.request_id)
        if isinstance(parsed, JSONResponse):
            return parsed
        try:
            return parsed.reply(engine.frontend)
        except Exception as error:  # noqa: BLE001 - mapped to 400 / 500 (logged) by `failure`
            return error_response(error, http_request.state.request_id)

    @api.post("/tokenize")
    async def tokenize(http_request: Request):
        return await answer(http_request, TokenizeRequest)

    @api.post("/detokenize")
    async def detokenize(http_request: Request):
        return await answer(http_request, DetokenizeRequest)

    @api.post("/v1/completions")
    async def completions(http_request: Request):
        return await respond(http_request, CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(http_request: Request):
        return await respond(http_request, ChatCompletionRequest, chat=True)

    return api


async def merged(streams: list[AsyncIterator[StreamChunk]], limit: int) -> AsyncIterator[tuple[int, StreamChunk]]:
    """(index, chunk) from every stream as they come. At most `limit` streams decode at once (a
    prompt batch holds no more worker sessions than that many requests), each at most a chunk
    ahead of the reader (a slow client slows its own decoding); the first failure ends it, and
    closing it stops every stream (their sessions are released)."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    decoding = asyncio.Semaphore(limit)

    async def pump(index: int, stream: AsyncIterator[StreamChunk]) -> None:
        # aclosing: a task cancelled while it waits on the queue leaves its stream suspended at a
        # yield, and only an explicit close (not the garbage collector, some time later) releases
        # the sessions the stream holds
        async with decoding, contextlib.aclosing(stream):  # a stream opens its sessions at its first step
            try:
                async for chunk in stream:
                    await queue.put((index, chunk, None))
            except Exception as error:  # noqa: BLE001 - raised to the consumer below
                await queue.put((index, None, error))
            else:
                await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
            else:
                yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def prefilled_once(streams: list[AsyncIterator[StreamChunk]], n: int) -> list[AsyncIterator[StreamChunk]]:
    """Each prompt's `n` choices (consecutive in `streams`): the first runs at once, the others
    once it has sent a chunk, when its prompt is in the target's prefix cache, so theirs is a
    cache hit rather than n prefills. (`merged` starts streams in order, so a first choice never
    waits behind its own siblings.)"""
    if n == 1:
        return streams
    gated = []
    for first in range(0, len(streams), n):
        prefilled = asyncio.Event()
        gated.append(signalling(streams[first], prefilled))
        gated.extend(waiting(stream, prefilled) for stream in streams[first + 1 : first + n])
    return gated


async def signalling(stream: AsyncIterator[StreamChunk], prefilled: asyncio.Event) -> AsyncIterator[StreamChunk]:
    try:
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                prefilled.set()
                yield chunk
    finally:  # failed or closed before a chunk: its siblings go on without the cache
        prefilled.set()


async def waiting(stream: AsyncIterator[StreamChunk], prefilled: asyncio.Event) -> AsyncIterator[StreamChunk]:
    async with contextlib.aclosing(stream):
        await prefilled.wait()
        async for chunk in stream:
            yield chunk


async def collect_completions(chunks: AsyncIterator[tuple[int, StreamChunk]], count: int) -> list[Completion]:
    """The whole completion of each of `count` streams, in order."""
    by_index: list[list[StreamChunk]] = [[] for _ in range(count)]
    async with contextlib.aclosing(chunks):
        async for index, chunk in chunks:
            by_index[index].append(chunk)
    return [Completion.from_chunks(chunks_of_one) for chunks_of_one in by_index]


async def server_sent_events(
    builder: ResponseBuilder,
    first: Optional[tuple[int, StreamChunk]],
    chunks: AsyncIterator[tuple[int, StreamChunk]],
    http_request: Request,
    request_id: str,
    metrics: MetricsSink,
) -> AsyncIterator[str]:
    item = first
    try:
        while item is not None:
            yield f"data: {json.dumps(builder.chunk(*item))}\n\n"
            if await http_request.is_disconnected():
                return
            item = await anext(chunks, None)
        if (usage_chunk := builder.usage_chunk()) is not None:
            yield f"data: {json.dumps(usage_chunk)}\n\n"
        yield "data: [DONE]\n\n"
    except Exception as error:  # noqa: BLE001 - reported to the client as an error event (and logged)
        status, body, _ = failure(error, request_id)
        metrics.failed("http", str(status))  # after a 200: the middleware did not see it
        yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # disconnect or cancellation: close the streams so their sessions are released
        await chunks.aclose()
