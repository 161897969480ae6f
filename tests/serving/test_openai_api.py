"""OpenAI's semantics (vLLM's where they differ) on the HTTP API over in-process workers (tiny
random models behind SmolLM2's tokenizer), checked through the official `openai` client where it
can express the request: seeds, default lengths, prompt batches, echo with prompt log-probs,
vLLM's stop and length extensions, usage in streams, and the fields a request may not set."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from helpers.reference_scores import target_rows
from helpers.tiny_models import perturbed_copy, repeating_prompt, tiny_llama

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from helpers.served import HttpServer, Workers, http_client  # noqa: E402

pytestmark = pytest.mark.needs_smollm2  # SmolLM2's tokenizer

from specdec_core import GenerationRequest, ModelSpec, SpeculativeEngine  # noqa: E402
from specdec_core.models.loader import load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    tokenizer = load_tokenizer(ModelSpec())
    target = tiny_llama(seed=4, vocab_size=len(tokenizer))
    return SpeculativeEngine(target, tokenizer, perturbed_copy(target, 0.002))


@pytest.fixture(scope="module")
def workers(engine):
    served = Workers(engine)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def server(workers):
    served = HttpServer(workers)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def free_run(engine, prompt_ids: list[int], max_tokens: int = 24) -> list[int]:
    request = GenerationRequest(prompt_ids=prompt_ids, sampling={"max_tokens": max_tokens, "ignore_eos": True})
    return engine.complete(request).token_ids


def test_unseeded_samples_differ_and_a_seed_repeats_its_sample(client):
    def sample(**fields) -> list[int]:
        reply = client.completions.create(model="tiny", prompt="Once", max_tokens=12, temperature=1.0, **fields)
        return reply.choices[0].model_extra["token_ids"]

    assert sample() != sample()
    assert sample(seed=7) == sample(seed=7) != sample(seed=8)


def test_a_chat_without_max_tokens_runs_to_the_end_and_completions_default_to_16(engine):
    limited = Workers(engine)
    frontend = limited.engine.frontend
    try:
        http = http_client(limited)
        messages = [{"role": "user", "content": "hi"}]
        frontend.max_positions = 64  # the context's end comes first ...
        chat = http.post("/v1/chat/completions", json={"messages": messages}).json()
        room = 64 - chat["usage"]["prompt_tokens"] - 8  # ... after the prompt and a block of drafts
        assert chat["usage"]["completion_tokens"] == room and chat["choices"][0]["finish_reason"] == "length"
        frontend.max_positions, frontend.max_tokens_limit = 1024, 40  # ... or the deployment's cap
        chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": None}).json()
        assert chat["usage"]["completion_tokens"] == 40 and chat["choices"][0]["finish_reason"] == "length"
        for legacy in ({"prompt": "hi"}, {"prompt": "hi", "max_tokens": None}):  # null: the default too
            assert http.post("/v1/completions", json=legacy).json()["usage"]["completion_tokens"] == 16
        too_long = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 41}
        )
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    finally:
        limited.stop()


def test_a_prompt_batch_gets_one_choice_per_prompt(client, workers):
    texts = ["The sea", "A cat sat", "Numbers: 1 2 3"]
    alone = [
        client.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0).choices[0].text
        for text in texts
    ]
    batch = client.completions.create(model="tiny", prompt=texts, max_tokens=8, temperature=0)
    assert [choice.index for choice in batch.choices] == [0, 1, 2]
    assert [choice.text for choice in batch.choices] == alone
    assert batch.usage.completion_tokens == 24
    ids = [repeating_prompt(seed, vocab_size=49152) for seed in (1, 2)]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    single = client.completions.create(model="tiny", prompt=ids[1], max_tokens=4, temperature=0)
    assert by_ids.choices[1].text == single.choices[0].text and by_ids.usage.prompt_tokens == 48
    stream = client.completions.create(model="tiny", prompt=texts, max_tokens=8, temperature=0, stream=True)
    streamed = ["", "", ""]
    for chunk in stream:
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == alone
    assert workers.engine.session_counts() == {"draft": 0, "target": 0}


def test_echo_scores_the_prompt_with_the_targets_log_probs(client, engine):
    """lm-eval's log-likelihood request: the prompt's tokens (the first has none), then one token."""
    prompt = repeating_prompt(5, vocab_size=49152)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    log_probs = reply.choices[0].logprobs
    generated = reply.choices[0].model_extra["token_ids"]
    rows = target_rows(engine.target_model, prompt[:1], prompt[1:] + generated)
    assert log_probs.token_logprobs[0] is None and log_probs.top_logprobs[0] is None
    assert len(log_probs.tokens) == len(prompt) + 1
    for row, token, value, top in zip(
        rows, prompt[1:] + generated, log_probs.token_logprobs[1:], log_probs.top_logprobs[1:]
    ):
        assert value == pytest.approx(row[token].item(), abs=1e-4)
        assert max(top.values()) == pytest.approx(row.max().item(), abs=1e-4)  # the top 1 and the chosen token
    assert reply.choices[0].text.startswith(engine.frontend.tokenizer.decode(prompt))
    scored = client.completions.create(model="tiny", prompt="Hello there", max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == "Hello there" and scored.usage.completion_tokens == 0
    assert len(scored.choices[0].logprobs.token_logprobs) == scored.usage.prompt_tokens == 2
    echoed = client.completions.create(model="tiny", prompt=" Hello", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt=" Hello", max_tokens=3, temperature=0)
    assert echoed.choices[0].text == " Hello" + plain.choices[0].text and echoed.choices[0].logprobs is None
    streamed = client.completions.create(
        model="tiny", prompt=" Hello", max_tokens=3, temperature=0, echo=True, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == echoed.choices[0].text


def test_a_prompt_batch_frees_every_session_when_one_prompt_is_refused_or_the_client_leaves(workers, server):
    import httpx

    http = http_client(workers)
    refused = http.post("/v1/completions", json={"prompt": ["fine", "x " * 1100], "max_tokens": 4})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    body = {"model": "tiny", "prompt": ["a b", "c d", "e f"], "max_tokens": 200, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as reply:
        next(line for line in reply.iter_lines() if line.startswith("data: {"))
    deadline = time.monotonic() + 30
    while workers.engine.session_counts() != {"draft": 0, "target": 0} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers.engine.session_counts() == {"draft": 0, "target": 0}


def test_stop_tokens_min_tokens_and_what_text_shows_follow_vllm(workers, engine):
    http = http_client(workers)
    prompt = repeating_prompt(6, vocab_size=49152)
    run = free_run(engine, prompt)
    stop_id = run[5]
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop_token_ids": [stop_id]}
    stopped = http.post("/v1/completions", json=body).json()["choices"][0]
    assert stopped["token_ids"] == run[: run.index(stop_id) + 1]  # the stop token stays in the ids ...
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop_id
    decode = engine.frontend.tokenizer.decode
    assert stopped["text"] == decode(stopped["token_ids"][:-1])  # ... not in the text
    shown = http.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()["choices"][0]
    assert shown["text"] == decode(stopped["token_ids"])
    late = http.post("/v1/completions", json={**body, "min_tokens": 12}).json()["choices"][0]
    assert stop_id not in late["token_ids"][:12] and len(late["token_ids"]) > 12
    # greedy rows travel as their top 1: the stop token is masked in whole rows (output.py)
    sampling = {"max_tokens": 24, "stop_token_ids": [stop_id], "min_tokens": 12}
    in_process = GenerationRequest(prompt_ids=prompt, sampling=sampling)
    assert late["token_ids"] == engine.complete(in_process).token_ids
    stop_string = next(text for i in range(6, 20) if (text := decode(run[i : i + 2])).strip() and "\ufffd" not in text)
    cut = http.post("/v1/completions", json={**body, "stop_token_ids": [], "stop": [stop_string]}).json()["choices"][0]
    assert cut["stop_reason"] == stop_string and stop_string not in cut["text"] and cut["finish_reason"] == "stop"
    kept = http.post(
        "/v1/completions", json={**body, "stop_token_ids": [], "stop": stop_string, "include_stop_str_in_output": True}
    )
    assert kept.json()["choices"][0]["text"].endswith(stop_string)


def test_ignore_eos_runs_to_max_tokens(engine):
    prompt = repeating_prompt(6, vocab_size=49152)
    run = free_run(engine, prompt)
    with_eos = Workers(engine)
    with_eos.engine.frontend.eos_ids = {run[3]}  # this target's "EOS", so that it comes early
    try:
        http = http_client(with_eos)
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        stopped = http.post("/v1/completions", json=body).json()["choices"][0]
        assert stopped["token_ids"] == run[: run.index(run[3]) + 1] and stopped["finish_reason"] == "stop"
        ignoring = http.post("/v1/completions", json={**body, "ignore_eos": True}).json()
        assert ignoring["choices"][0]["token_ids"] == run and ignoring["usage"]["completion_tokens"] == 24
    finally:
        with_eos.stop()


def test_streams_carry_usage_only_when_asked_in_the_last_chunk_with_no_choices(client, server):
    import httpx

    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(chunk.usage is None for chunk in chunks[:-1]) and chunks[-1].choices == []
    tokenizer = load_tokenizer(ModelSpec())
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    prompt_tokens = len(tokenizer(template, add_special_tokens=False).input_ids)
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == prompt_tokens
    assert chunks[0].choices[0].delta.role == "assistant"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    for stream_options, expect in ((None, "none"), (options, "every")):
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json={**body, "stream_options": stream_options}
        ) as reply:
            events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
        with_usage = [event for event in events if "usage" in event]
        assert len(with_usage) == (0 if expect == "none" else len(events))


def test_async_client_and_extra_body_choose_the_speculative_setup(server, engine):
    async def ask():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            extra = {"policy": "fly", "drafter": {"name": "model"}, "num_draft_tokens": 3}
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model="tiny", prompt=[1, 2, 3, 1, 2, 3], max_tokens=12, temperature=0, extra_body=extra
                    )
                    for _ in range(3)
                )
            )

    replies = asyncio.run(ask())
    assert {reply.model_extra["speculative"]["policy"]["name"] for reply in replies} == {"fly"}
    assert len({reply.choices[0].text for reply in replies}) == 1
    assert all(reply.model_extra["speculative"]["spec_decode_num_draft_tokens"] > 0 for reply in replies)


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "text"}, "user": "u1", "metadata": {"a": "b"}, "store": False},
        {"tool_choice": "none", "n": 1, "presence_penalty": 0, "seed": None, "top_k": -1},
        {"temperature": None, "top_p": None, "n": None, "stream": None, "stop": None, "logprobs": None},
    ],
)
def test_neutral_values_and_metadata_are_accepted(client, fields):
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body=fields
    )
    assert reply.usage.completion_tokens == 3


def test_a_field_that_would_change_the_answer_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_body={"bad_words": ["sea"]},
        )
    assert raised.value.body["param"] == "bad_words"


PROCESSORS = {"presence_penalty": 0.8, "frequency_penalty": 0.4, "repetition_penalty": 1.3, "min_p": 0.1}
BIAS = {17: 5.0, 900: -100.0}


@pytest.mark.parametrize(
    "drafter, run_ahead, temperature",
    [("none", False, 0), ("model", False, 0), ("model", True, 0), ("mla", False, 0.8)],
)
def test_penalties_logit_bias_and_min_p_through_the_sdk_equal_the_in_process_engine(
    client, engine, drafter, run_ahead, temperature
):
    """Served rows go whole over the wire and the server processes them (no forwarded verdicts):
    the same tokens as in process, greedy and sampled under a seed."""
    prompt = repeating_prompt(3, vocab_size=49152)
    reply = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=16,
        temperature=temperature,
        seed=5,
        presence_penalty=PROCESSORS["presence_penalty"],
        frequency_penalty=PROCESSORS["frequency_penalty"],
        logit_bias={str(token): bias for token, bias in BIAS.items()},
        extra_body={
            "repetition_penalty": PROCESSORS["repetition_penalty"],
            "min_p": PROCESSORS["min_p"],
            "drafter": drafter,
            "run_ahead": run_ahead,
        },
    )
    sampling = {"max_tokens": 16, "temperature": temperature, "seed": 5, "logit_bias": BIAS, **PROCESSORS}
    local = engine.complete(
        GenerationRequest(prompt_ids=prompt, drafter={"name": drafter}, run_ahead=run_ahead, sampling=sampling)
    )
    assert reply.choices[0].model_extra["token_ids"] == local.token_ids
    plain = engine.complete(
        GenerationRequest(prompt_ids=prompt, drafter={"name": drafter}, sampling={"max_tokens": 16})
    )
    assert local.token_ids != plain.token_ids or temperature  # greedy: the processors reach the output


def test_tokenize_and_detokenize_as_the_engine_encodes(workers, engine):
    http = http_client(workers)
    tokenizer = engine.frontend.tokenizer
    text = http.post("/tokenize", json={"model": "tiny", "prompt": "The sea is wide."}).json()
    assert text["tokens"] == tokenizer("The sea is wide.").input_ids and text["count"] == len(text["tokens"])
    assert text["max_model_len"] == engine.frontend.max_positions and text["token_strs"] is None
    messages = [{"role": "user", "content": "hi"}]
    chat = http.post("/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    assert chat["tokens"] == engine.frontend.encode(GenerationRequest(messages=messages))  # what a chat request sends
    assert chat["token_strs"] == tokenizer.convert_ids_to_tokens(chat["tokens"])
    back = http.post("/detokenize", json={"tokens": text["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(text["tokens"])}
    for path, body, param in (
        ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [10**7]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ):
        refused = http.post(path, json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    assert http.post("/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404
    guarded = http_client(workers, api_key="sk-test")
    assert guarded.post("/tokenize", json={"prompt": "a"}).status_code == 401
    assert (
        guarded.post("/detokenize", json={"tokens": [1]}, headers={"Authorization": "Bearer sk-test"}).status_code
        == 200
    )


def test_n_choices_each_draw_from_their_own_seed_and_share_the_prompts_prefill(client, workers):
    """Seeded, choice i is the request with seed + i (vLLM's rule), so a request repeats all its
    choices; every choice after a prompt's first finds the prompt in the prefix cache."""
    prompt = repeating_prompt(5, length=64, vocab_size=49152)

    def ask(**fields):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, **fields)

    reply = ask(n=3, seed=11)
    texts = [choice.text for choice in reply.choices]
    assert [choice.index for choice in reply.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert [choice.text for choice in ask(n=3, seed=11).choices] == texts
    assert [ask(seed=11 + index).choices[0].text for index in range(3)] == texts
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 24  # the prompt once
    hits = [choice.model_extra["speculative"]["prefix_cache_hits"] for choice in reply.choices]
    assert all(hit >= 48 for hit in hits[1:]), hits
    batch = client.completions.create(model="tiny", prompt=[prompt, prompt[:40]], max_tokens=4, temperature=0, n=2)
    assert [choice.index for choice in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text and batch.usage.prompt_tokens == len(prompt) + 40
    stream = ask(n=2, seed=3, stream=True, stream_options={"include_usage": True})
    streamed, usage = ["", ""], None
    for chunk in stream:
        if chunk.choices:
            streamed[chunk.choices[0].index] += chunk.choices[0].text
        usage = chunk.usage or usage
    assert streamed == [choice.text for choice in ask(n=2, seed=3).choices]
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 16
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2)
    assert [choice.index for choice in chat.choices] == [0, 1]
    for fields in ({"n": 17}, {"n": 2, "prompt": [prompt] * 65}):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(**{"model": "tiny", "prompt": prompt, "max_tokens": 2, **fields})
        assert raised.value.body["param"] in ("n", "prompt")
    assert workers.engine.session_counts() == {"draft": 0, "target": 0}


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}


def test_response_format_and_vllms_structured_outputs_constrain_the_served_output(client, engine):
    """Through the SDK: OpenAI's json_schema response format and vLLM's structured_outputs give
    valid output, token for token the in-process engine's (the server masks whole rows)."""
    import jsonschema

    messages = [{"role": "user", "content": "Answer as JSON."}]
    for drafter in ("none", "model"):
        reply = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=40,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}},
            extra_body={"drafter": drafter},
        )
        assert reply.choices[0].message.content.lstrip().startswith("{")  # a random model pads with spaces
        sampling = {"max_tokens": 40, "structured_output": {"json_schema": SCHEMA}}
        local = engine.complete(GenerationRequest(messages=messages, drafter={"name": drafter}, sampling=sampling))
        assert reply.choices[0].model_extra["token_ids"] == local.token_ids
        compact = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=40,
            temperature=0,
            extra_body={"drafter": drafter, "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        )
        jsonschema.validate(json.loads(compact.choices[0].message.content), SCHEMA)
    choice = client.completions.create(
        model="tiny",
        prompt="Pick:",
        max_tokens=8,
        temperature=0.9,
        extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
    )
    assert choice.choices[0].text in ("red", "blue")
    legacy = client.completions.create(
        model="tiny", prompt="Code:", max_tokens=8, temperature=0, extra_body={"guided_regex": "[A-Z]{3}"}
    )
    assert re.fullmatch("[A-Z]{3}", legacy.choices[0].text)
