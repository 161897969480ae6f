"""Tool calls through the official `openai` SDK (`chat.completions.create(tools=...)`) on the HTTP API
over in-process workers: tiny random models behind SmolLM2's tokenizer, given a Hermes-style
chat template that shows the tools. The grammar writes named and required calls, so their
arguments match the function's schema whatever the random model prefers."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.tiny_models import perturbed_copy, tiny_llama

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from helpers.served import HttpServer, Workers  # noqa: E402

pytestmark = pytest.mark.needs_smollm2  # SmolLM2's tokenizer

from specdec_core import GenerationRequest, ModelSpec, SpeculativeEngine  # noqa: E402
from specdec_core.models.loader import load_tokenizer  # noqa: E402

# ChatML with Hermes' tool section and calls, as Qwen 2.5's and Hermes 2 Pro's templates write them
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call functions.\n<tools>\n{% for tool in tools %}"
    '{{ tool | tojson }}\n{% endfor %}</tools>\nAnswer <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    "<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER_PARAMETERS},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "additionalProperties": False}},
    },
]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo this week?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def engine():
    tokenizer = load_tokenizer(ModelSpec())
    tokenizer.chat_template = HERMES_TEMPLATE
    target = tiny_llama(seed=4, vocab_size=len(tokenizer))
    return SpeculativeEngine(target, tokenizer, perturbed_copy(target, 0.002))


@pytest.fixture(scope="module")
def client(engine):
    workers = Workers(engine)
    server = HttpServer(workers)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    server.stop()
    workers.stop()


@pytest.mark.parametrize("drafter", ["none", "pld", "model"])
def test_a_named_tool_choice_calls_it_with_arguments_of_its_schema(client, engine, drafter):
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=48,
        temperature=0,
        extra_body={"drafter": drafter},
    )
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    assert choice.message.content is None and choice.finish_reason == "stop"
    # the in-process engine, given the same tools and the function's schema, writes the same tokens
    constraint = {"json_schema": WEATHER_PARAMETERS, "disable_any_whitespace": True}
    sampling = {"max_tokens": 48, "structured_output": constraint}
    local = engine.complete(
        GenerationRequest(messages=MESSAGES, tools=TOOLS, drafter={"name": drafter}, sampling=sampling)
    )
    assert choice.model_extra["token_ids"] == local.token_ids
    if drafter == "model":  # the draft worker masks its proposals with the grammar, as the local drafter does
        acceptance = reply.model_extra["speculative"]["mean_acceptance_length"]
        assert acceptance == local.metrics["mean_acceptance_length"] > 2.0
    assert reply.usage.prompt_tokens == len(engine.frontend.tokenize(messages=MESSAGES, tools=TOOLS))
    assert reply.usage.prompt_tokens > len(engine.frontend.tokenize(messages=MESSAGES))  # the tools are shown
    counted = httpx.post(
        str(client.base_url).removesuffix("/v1/") + "/tokenize", json={"messages": MESSAGES, "tools": TOOLS}
    )
    assert counted.json()["count"] == reply.usage.prompt_tokens  # vLLM's /tokenize counts them too


def test_required_calls_one_tool_and_a_stream_says_the_same(client):
    """`parallel_tool_calls: false` bounds the array to one call (a random model repeats calls)."""
    request = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0)
    request["parallel_tool_calls"] = False
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed = [call for chunk in chunks for call in (chunk.choices[0].delta.tool_calls or [])]
    assert [(call.function.name, call.function.arguments) for call in streamed] == [
        (call.function.name, call.function.arguments) for call in choice.message.tool_calls
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_streamed_named_call_sends_its_head_once_then_its_arguments(client):
    request = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=48, temperature=0)
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls[0]
    deltas = [
        call
        for chunk in client.chat.completions.create(**request, stream=True)
        for call in chunk.choices[0].delta.tool_calls or []
    ]
    assert deltas[0].function.name == "get_weather" and all(delta.function.name is None for delta in deltas[1:])
    assert "".join(delta.function.arguments for delta in deltas) == whole.function.arguments


def test_auto_answers_in_text_when_the_model_calls_nothing_and_history_with_calls_renders(client):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    reply = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason == "length"


def test_a_tool_choice_that_cannot_be_served_is_a_400(client):
    for tool_choice, tools, param in (
        (NAMED, None, "tool_choice"),
        ({"type": "function", "function": {"name": "x"}}, TOOLS, "tool_choice"),
    ):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                max_tokens=4,
                tool_choice=tool_choice,
                **({"tools": tools} if tools else {}),
            )
        assert raised.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, extra_body={"tools": TOOLS})
