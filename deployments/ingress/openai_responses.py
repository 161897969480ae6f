"""OpenAI-compatible response bodies and stream chunks, built from specdec's StreamChunks: `n`
choices per prompt (`index`), `usage` summed over them (a prompt's tokens counted once), the
legacy completions log-prob columns (an echoed prompt's first, as vLLM: the first prompt token
has none) or chat's `content` list.
Beside OpenAI's fields each choice carries its `token_ids` and vLLM's `stop_reason`; the
`speculative` metrics ride on the response (one prompt), on each choice (several), or on a
choice's last chunk (streamed)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from specdec_core.api.request import Completion, LogProb, StreamChunk, TokenLogProbs

from .openai_api import OpenAIRequest
from .tool_calls import ToolCallStream, tool_call_message

MIN_LOG_PROB = -9999.0  # JSON has no -inf; vLLM clamps to this too


def error_body(
    message: str, error_type: str = "invalid_request_error", param: Optional[str] = None, code: Optional[str] = None
) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def clamped(log_prob: Optional[float]) -> Optional[float]:
    return None if log_prob is None else max(log_prob, MIN_LOG_PROB)


def chat_log_prob(entry: LogProb) -> dict:
    return {"token": entry.token, "logprob": clamped(entry.log_prob), "bytes": list(entry.token.encode())}


@dataclass
class ChoiceState:
    """What a streamed choice has sent so far."""

    text_offset: int = 0  # of its next token, for the legacy log-prob columns
    completion_tokens: int = 0
    started: bool = False


class ResponseBuilder:
    """Builds completion / chat.completion objects and their streaming chunks for one request."""

    def __init__(
        self,
        request: OpenAIRequest,
        echoes: list[Optional[str]],
        chat: bool,
        model: str,
        request_id: str,
        tool_parser: Optional[str] = None,
    ):
        """`echoes`: what each choice's text starts with (OpenAIRequest.echoes); `tool_parser`: the
        model's (tool_parsers.py), for a chat whose tool choice is auto."""
        self.request = request
        self.tool_parser = tool_parser
        self.tool_streams: dict[int, ToolCallStream] = {}
        self.echoes = echoes
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.choices: dict[int, ChoiceState] = {}
        self.prompt_tokens: dict[int, int] = {}

    def _envelope(self, choices: list[dict], streamed: bool) -> dict:
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _log_probs(self, entries: Optional[list[TokenLogProbs]], state: ChoiceState) -> Optional[dict]:
        """OpenAI's `logprobs` object: chat's `content` list, or the legacy completions columns,
        whose top entries hold the chosen token too (vLLM's; a prompt's first token has none)."""
        if entries is None:
            return None
        if self.chat:
            return {
                "content": [
                    {**chat_log_prob(entry.chosen), "top_logprobs": [chat_log_prob(top) for top in entry.top]}
                    for entry in entries
                ]
            }
        offsets, tops = [], []
        for entry in entries:
            offsets.append(state.text_offset)
            state.text_offset += len(entry.chosen.token)
            unpredicted = entry.chosen.log_prob is None
            top = {item.token: clamped(item.log_prob) for item in (entry.chosen, *entry.top)}
            tops.append(None if unpredicted else top)
        return {
            "tokens": [entry.chosen.token for entry in entries],
            "token_logprobs": [clamped(entry.chosen.log_prob) for entry in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _choice(self, index: int, chunk: StreamChunk, state: ChoiceState, streamed: bool) -> dict:
        text, log_probs = chunk.text, chunk.log_probs
        if not state.started and self.echoes[index] is not None:
            text = self.echoes[index] + text
        if chunk.prompt_log_probs is not None:  # only an echoing request asks for them
            log_probs = chunk.prompt_log_probs + (log_probs or [])
        choice: dict[str, Any] = {"index": index}
        finish_reason = chunk.finish_reason
        tools = self.chat and getattr(self.request, "tool_mode", "none") != "none"
        if tools and streamed:
            stream = self.tool_streams.setdefault(index, ToolCallStream(self.request, self.tool_parser))
            delta, finish_reason = stream.delta(text, chunk.finish_reason)
            choice["delta"] = delta if state.started else {"role": "assistant", **delta}
        elif tools:
            parsed = self.request.parsed_tool_calls(text, self.tool_parser)
            choice["message"] = tool_call_message(parsed)
            finish_reason = self.request.finish_reason(parsed, chunk.finish_reason)
        elif self.chat and streamed:
            choice["delta"] = {"content": text} if state.started else {"role": "assistant", "content": text}
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        state.started = True
        choice["logprobs"] = self._log_probs(log_probs, state)
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = chunk.stop_reason
        choice["token_ids"] = chunk.token_ids
        return choice

    def full(self, completions: list[Completion]) -> dict:
        """The whole response: one choice per prompt, in order."""
        choices = []
        for index, completion in enumerate(completions):
            chunk = StreamChunk(
                completion.token_ids,
                completion.text,
                completion.finish_reason,
                log_probs=completion.log_probs,
                stop_reason=completion.stop_reason,
                prompt_log_probs=completion.prompt_log_probs,
            )
            choices.append(self._choice(index, chunk, ChoiceState(), streamed=False))
            if len(completions) > 1:
                choices[-1]["speculative"] = completion.metrics
        body = self._envelope(choices, streamed=False)
        prompt_tokens = sum(completion.prompt_tokens for completion in completions[:: self.request.n])  # once a prompt
        body["usage"] = usage(prompt_tokens, sum(len(completion.token_ids) for completion in completions))
        if len(completions) == 1:
            body["speculative"] = completions[0].metrics
        return body

    def chunk(self, index: int, chunk: StreamChunk) -> dict:
        """One streamed chunk of choice `index`."""
        state = self.choices.setdefault(index, ChoiceState())
        body = self._envelope([self._choice(index, chunk, state, streamed=True)], streamed=True)
        state.completion_tokens += len(chunk.token_ids)
        self.prompt_tokens[index] = chunk.prompt_tokens
        if self.request.continuous_usage:
            body["usage"] = usage(chunk.prompt_tokens, state.completion_tokens)
        if chunk.metrics is not None:
            body["speculative"] = chunk.metrics
        return body

    def usage_chunk(self) -> Optional[dict]:
        """With `stream_options.include_usage`: the last chunk, empty choices and the usage."""
        if not self.request.include_usage:
            return None
        body = self._envelope([], streamed=True)
        completion_tokens = sum(state.completion_tokens for state in self.choices.values())
        prompt_tokens = sum(tokens for index, tokens in self.prompt_tokens.items() if index % self.request.n == 0)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
