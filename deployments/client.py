"""Clients for a running specdec service: HTTP (OpenAI API + specdec fields) and gRPC
(Serve's gRPC ingress, `specdec.Specdec/Generate`)."""

from __future__ import annotations

import json
from typing import Iterator, Optional

import grpc
import httpx

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.engine import GenerationRequest

from .wire import component_to_proto, sampling_to_proto


class SpecdecHttpClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s)

    def generate(self, request: GenerationRequest) -> dict:
        """Run a GenerationRequest through /v1/completions; returns token_ids, text, speculative."""
        sampling = request.sampling
        body = {
            "prompt": request.prompt_ids if request.prompt_ids is not None else request.prompt,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "stop": sampling.stop,
            "seed": sampling.seed,
            "policy": request.policy.model_dump(),
            "drafter": request.drafter.model_dump(),
            "num_draft_tokens": request.num_draft_tokens,
        }
        if request.messages is not None:
            body.pop("prompt")
            response = self.http.post("/v1/chat/completions", json={**body, "messages": request.messages})
        else:
            response = self.http.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
        payload = response.json()
        choice = payload["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return {"token_ids": choice["token_ids"], "text": text, "speculative": payload["speculative"]}


class SpecdecGrpcClient:
    def __init__(self, address: str, timeout_s: float = 600.0, application: Optional[str] = None):
        self.stub = pb_grpc.SpecdecStub(grpc.insecure_channel(address))
        self.timeout_s = timeout_s
        self.metadata = (("application", application),) if application else ()

    def message(self, request: GenerationRequest) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            prompt=request.prompt or "",
            messages=[pb.ChatMessage(**message) for message in (request.messages or [])],
            sampling=sampling_to_proto(request.sampling),
            policy=component_to_proto(request.policy),
            drafter=component_to_proto(request.drafter),
            num_draft_tokens=request.num_draft_tokens,
        )

    def stream(self, request: GenerationRequest) -> Iterator[pb.GenerateChunk]:
        yield from self.stub.Generate(self.message(request), timeout=self.timeout_s, metadata=self.metadata)

    def generate(self, request: GenerationRequest) -> dict:
        reply = self.stub.GenerateUnary(self.message(request), timeout=self.timeout_s, metadata=self.metadata)
        return {"token_ids": list(reply.token_ids), "text": reply.text, "speculative": json.loads(reply.metrics_json or "{}")}
