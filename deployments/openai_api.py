"""OpenAI-compatible request/response shapes, mapped onto specdec's GenerationRequest.

Extra body fields select the speculative setup per request: `policy` ({name, params}),
`num_draft_tokens`, `drafter` (a name or {name, params}). Responses carry OpenAI `usage` plus
a `speculative` object; each choice also carries its `token_ids`."""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from specdec_core.request import Completion, ComponentSpec, GenerationRequest, StreamChunk


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


class SpeculativeFields(BaseModel):
    """OpenAI sampling fields plus specdec's per-request speculative setup."""

    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields (user, n=1, ...) are accepted

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    policy: Optional[ComponentSpec] = None
    drafter: Optional[Union[str, ComponentSpec]] = None
    num_draft_tokens: Optional[int] = Field(None, ge=1)

    def to_request(self, max_tokens: Optional[int], **prompt: Any) -> GenerationRequest:
        """What the speculative setup leaves out, the serving engine's defaults fill in."""
        return GenerationRequest(
            **prompt,
            sampling={
                "temperature": self.temperature,
                "top_p": self.top_p,
                "top_k": self.top_k,
                "max_tokens": max_tokens or 16,
                "stop": [self.stop] if isinstance(self.stop, str) else (self.stop or []),
                "seed": self.seed or 0,
            },
            policy=self.policy,
            drafter=ComponentSpec(name=self.drafter) if isinstance(self.drafter, str) else self.drafter,
            num_draft_tokens=self.num_draft_tokens,
        )


class CompletionRequest(SpeculativeFields):
    prompt: Union[str, list[int]] = Field(description="text, or token ids (as OpenAI allows)")

    def to_generation_request(self) -> GenerationRequest:
        if isinstance(self.prompt, list):
            return self.to_request(self.max_tokens, prompt_ids=self.prompt)
        return self.to_request(self.max_tokens, prompt=self.prompt)


class ChatCompletionRequest(SpeculativeFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)

    def to_generation_request(self) -> GenerationRequest:
        max_tokens = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        return self.to_request(max_tokens, messages=[message.model_dump() for message in self.messages])


def error_body(
    message: str, error_type: str = "invalid_request_error", param: Optional[str] = None, code: Optional[str] = None
) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def usage(metrics: dict) -> dict:
    return {
        "prompt_tokens": metrics["prompt_tokens"],
        "completion_tokens": metrics["completion_tokens"],
        "total_tokens": metrics["prompt_tokens"] + metrics["completion_tokens"],
    }


class ResponseBuilder:
    """Builds OpenAI completion / chat.completion objects and their streaming chunks."""

    def __init__(self, chat: bool, model: str, request_id: str):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def full(self, chunks: list[StreamChunk]) -> dict:
        completion = Completion.from_chunks(chunks)
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": completion.finish_reason,
            "token_ids": completion.token_ids,
        }
        if self.chat:
            choice["message"] = {"role": "assistant", "content": completion.text}
        else:
            choice.update(text=completion.text, logprobs=None)
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage(completion.metrics)
        body["speculative"] = completion.metrics
        return body

    def chunk(self, chunk: StreamChunk) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": chunk.finish_reason, "token_ids": chunk.token_ids}
        if self.chat:
            choice["delta"] = {"content": chunk.text}
        else:
            choice.update(text=chunk.text, logprobs=None)
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if chunk.metrics is not None:
            body["usage"] = usage(chunk.metrics)
            body["speculative"] = chunk.metrics
        return body
