"""Hostile requests and the answers they must get, one table for `specdec probe` (against a
running service) and the tests (against an in-process app). The values are invalid for any
model: token ids and top_k beyond any vocabulary, integers beyond their wire types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

BEYOND_ANY_VOCAB = 2_000_000_000  # fits the int32 wire type, above every vocabulary
DEEP_JSON = b"[" * 100_000 + b"]" * 100_000


@dataclass(frozen=True)
class HttpCase:
    path: str
    body: Union[dict, bytes]  # fields laid over a valid base request, or a raw body
    status: int
    param: Optional[str]  # the error's `param`: the field at fault

    @property
    def label(self) -> str:
        shown = self.body[:40].decode(errors="backslashreplace") if isinstance(self.body, bytes) else str(self.body)
        return f"{self.path.removeprefix('/v1/')} {shown[:70]}{'...' if len(shown) > 70 else ''}"

    def check(self, status: int, error: Optional[dict], text: str) -> Optional[str]:
        """What is wrong with the answer (`status`, its `error` object and raw `text`), or None."""
        if status != self.status:
            return f"status {status}, expected {self.status}"
        if error is None or not error.get("message"):
            return "no OpenAI error object"
        if error.get("param") != self.param:
            return f"param {error.get('param')!r}, expected {self.param!r}"
        if "Traceback" in text or 'File "' in text:
            return "leaks a traceback"
        return None


def completion_cases() -> list[HttpCase]:
    path = "/v1/completions"
    return [
        HttpCase(path, body, status, param)
        for body, status, param in [
            ({"max_tokens": 0}, 400, "max_tokens"),
            ({"max_tokens": 10**6}, 400, "max_tokens"),
            ({"temperature": -1}, 400, "temperature"),
            ({"temperature": "hot"}, 400, "temperature"),
            ({"top_p": 0}, 400, "top_p"),
            ({"top_k": 3e9}, 400, "top_k"),
            ({"top_k": BEYOND_ANY_VOCAB}, 400, "top_k"),
            ({"seed": 2**70}, 400, "seed"),
            ({"seed": -(2**70)}, 400, "seed"),
            ({"stream": "yes"}, 400, "stream"),
            ({"n": 17}, 400, "n"),
            ({"logit_bias": {str(BEYOND_ANY_VOCAB): 5}}, 400, "logit_bias"),
            ({"logit_bias": {"1": 500}}, 400, "logit_bias"),
            ({"presence_penalty": 3}, 400, "presence_penalty"),
            ({"repetition_penalty": 0}, 400, "repetition_penalty"),
            ({"echo": "yes"}, 400, "echo"),
            ({"response_format": {"type": "xml"}}, 400, "response_format.type"),
            ({"guided_json": "{not json"}, 400, "guided_json"),
            ({"guided_regex": "a+", "guided_choice": ["a"]}, 400, "guided_regex, guided_choice"),
            ({"guided_regex": "(unclosed"}, 400, "structured_output"),
            ({"min_tokens": 30}, 400, "min_tokens"),
            ({"stop": [""]}, 400, "stop"),
            ({"stop_token_ids": [BEYOND_ANY_VOCAB]}, 400, "stop_token_ids"),
            ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
            ({"prompt": ["a"] * 129}, 400, "prompt"),
            ({"prompt": [[1], []]}, 400, "prompt"),
            ({"best_of": 3}, 400, "best_of"),
            ({"logprobs": 50}, 400, "logprobs"),
            ({"logprobs": True}, 400, "logprobs"),
            ({"prompt": [BEYOND_ANY_VOCAB]}, 400, "prompt"),
            ({"prompt": []}, 400, "prompt"),
            ({"prompt": {"a": 1}}, 400, "prompt"),
            ({"prompt": None}, 400, "prompt"),
            ({"model": "other"}, 404, None),
            ({"policy": {"name": "nope"}}, 400, "policy"),
            ({"policy": {"name": "fly", "params": {"theta": -1}}}, 400, "policy"),
            ({"drafter": "nope"}, 400, "drafter"),
            ({"drafter": {"name": "heads", "params": {"scheduler": "binary_tau"}}}, 400, "drafter"),
            ({"drafter": {"name": "heads", "params": {"tree": "nope"}}}, 400, "drafter"),
            ({"drafter": {"name": "model_tree", "params": {"tree": "medusa_8+medusa_16"}}}, 400, "drafter"),
            ({"drafter": {"name": "suffix", "params": {"suffix_scope": "s" * 129}}}, 400, "drafter"),
            ({"drafter": {"name": "mla", "params": {"lookup": "suffix", "min_token_prob": 2}}}, 400, "drafter"),
            ({"num_draft_tokens": 500}, 400, "num_draft_tokens"),
            ({"num_draft_tokens": 0}, 400, "num_draft_tokens"),
            ({"stop": 5}, 400, "stop"),
            (b'{"prompt": "\xff"}', 400, None),
            (DEEP_JSON, 400, None),
            (b"[1, 2]", 400, None),
            (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413, None),
        ]
    ]


def chat_cases() -> list[HttpCase]:
    path = "/v1/chat/completions"
    image = [{"type": "image_url", "image_url": {}}]
    return [
        HttpCase(path, body, status, param)
        for body, status, param in [
            ({"messages": []}, 400, "messages"),
            ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
            ({"messages": [{"role": "user", "content": image}]}, 400, "messages.0.content"),
            ({"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
            ({"messages": None}, 400, "messages"),
            ({"top_logprobs": 5}, 400, "top_logprobs"),
            ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
            ({"logprobs": "yes"}, 400, "logprobs"),
            # tools with tool_choice auto, on a model whose chat template shows no tool-call format
            ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
            ({"tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
            ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, 400, "tools.0.function.name"),
            ({"max_completion_tokens": 0}, 400, "max_completion_tokens"),
            ({"echo": True}, 400, "echo"),
            ({"repetition_penalty": -1.2}, 400, "repetition_penalty"),
        ]
    ]


def http_cases() -> list[HttpCase]:
    return completion_cases() + chat_cases()


# specdec.GenerateRequest fields that must get INVALID_ARGUMENT
GRPC_CASES = [
    {"prompt": ""},
    {"prompt": "hi", "sampling": {"top_p": 0.0, "max_tokens": 8}},
    {"prompt": "hi", "sampling": {"top_p": 1.0, "top_k": BEYOND_ANY_VOCAB, "max_tokens": 8}},
    {"prompt": "hi", "sampling": {"top_p": 1.0, "max_tokens": -1}},
    {"prompt": "hi", "sampling": {"top_p": 1.0, "max_tokens": 4, "min_tokens": 8}},
    {"prompt": "hi", "sampling": {"top_p": 1.0, "max_tokens": 8, "logprobs": 50}},
    {"prompt": "hi", "policy": {"name": "nope"}},
    {"prompt": "hi", "policy": {"name": "fly", "params_json": "{"}},
    {"prompt": "hi", "drafter": {"name": "nope"}},
    {"prompt": "hi", "drafter": {"name": "heads", "params_json": '{"scheduler": "ladder", "trees": ["chain_2"]}'}},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"prompt": "hi", "num_draft_tokens": 500},
]
