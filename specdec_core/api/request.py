"""What a caller sends and gets back: the request, its speculative setup and defaults, and the
streamed chunks and completion. No tensors and no weights here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .sampling import SamplingParams

MAX_DRAFT_TOKENS = 64


def session_positions(num_prompt: int, max_tokens: int, num_draft_tokens: int = MAX_DRAFT_TOKENS) -> int:
    """The positions a session's caches can hold at most: its prompt, its tokens and one block
    of drafts scored after them. The frontend checks it against the context with the request's
    K; a worker, which is not told K, reserves KV memory for it with the largest block."""
    return num_prompt + max_tokens + num_draft_tokens


Role = Literal["system", "user", "assistant", "developer", "tool"]


class ComponentSpec(BaseModel):
    """A policy or drafter chosen by registry name, with its parameters."""

    model_config = ConfigDict(extra="forbid")
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class RequestDefaults(BaseModel):
    """What a request gets for each part of its speculative setup that it leaves out."""

    model_config = ConfigDict(extra="forbid")

    policy: ComponentSpec = Field(default_factory=lambda: ComponentSpec(name="greedy"), description="at temperature 0")
    sampling_policy: ComponentSpec = Field(
        default_factory=lambda: ComponentSpec(name="rejection"), description="at temperature > 0"
    )
    drafter: ComponentSpec = Field(default_factory=lambda: ComponentSpec(name="pld"))
    num_draft_tokens: int = Field(8, ge=1, le=MAX_DRAFT_TOKENS)
    run_ahead: bool = Field(
        False, description="a draft model drafts the next block while the target verifies (run_ahead.py)"
    )

    def policy_for(self, sampling: SamplingParams) -> ComponentSpec:
        return self.policy if sampling.greedy else self.sampling_policy


class GenerationRequest(BaseModel):
    """One request: exactly one of prompt / messages / prompt_ids, the sampling settings, and the
    speculative setup (each part None: the serving engine's `RequestDefaults`)."""

    model_config = ConfigDict(extra="forbid")

    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    tools: Optional[list[dict[str, Any]]] = Field(None, description="functions the chat template shows (with messages)")
    prompt_ids: Optional[list[int]] = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    policy: Optional[ComponentSpec] = None
    drafter: Optional[ComponentSpec] = None
    num_draft_tokens: Optional[int] = Field(None, ge=1, le=MAX_DRAFT_TOKENS)
    run_ahead: Optional[bool] = None

    @field_validator("messages")
    @classmethod
    def _known_roles(cls, messages):
        for message in messages or ():
            if message.get("role") not in get_args(Role):
                raise ValueError(f"unknown role {message.get('role')!r}; roles: {', '.join(get_args(Role))}")
        return messages

    @model_validator(mode="after")
    def _one_prompt(self):
        given = [name for name in ("prompt", "messages", "prompt_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, messages, prompt_ids (got {given or 'none'})")
        if not (self.prompt or self.messages or self.prompt_ids):
            raise ValueError(f"{given[0]} must not be empty")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages (the chat template shows them)")
        return self


@dataclass
class LogProb:
    token_id: int
    token: str  # the token decoded alone
    log_prob: Optional[float]  # None only for a prompt's first token, which nothing predicts


@dataclass
class TokenLogProbs:
    """A token's log-prob under the target, and the target's top alternatives there."""

    chosen: LogProb
    top: list[LogProb]


@dataclass
class StreamChunk:
    token_ids: list[int]
    text: str
    finish_reason: Optional[str] = None  # "stop" | "length" on the last chunk
    metrics: Optional[dict] = None  # on the last chunk
    log_probs: Optional[list[TokenLogProbs]] = None  # one per token id, when the request asks
    stop_reason: Union[int, str, None] = None  # on the last chunk: the stop token id or string, None for EOS
    # the prompt's tokens under the target (the first has log_prob None and no top), on a first
    # chunk of their own, when `sampling.prompt_logprobs` asks
    prompt_log_probs: Optional[list[TokenLogProbs]] = None
    prompt_tokens: int = 0  # the request's, on every chunk (usage as it goes)


@dataclass
class Completion:
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: dict
    log_probs: Optional[list[TokenLogProbs]] = None
    stop_reason: Union[int, str, None] = None
    prompt_log_probs: Optional[list[TokenLogProbs]] = None

    @classmethod
    def from_chunks(cls, chunks: list[StreamChunk]) -> "Completion":
        asked = chunks[-1].log_probs is not None
        return cls(
            prompt_tokens=chunks[-1].metrics["prompt_tokens"],
            token_ids=[token for chunk in chunks for token in chunk.token_ids],
            text="".join(chunk.text for chunk in chunks),
            finish_reason=chunks[-1].finish_reason,
            metrics=chunks[-1].metrics,
            log_probs=[entry for chunk in chunks for entry in chunk.log_probs or ()] if asked else None,
            stop_reason=chunks[-1].stop_reason,
            prompt_log_probs=chunks[0].prompt_log_probs,
        )
