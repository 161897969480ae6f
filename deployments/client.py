"""Clients for a running specdec service: HTTP (OpenAI API + specdec fields) and gRPC
(`specdec.Specdec`), each sending the service's API key when it has one. Both give a whole
reply (`generate`) or its chunks as they arrive (`stream`), as dicts `{"token_ids", "text",
"speculative"}` (metrics on the last chunk)."""

from __future__ import annotations

import json
from typing import Iterator, Optional

import grpc
import httpx

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.api.request import GenerationRequest
from specdec_core.structured.constraint_spec import StructuredOutput

from .coordination.wire import component_to_proto, sampling_to_proto


def vllm_structured_outputs(spec: Optional[StructuredOutput]) -> Optional[dict]:
    """A StructuredOutput as vLLM's `structured_outputs` field (its `json` is our `json_schema`)."""
    if spec is None:
        return None
    fields = spec.model_dump(exclude_defaults=True)
    if "json_schema" in fields:
        fields["json"] = fields.pop("json_schema")
    return fields


class SpecdecHttpClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0, api_key: Optional[str] = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers)

    @staticmethod
    def route(request: GenerationRequest) -> tuple[str, dict]:
        """(path, body): chat requests go to /v1/chat/completions, the rest to /v1/completions."""
        body = {
            **request.sampling.model_dump(exclude={"logprobs", "prompt_logprobs", "structured_output"}),
            "structured_outputs": vllm_structured_outputs(request.sampling.structured_output),
            "policy": request.policy.model_dump() if request.policy else None,
            "drafter": request.drafter.model_dump() if request.drafter else None,
            "num_draft_tokens": request.num_draft_tokens,
            "run_ahead": request.run_ahead,
        }
        if request.messages is not None:
            return "/v1/chat/completions", {**body, "messages": request.messages, "tools": request.tools}
        return "/v1/completions", {
            **body,
            "prompt": request.prompt_ids if request.prompt_ids is not None else request.prompt,
        }

    def generate(self, request: GenerationRequest) -> dict:
        path, body = self.route(request)
        response = self.http.post(path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
        payload = response.json()
        choice = payload["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return {"token_ids": choice["token_ids"], "text": text, "speculative": payload["speculative"]}

    def stream(self, request: GenerationRequest) -> Iterator[dict]:
        path, body = self.route(request)
        with self.http.stream("POST", path, json={**body, "stream": True}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                choice = event["choices"][0]
                text = choice["delta"]["content"] if "delta" in choice else choice["text"]
                yield {"token_ids": choice["token_ids"], "text": text, "speculative": event.get("speculative")}


class SpecdecGrpcClient:
    def __init__(self, address: str, timeout_s: float = 600.0, api_key: Optional[str] = None):
        self.stub = pb_grpc.SpecdecStub(grpc.insecure_channel(address))
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    @staticmethod
    def message(request: GenerationRequest) -> pb.GenerateRequest:
        if request.tools is not None or any(set(message) - {"role", "content"} for message in request.messages or ()):
            raise ValueError("the gRPC API takes text messages (role, content): tools and tool calls go over HTTP")
        return pb.GenerateRequest(
            prompt=request.prompt or "",
            messages=[pb.ChatMessage(**message) for message in (request.messages or [])],
            sampling=sampling_to_proto(request.sampling),
            policy=component_to_proto(request.policy) if request.policy else None,
            drafter=component_to_proto(request.drafter) if request.drafter else None,
            num_draft_tokens=request.num_draft_tokens or 0,
            run_ahead=request.run_ahead,
        )

    @staticmethod
    def reply(chunk: pb.GenerateChunk) -> dict:
        metrics = json.loads(chunk.metrics_json) if chunk.metrics_json else None
        return {"token_ids": list(chunk.token_ids), "text": chunk.text, "speculative": metrics}

    def generate(self, request: GenerationRequest) -> dict:
        return self.reply(
            self.stub.GenerateUnary(self.message(request), timeout=self.timeout_s, metadata=self.metadata)
        )

    def stream(self, request: GenerationRequest) -> Iterator[dict]:
        for chunk in self.stub.Generate(self.message(request), timeout=self.timeout_s, metadata=self.metadata):
            yield self.reply(chunk)
