"""The speculative loop: propose -> score -> verify -> commit/rollback -> stream.

`SpeculativeEngine` owns the models; each request gets its own target scorer, drafter session
and RNGs (verifier and drafter draw from separate generators seeded from `sampling.seed`, so a
request is reproducible wherever its pieces run)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .drafters import Drafter, make_drafter, validate_drafter
from .errors import SpecdecError
from .metrics import SpecMetrics
from .models import ModelSpec, load_model, load_tokenizer
from .policies import AcceptancePolicy, make_policy
from .sampling import SamplingParams
from .target import TargetScorer

MAX_DRAFT_TOKENS = 64


class ComponentSpec(BaseModel):
    """A policy or drafter chosen by registry name, with its parameters."""

    model_config = ConfigDict(extra="forbid")
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class GenerationRequest(BaseModel):
    """One request: exactly one of prompt / messages / prompt_ids, plus the speculative setup."""

    model_config = ConfigDict(extra="forbid")

    prompt: Optional[str] = None
    messages: Optional[list[dict[str, str]]] = None
    prompt_ids: Optional[list[int]] = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    policy: ComponentSpec = Field(default_factory=lambda: ComponentSpec(name="greedy"))
    drafter: ComponentSpec = Field(default_factory=lambda: ComponentSpec(name="pld"))
    num_draft_tokens: int = Field(8, ge=1, le=MAX_DRAFT_TOKENS)

    @model_validator(mode="after")
    def _one_prompt(self):
        given = [name for name in ("prompt", "messages", "prompt_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, messages, prompt_ids (got {given or 'none'})")
        if not (self.prompt or self.messages or self.prompt_ids):
            raise ValueError(f"{given[0]} must not be empty")
        return self


@dataclass
class StreamChunk:
    token_ids: list[int]
    text: str
    finish_reason: Optional[str] = None  # "stop" | "length" on the last chunk
    metrics: Optional[dict] = None  # on the last chunk


@dataclass
class Completion:
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: dict


@dataclass
class OutputTracker:
    """Applies EOS, max_tokens and stop strings, and turns token ids into text deltas."""

    tokenizer: Any
    sampling: SamplingParams
    eos_ids: set[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_chars: int = 0
    finish_reason: Optional[str] = None

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens - len(self.token_ids)

    def append(self, new_tokens: Sequence[int]) -> StreamChunk:
        start = len(self.token_ids)
        for token in new_tokens:
            if token in self.eos_ids and not self.sampling.ignore_eos:
                self.finish_reason = "stop"
                break
            self.token_ids.append(token)
            if self.remaining == 0:
                self.finish_reason = "length"
                break
        if self.tokenizer is not None:
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            self._apply_stop_strings()
        return StreamChunk(self.token_ids[start:], self._text_delta(), self.finish_reason)

    def _apply_stop_strings(self) -> None:
        hits = [index for index in (self.text.find(stop) for stop in self.sampling.stop) if index >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"

    def _text_delta(self) -> str:
        safe_end = len(self.text)
        if self.finish_reason is None:
            # hold back an incomplete UTF-8 sequence and a possible stop-string prefix
            safe_end = len(self.text.rstrip("\ufffd"))
            if self.sampling.stop:
                safe_end = max(self.emitted_chars, safe_end - max(map(len, self.sampling.stop)) + 1)
        delta = self.text[self.emitted_chars : safe_end]
        self.emitted_chars = max(self.emitted_chars, safe_end)
        return delta


class Frontend:
    """Everything about a request that needs no weights: tokenization, chat template, and
    validation against the target's vocabulary and context length. The in-process engine and
    the remote coordinator share it."""

    def __init__(self, tokenizer: Any, model_config: Any, generation_config: Any = None):
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_positions = getattr(model_config, "max_position_embeddings", 1 << 20)
        eos = getattr(generation_config, "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = eos_ids

    def encode(self, request: GenerationRequest) -> list[int]:
        if request.prompt_ids is not None:
            if not all(0 <= token < self.vocab_size for token in request.prompt_ids):
                raise SpecdecError(f"prompt_ids must lie in [0, {self.vocab_size})")
            return list(request.prompt_ids)
        if self.tokenizer is None:
            raise SpecdecError("this engine has no tokenizer: send prompt_ids")
        if request.messages is not None:
            text = self.tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return self.tokenizer(request.prompt).input_ids

    def validate(self, request: GenerationRequest) -> tuple[list[int], AcceptancePolicy]:
        """Prompt ids and the policy for a request; raises SpecdecError with a clear message."""
        policy = make_policy(request.policy.name, request.policy.params)
        if not request.sampling.greedy and not policy.supports_sampling:
            raise SpecdecError(f"policy {policy.name!r} needs temperature 0; use 'rejection' to sample")
        validate_drafter(request.drafter.name, request.drafter.params)
        prompt_ids = self.encode(request)
        if not prompt_ids:
            raise SpecdecError("prompt encodes to zero tokens")
        budget = self.max_positions - request.sampling.max_tokens - request.num_draft_tokens
        if len(prompt_ids) > budget:
            raise SpecdecError(
                f"prompt has {len(prompt_ids)} tokens; with max_tokens={request.sampling.max_tokens} the limit is {max(budget, 0)}"
            )
        return prompt_ids, policy

    def output(self, request: GenerationRequest) -> OutputTracker:
        return OutputTracker(self.tokenizer, request.sampling, self.eos_ids)


class SpeculativeEngine:
    """In-process speculative decoding over a target (and optional draft) model."""

    def __init__(self, target_model: torch.nn.Module, tokenizer: Any = None, draft_model: Optional[torch.nn.Module] = None):
        self.target_model = target_model
        self.tokenizer = tokenizer
        self.draft_model = draft_model
        self.frontend = Frontend(tokenizer, target_model.config, getattr(target_model, "generation_config", None))

    @property
    def eos_ids(self) -> set[int]:
        return self.frontend.eos_ids

    @classmethod
    def from_specs(cls, target: ModelSpec, draft: Optional[ModelSpec] = None) -> "SpeculativeEngine":
        return cls(load_model(target), load_tokenizer(target), load_model(draft) if draft else None)

    def encode(self, request: GenerationRequest) -> list[int]:
        return self.frontend.encode(request)

    def stream(self, request: GenerationRequest) -> Iterator[StreamChunk]:
        prompt_ids, policy = self.frontend.validate(request)
        drafter = make_drafter(request.drafter.name, request.drafter.params, self.draft_model)
        yield from speculative_loop(
            prompt_ids, policy, drafter, TargetScorer(self.target_model), request.num_draft_tokens, self.frontend.output(request)
        )

    def complete(self, request: GenerationRequest) -> Completion:
        chunks = list(self.stream(request))
        return Completion(
            prompt_tokens=chunks[-1].metrics["prompt_tokens"],
            token_ids=[token for chunk in chunks for token in chunk.token_ids],
            text="".join(chunk.text for chunk in chunks),
            finish_reason=chunks[-1].finish_reason,
            metrics=chunks[-1].metrics,
        )


def speculative_loop(
    prompt_ids: list[int],
    policy: AcceptancePolicy,
    drafter: Drafter,
    target: TargetScorer,
    num_draft_tokens: int,
    output: OutputTracker,
) -> Iterator[StreamChunk]:
    """The speculative loop over any drafter/target pair with the session interface (local
    objects here, gRPC proxies in deployments/): propose -> score -> verify -> commit -> stream."""
    sampling = output.sampling
    verify_rng = torch.Generator().manual_seed(sampling.seed)
    metrics = SpecMetrics()
    clock = time.perf_counter()
    target.reset(prompt_ids, policy, sampling)
    drafter.reset(prompt_ids, sampling, torch.Generator().manual_seed(sampling.seed + 1))
    metrics.prefill_ms = (time.perf_counter() - clock) * 1e3
    last_token = prompt_ids[-1]
    while output.finish_reason is None:
        clock = time.perf_counter()
        draft = drafter.propose(min(num_draft_tokens, output.remaining - 1))
        metrics.draft_ms.append((time.perf_counter() - clock) * 1e3)
        clock = time.perf_counter()
        block = target.score([last_token, *draft.tokens.tolist()])
        metrics.target_ms.append((time.perf_counter() - clock) * 1e3)
        clock = time.perf_counter()
        verdict = policy.verify(draft, block, sampling, verify_rng)
        metrics.verify_ms.append((time.perf_counter() - clock) * 1e3)
        new_tokens = [*draft.tokens[: verdict.num_accepted].tolist(), verdict.next_token]
        target.commit(verdict.num_accepted + 1)
        drafter.commit(new_tokens)
        metrics.record(draft, verdict)
        last_token = new_tokens[-1]
        chunk = output.append(new_tokens)
        if output.finish_reason is not None:
            chunk.metrics = {
                **metrics.summary(),
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(output.token_ids),
            }
        if chunk.token_ids or chunk.text or chunk.finish_reason:
            yield chunk
