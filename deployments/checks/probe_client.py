"""The probe's client of the service: one request (HTTP, streamed or not, or gRPC) sent under the
probe's deadline and read to its end, as an Outcome that says whether and how it failed; and the
sessions the workers hold, from /health."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Optional

import grpc
import httpx

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc

from ..workers.worker import ROLES

# a request during a draft worker's outage may take target-only + this (`specdec probe --draft-slack`)
DRAFT_SLACK_S = 1.0


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
    text: str = ""  # the output, a stream's deltas joined

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


async def first_event_or_end(first_event: asyncio.Event, streams: list[asyncio.Task], timeout_s: float) -> None:
    """Until `first_event` (a stream's first event) or every one of `streams` has ended (a refused
    stream never has one), at most `timeout_s`."""
    waiter = asyncio.ensure_future(first_event.wait())
    await asyncio.wait([waiter, asyncio.gather(*streams)], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()


class ProbeClient:
    """The probe's connections to the service: an HTTP client without a connection limit (the
    suite opens many streams at once) and the gRPC address, both with the API key; and how slow
    a request may be (`timeout_s`: hung; `draft_slack_s`: more than target-only during a draft
    outage)."""

    def __init__(
        self,
        endpoint: str,
        grpc_address: Optional[str],
        api_key: Optional[str],
        timeout_s: float,
        draft_slack_s: float = DRAFT_SLACK_S,
    ):
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=endpoint.rstrip("/"),
            timeout=timeout_s,
            headers=self.headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self.grpc_address = grpc_address
        self.timeout_s, self.draft_slack_s = timeout_s, draft_slack_s
        self.model = ""  # the served model, named in every body (Probe.run asks /v1/models)

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
                    choice = payload["choices"][0]
                    outcome.finish_reason = choice["finish_reason"]
                    outcome.text = choice.get("text") or choice.get("message", {}).get("content") or ""
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
                choice = event["choices"][0]
                outcome.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
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

    def start_streams(
        self, count: int, path: str, first_event: Optional[asyncio.Event] = None, hang_up: bool = False, **fields
    ) -> list[asyncio.Task]:
        """`count` streams of distinct prompts, running."""
        return [
            asyncio.create_task(self.call(path, self.body(path, index, stream=True, **fields), first_event, hang_up))
            for index in range(count)
        ]

    def grpc_generate(self, message: pb.GenerateRequest) -> tuple[str, str]:
        """One blocking GenerateUnary call: the name of its status code and its details."""
        metadata = tuple((key.lower(), value) for key, value in self.headers.items())
        with grpc.insecure_channel(self.grpc_address) as channel:
            try:
                pb_grpc.SpecdecStub(channel).GenerateUnary(message, timeout=self.timeout_s, metadata=metadata)
            except grpc.RpcError as error:
                return error.code().name, error.details() or ""
        return "OK", ""
