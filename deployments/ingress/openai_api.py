"""OpenAI-compatible request bodies, mapped onto specdec's GenerationRequest: OpenAI's fields and
semantics, and vLLM's where the two differ, with the sampling extensions clients of vLLM send
(`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
`include_stop_str_in_output`, `skip_special_tokens`). Extra body fields select the speculative
setup per request: `policy` and `drafter` (a registry name, or `{name, params}`),
`num_draft_tokens` and `run_ahead`.

A field is either implemented, or metadata that cannot change the output (accepted, ignored),
or unsupported: accepted only at the value that means "not used", else a 400 naming it. Any
other field is a 400 too: a request never gets a silently different answer. Response shapes are
openai_responses.py's."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

from specdec_core.api.request import ComponentSpec, GenerationRequest
from specdec_core.api.sampling import MAX_TOP_LOGPROBS
from specdec_core.structured.constraint_spec import StructuredOutput

from .chat_messages import ChatMessage
from .structured_fields import StructuredFields
from .tool_calls import ToolFields

MAX_PROMPTS = 128  # choices (prompts x n) in one request: each is a session on the workers
MAX_N = 16

# parallel_tool_calls: a chat's field (tool_calls.py), metadata on completions
METADATA = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "parallel_tool_calls"}
)

# each with the values that mean "not used"
UNSUPPORTED: dict[str, tuple] = {
    "length_penalty": (None, 1),
    "use_beam_search": (None, False),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "suffix": (None, ""),
    "echo": (None, False),  # chat's (vLLM's repeats the last message); completions implements it
    "modalities": (None, ["text"]),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "spaces_between_special_tokens": (None, True),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
}

# fields passed to SamplingParams as they are
SAMPLING_FIELDS = {
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "seed",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False  # a last chunk with empty choices carries the usage
    continuous_usage_stats: StrictBool = False  # with include_usage: every chunk carries its choice's (vLLM)


class OpenAIRequest(StructuredFields):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")  # left after `_known_fields`: metadata and unused fields

    model: Optional[str] = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="vLLM's: 0 or -1 is off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0, description="vLLM's: 1 is off")
    logit_bias: Optional[dict[str, float]] = Field(None, description="token id (as text) -> offset in [-100, 100]")
    min_tokens: int = Field(0, ge=0)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    seed: Optional[int] = Field(None, description="None: fresh randomness; the same seed repeats a sample")
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = Field(1, ge=1, le=MAX_N, description="choices per prompt, each its own session and seed stream")
    policy: Optional[Union[str, ComponentSpec]] = None
    drafter: Optional[Union[str, ComponentSpec]] = None
    num_draft_tokens: Optional[int] = Field(None, ge=1)
    run_ahead: Optional[StrictBool] = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, payload: Any) -> Any:
        """A null means the field's default (as vLLM's Optional fields, which gateways send)."""
        if not isinstance(payload, dict):
            return payload
        fields = cls.model_fields
        payload = {
            name: value
            for name, value in payload.items()
            if value is not None or name not in fields or fields[name].is_required() or fields[name].default is None
        }
        for name, value in payload.items():
            if name in cls.model_fields or name in METADATA:
                continue
            if name not in UNSUPPORTED:
                raise PydanticCustomError("unknown", f"{name} is not a field specdec knows", {"param": name})
            if value not in UNSUPPORTED[name]:
                raise PydanticCustomError("unsupported", f"{name} is not supported by specdec", {"param": name})
        return payload

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, logit_bias: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        if logit_bias and not all(token.strip().isdigit() for token in logit_bias):
            raise ValueError("logit_bias keys must be token ids")
        return logit_bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("stream", "stream_options needs stream: true", {"param": "stream_options"})
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def prompt_echoes(self, decode: Callable[[list[int]], str]) -> list[Optional[str]]:
        """What each prompt's choices start with (None: nothing)."""
        return [None]

    def echoes(self, decode: Callable[[list[int]], str]) -> list[Optional[str]]:
        """What each choice's text starts with: its prompt's, `n` choices a prompt."""
        return [echo for echo in self.prompt_echoes(decode) for _ in range(self.n)]

    def choices(self, request: GenerationRequest) -> list[GenerationRequest]:
        """A prompt's `n` choices, each its own session. Seeded, choice i draws from seed + i
        (vLLM's rule), so the request repeats all of them; unseeded, each draws fresh."""
        seed = request.sampling.seed
        if self.n == 1 or seed is None:
            return [request] * self.n
        seeds = [(seed + index + (1 << 63)) % (1 << 64) - (1 << 63) for index in range(self.n)]  # within int64
        return [request.model_copy(update={"sampling": request.sampling.model_copy(update={"seed": s})}) for s in seeds]

    def output_constraint(self) -> Optional[StructuredOutput]:
        """What the grammar makes the output match."""
        return self.structured_output()

    def generation_request(
        self, max_tokens: Optional[int], logprobs: Optional[int], prompt_logprobs: Optional[int] = None, **prompt: Any
    ) -> GenerationRequest:
        """What the speculative setup leaves out, the serving engine's defaults fill in."""
        sampling = {
            **self.model_dump(include=SAMPLING_FIELDS),
            "top_k": max(self.top_k, 0),
            "max_tokens": max_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else (self.stop or []),
            "stop_token_ids": self.stop_token_ids or [],
            "logit_bias": {int(token): bias for token, bias in (self.logit_bias or {}).items()},
            "structured_output": self.output_constraint(),
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
        }
        return GenerationRequest(
            **prompt,
            sampling=sampling,
            policy=component(self.policy),
            drafter=component(self.drafter),
            num_draft_tokens=self.num_draft_tokens,
            run_ahead=self.run_ahead,
        )


def component(spec: Union[str, ComponentSpec, None]) -> Optional[ComponentSpec]:
    """A policy or drafter given by name alone (as lm-eval's `gen_kwargs` can send it) or in full."""
    return ComponentSpec(name=spec) if isinstance(spec, str) else spec


class CompletionRequest(OpenAIRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        description="a text, texts (one choice each), token ids, or lists of them"
    )
    max_tokens: int = Field(16, ge=0, description="OpenAI's and vLLM's default (null too)")
    echo: StrictBool = False
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="top log-probs per token")

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, prompt):
        if not prompt or any(isinstance(part, (str, list)) and not part for part in prompt):
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and not isinstance(prompt[0], int) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return prompt

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("max_tokens", "max_tokens 0 needs echo: true", {"param": "max_tokens"})
        if len(self.prompts()) * self.n > MAX_PROMPTS:
            raise PydanticCustomError("n", f"at most {MAX_PROMPTS} choices (prompts x n) per request", {"param": "n"})
        return self

    def prompts(self) -> list[dict[str, Any]]:
        """One GenerationRequest prompt per choice."""
        if isinstance(self.prompt, str):
            return [{"prompt": self.prompt}]
        if isinstance(self.prompt[0], int):
            return [{"prompt_ids": self.prompt}]
        return [{"prompt": part} if isinstance(part, str) else {"prompt_ids": part} for part in self.prompt]

    def to_generation_requests(self) -> list[GenerationRequest]:
        prompt_logprobs = self.logprobs if self.echo else None  # an echoed prompt's, from its prefill
        requests = [
            self.generation_request(self.max_tokens, self.logprobs, prompt_logprobs, **prompt)
            for prompt in self.prompts()
        ]
        return [choice for request in requests for choice in self.choices(request)]

    def prompt_echoes(self, decode: Callable[[list[int]], str]) -> list[Optional[str]]:
        """What each prompt's choices start with: the prompt when echoing (a text as it came,
        token ids decoded, as vLLM echoes them)."""
        if not self.echo:
            return [None] * len(self.prompts())
        return [prompt["prompt"] if "prompt" in prompt else decode(prompt["prompt_ids"]) for prompt in self.prompts()]


class ChatCompletionRequest(ToolFields, OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, description="None: to the end of the turn or the context")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="wins over max_tokens, as in vLLM")
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("logprobs", "top_logprobs needs logprobs: true", {"param": "top_logprobs"})
        if self.tool_grammar() is not None and self.structured_output() is not None:
            message = f"tool_choice {self.tool_mode} writes the calls: no structured output beside it"
            raise PydanticCustomError("tools", message, {"param": "tool_choice"})
        return self

    def output_constraint(self) -> Optional[StructuredOutput]:
        return self.tool_grammar() or self.structured_output()

    def to_generation_requests(self) -> list[GenerationRequest]:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        messages = [message.for_template() for message in self.messages]
        request = self.generation_request(max_tokens, logprobs, messages=messages, tools=self.tool_definitions())
        return self.choices(request)
