"""OpenAI-compatible request/response shapes, mapped onto specdec's GenerationRequest.

Extra body fields select the speculative setup per request: `policy` ({name, params}),
`num_draft_tokens`, `drafter` (a name or {name, params}). Responses carry OpenAI `usage` plus
a `speculative` object; each choice also carries its `token_ids`."""

from __future__ import annotations

import time
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

from specdec_core.request import Completion, ComponentSpec, GenerationRequest, Role, StreamChunk, TokenLogProbs
from specdec_core.sampling import MAX_TOP_LOGPROBS


class ChatMessage(BaseModel):
    role: Role
    content: Union[str, list[dict[str, Any]]] = Field(description="text, or a list of text parts")

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        if isinstance(content, list):
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
        return content

    def text(self) -> str:
        """Text parts are joined by newlines, as vLLM does."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content)


# OpenAI fields specdec does not implement, with the value that means "not used": a request
# that sets one to anything else gets a 400 naming it rather than a silently different answer.
UNSUPPORTED = {
    "logit_bias": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "tools": None,
    "tool_choice": None,
    "response_format": None,
    "best_of": 1,
    "echo": False,
    "suffix": None,
}


class SpeculativeFields(BaseModel):
    """OpenAI sampling fields plus specdec's per-request speculative setup."""

    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields (user, metadata, ...) are accepted

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: StrictBool = False
    n: StrictInt = Field(1, ge=1, le=1, description="one choice per request")
    policy: Optional[ComponentSpec] = None
    drafter: Optional[Union[str, ComponentSpec]] = None
    num_draft_tokens: Optional[int] = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, payload: Any) -> Any:
        if isinstance(payload, dict):
            for name, unused in UNSUPPORTED.items():
                if payload.get(name, unused) not in (unused, {}, []):
                    raise PydanticCustomError("unsupported", f"{name} is not supported by specdec", {"param": name})
        return payload

    def log_probs_asked(self) -> Optional[int]:
        """How many top log-probs per token the request asks for; None: no log-probs."""
        return None

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
                "logprobs": self.log_probs_asked(),
            },
            policy=self.policy,
            drafter=ComponentSpec(name=self.drafter) if isinstance(self.drafter, str) else self.drafter,
            num_draft_tokens=self.num_draft_tokens,
        )


class CompletionRequest(SpeculativeFields):
    prompt: Union[str, list[int]] = Field(description="text, or token ids (as OpenAI allows)")
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="top log-probs per token")

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    def log_probs_asked(self) -> Optional[int]:
        return self.logprobs

    def to_generation_request(self) -> GenerationRequest:
        if isinstance(self.prompt, list):
            return self.to_request(self.max_tokens, prompt_ids=self.prompt)
        return self.to_request(self.max_tokens, prompt=self.prompt)


class ChatCompletionRequest(SpeculativeFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("logprobs", "top_logprobs needs logprobs: true", {"param": "top_logprobs"})
        return self

    def log_probs_asked(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_generation_request(self) -> GenerationRequest:
        max_tokens = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        messages = [{"role": message.role, "content": message.text()} for message in self.messages]
        return self.to_request(max_tokens, messages=messages)


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


def chat_log_prob(entry) -> dict:
    return {"token": entry.token, "logprob": entry.log_prob, "bytes": list(entry.token.encode())}


class ResponseBuilder:
    """Builds OpenAI completion / chat.completion objects and their streaming chunks."""

    def __init__(self, chat: bool, model: str, request_id: str):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.text_offset = 0  # of the next token, for legacy completions' log-probs

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def _log_probs(self, log_probs: Optional[list[TokenLogProbs]]) -> Optional[dict]:
        """OpenAI's `logprobs` object: chat's `content` list, or the legacy completions columns."""
        if log_probs is None:
            return None
        if self.chat:
            return {
                "content": [
                    {**chat_log_prob(entry.chosen), "top_logprobs": [chat_log_prob(top) for top in entry.top]}
                    for entry in log_probs
                ]
            }
        offsets = []
        for entry in log_probs:
            offsets.append(self.text_offset)
            self.text_offset += len(entry.chosen.token)
        return {
            "tokens": [entry.chosen.token for entry in log_probs],
            "token_logprobs": [entry.chosen.log_prob for entry in log_probs],
            "top_logprobs": [{top.token: top.log_prob for top in entry.top} for entry in log_probs],
            "text_offset": offsets,
        }

    def _choice(self, text: str, token_ids: list[int], finish_reason, log_probs, streamed: bool) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "token_ids": token_ids}
        if self.chat and streamed:
            choice["delta"] = {"content": text}
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._log_probs(log_probs)
        return choice

    def full(self, chunks: list[StreamChunk]) -> dict:
        completion = Completion.from_chunks(chunks)
        choice = self._choice(
            completion.text, completion.token_ids, completion.finish_reason, completion.log_probs, streamed=False
        )
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage(completion.metrics)
        body["speculative"] = completion.metrics
        return body

    def chunk(self, chunk: StreamChunk) -> dict:
        choice = self._choice(chunk.text, chunk.token_ids, chunk.finish_reason, chunk.log_probs, streamed=True)
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if chunk.metrics is not None:
            body["usage"] = usage(chunk.metrics)
            body["speculative"] = chunk.metrics
        return body
