"""Tool calls in free text (deployments/ingress/tool_parsers.py) and the streamed deltas of a
tool choice (tool_calls.ToolCallStream), on fixed answers: no model."""

from __future__ import annotations

import json

import pytest

from deployments.ingress.openai_api import ChatCompletionRequest
from deployments.ingress.tool_calls import ToolCallStream, auto_tool_parser
from deployments.ingress.tool_parsers import PARSERS, ParsedCall, parser_for, settled_content
from specdec_core.api.errors import SpecdecError

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, TIME], **fields)


def test_hermes_finds_tagged_calls_and_keeps_the_text_before_them():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    text += '<tool_call>{"name": "get_time", "arguments": {}}'  # cut off by max_tokens, its JSON whole
    parsed = PARSERS["hermes"].parse(text)
    assert parsed.content == "Let me look."
    assert parsed.calls == [ParsedCall("get_weather", '{"city": "Oslo"}'), ParsedCall("get_time", "{}")]
    assert PARSERS["hermes"].parse("no calls here").calls == []
    broken = 'x <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert PARSERS["hermes"].parse(broken).content == broken  # a malformed call: all content


def test_llama3_json_reads_calls_separated_by_semicolons_after_the_python_tag():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b"}}; '
    text += '{"name": "get_time", "parameters": {}}'
    parsed = PARSERS["llama3_json"].parse(text)
    assert parsed.content is None
    assert [call.name for call in parsed.calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.calls[0].arguments) == {"city": "a;b"}
    assert PARSERS["llama3_json"].parse("The weather is fine.").calls == []
    assert PARSERS["llama3_json"].parse('{"not": "a call"}').calls == []


def test_the_chat_template_names_the_parser_and_auto_without_one_is_a_400_naming_the_family():
    assert parser_for("... <tool_call> ...") == "hermes"
    assert parser_for("{{- '<|python_tag|>' }} ipython") == "llama3_json"
    assert parser_for("{{ message['content'] }}") is None

    class Frontend:
        tokenizer = type("Tokenizer", (), {"chat_template": "{{ message['content'] }}"})()
        model_family = "llama"

    with pytest.raises(SpecdecError, match="this llama model shows neither") as raised:
        auto_tool_parser(chat(), Frontend())
    assert raised.value.param == "tool_choice"
    assert auto_tool_parser(chat(tool_choice="required"), Frontend()) is None


def test_content_streams_until_it_could_become_a_call():
    assert settled_content("hermes", "Sure <tool") == len("Sure ")
    assert settled_content("hermes", "Sure <tool_call>{") == len("Sure ")
    assert settled_content("llama3_json", '  {"na') == 0
    assert settled_content("llama3_json", "<|python") == 0
    assert settled_content("llama3_json", "It is") == len("It is")


def streamed(request: ChatCompletionRequest, parser, pieces: list[str], reason: str = "stop"):
    stream = ToolCallStream(request, parser)
    deltas = [stream.delta(piece, None)[0] for piece in pieces[:-1]]
    last, finish_reason = stream.delta(pieces[-1], reason)
    return [*deltas, last], finish_reason


def test_a_named_call_streams_its_arguments_as_they_come():
    request = chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas, finish_reason = streamed(request, None, ['{"city"', ': "Oslo"', "}"])
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather" and "id" in deltas[0]["tool_calls"][0]
    assert all("id" not in delta["tool_calls"][0] for delta in deltas[1:])
    assert "".join(delta["tool_calls"][0]["function"]["arguments"] for delta in deltas) == '{"city": "Oslo"}'
    assert finish_reason == "stop"  # OpenAI's for a named call


def test_auto_streams_content_then_the_calls_found_at_the_end():
    pieces = ["Checking", " now <tool", '_call>{"name": "get_time",', ' "arguments": {}}</tool_call>']
    deltas, finish_reason = streamed(chat(), "hermes", pieces)
    assert "".join(delta.get("content", "") for delta in deltas) == "Checking now "
    assert deltas[-1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert finish_reason == "tool_calls"
    plain, finish_reason = streamed(chat(), "hermes", ["No", " call <", "b>"])
    assert "".join(delta.get("content", "") for delta in plain) == "No call <b>" and finish_reason == "stop"


def test_required_holds_everything_and_gives_the_array_as_calls():
    pieces = ['[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}]']
    deltas, finish_reason = streamed(chat(tool_choice="required"), None, pieces)
    assert deltas[0] == {} and finish_reason == "tool_calls"
    (call,) = deltas[-1]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_tool_choice_is_checked_against_the_tools():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="not among the tools"):
        chat(tool_choice={"type": "function", "function": {"name": "get_mood"}})
    with pytest.raises(ValidationError, match="needs tools"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required")
    with pytest.raises(ValidationError, match="no structured output beside it"):
        chat(tool_choice="required", response_format={"type": "json_object"})
    schema = chat(tool_choice="required").tool_grammar().json_schema
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2


def test_a_last_piece_with_text_and_a_call_sends_both():
    deltas, finish_reason = streamed(chat(), "hermes", ['Sure. <tool_call>{"name": "get_time", "arguments": {}}'])
    assert deltas[-1]["content"] == "Sure. " and deltas[-1]["tool_calls"][0]["function"]["name"] == "get_time"
    assert finish_reason == "tool_calls"


def test_auto_without_tools_is_plain_text_and_named_templates_are_read():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="auto")
    assert request.tool_mode == "none" and request.tool_grammar() is None
    assert parser_for({"default": "{{ messages }}", "tool_use": "<tool_call>"}) == "hermes"


def test_a_malformed_earlier_call_or_a_refusing_template_is_a_clear_400():
    from types import SimpleNamespace

    from jinja2 import TemplateError
    from pydantic import ValidationError

    from specdec_core.loop.frontend import Frontend

    bad = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{oops"}}]}
    with pytest.raises(ValidationError, match="not JSON"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}, bad])

    class RefusingTokenizer:
        eos_token_id = None

        def apply_chat_template(self, *args, **kwargs):
            raise TemplateError("Conversation roles must alternate")

    frontend = Frontend(RefusingTokenizer(), SimpleNamespace(vocab_size=8))
    with pytest.raises(SpecdecError, match="refuses these messages: Conversation roles") as raised:
        frontend.tokenize(messages=[{"role": "user", "content": "hi"}])
    assert raised.value.param == "messages"
