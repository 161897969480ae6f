"""Suffix decoding served: the drafters run on the draft worker over its own suffix trees, reached
through the HTTP API and the gRPC API (tiny random models behind SmolLM2's tokenizer). Served
tokens equal the in-process engine's and target-only's at T = 0; the draft worker's shared tree
fills from earlier answers, and an opted-out request neither feeds nor reads it."""

from __future__ import annotations

import pytest

from helpers.tiny_models import perturbed_copy, tiny_llama

pytest.importorskip("grpc")
pytest.importorskip("fastapi")

from helpers.served import Workers, http_client  # noqa: E402

pytestmark = pytest.mark.needs_smollm2  # SmolLM2's tokenizer

from deployments.config import AppConfig  # noqa: E402
from deployments.workers.draft_service import DraftService  # noqa: E402
from specdec_core import GenerationRequest, ModelSpec, SpeculativeEngine  # noqa: E402
from specdec_core.models.loader import load_tokenizer  # noqa: E402

PROMPT = "one two three four five six, one two three four five six, one two three"


@pytest.fixture(scope="module")
def served():
    tokenizer = load_tokenizer(ModelSpec())
    target = tiny_llama(vocab_size=len(tokenizer))
    engine = SpeculativeEngine(target, tokenizer, perturbed_copy(target, 0.002))
    draft = DraftService(engine.draft_model, engine.target_model.config, 60.0, tokenizer=tokenizer)
    workers = Workers(engine, draft=draft)
    yield engine, workers, draft
    workers.stop()


def body(drafter: str, params: dict) -> dict:
    return {
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "policy": {"name": "greedy"},
        "drafter": {"name": drafter, "params": params},
        "num_draft_tokens": 6,
    }


@pytest.mark.parametrize(
    "drafter, params", [("suffix", {}), ("suffix_tree", {}), ("mla", {"lookup": "suffix"})], ids=str
)
def test_served_suffix_decoding_equals_the_engine_over_http_and_grpc(served, drafter, params):
    from deployments.client import SpecdecGrpcClient
    from deployments.ingress.grpc_ingress import GrpcIngress

    engine, workers, _ = served
    client = http_client(workers)
    scope = {"suffix_scope": f"wire-{drafter}"}
    reply = client.post("/v1/completions", json=body(drafter, {**params, **scope}))
    assert reply.status_code == 200, reply.text
    request = GenerationRequest(
        prompt=PROMPT,
        policy={"name": "greedy"},
        drafter={"name": drafter, "params": {**params, **scope}},
        num_draft_tokens=6,
        sampling={"max_tokens": 24},
    )
    local = engine.complete(request)
    served_tokens = reply.json()["choices"][0]["token_ids"]
    assert served_tokens == local.token_ids == engine.complete(request.model_copy(update={"drafter": None})).token_ids
    assert (
        reply.json()["speculative"]["spec_decode_num_accepted_tokens"]
        == local.metrics["spec_decode_num_accepted_tokens"]
    )
    ingress = GrpcIngress(workers.engine, AppConfig(grpc_port=0))
    try:
        over_grpc = SpecdecGrpcClient(f"127.0.0.1:{ingress.port}").generate(request)
    finally:
        ingress.stop()
    assert over_grpc["token_ids"] == served_tokens and not over_grpc["speculative"]["draft_fallback"]


def accepted(client, params: dict) -> int:
    reply = client.post("/v1/completions", json=body("suffix", params))
    assert reply.status_code == 200, reply.text
    return reply.json()["speculative"]["spec_decode_num_accepted_tokens"]


def test_the_draft_workers_shared_tree_fills_from_earlier_answers(served):
    _, workers, _ = served
    client = http_client(workers)
    private = accepted(client, {"suffix_scope": "fills", "suffix_share": False})
    first = accepted(client, {"suffix_scope": "fills"})
    assert first == private  # the opted-out answer never entered the tree
    assert accepted(client, {"suffix_scope": "fills"}) > first
    assert accepted(client, {"suffix_scope": "fills", "suffix_share": False}) == private
    assert workers.engine.session_counts() == {"draft": 0, "target": 0}


def held_tokens(suffixes, scope: str) -> int:
    return sum(tokens for (held_scope, _), tokens in suffixes.held.items() if held_scope == scope)


def test_a_served_answer_enters_the_shared_tree_whole(served):
    """The tokens committed after a session's last proposal ride on its Release: the draft
    worker's tree holds every committed token, as the in-process engine's does."""
    engine, workers, draft = served
    reply = http_client(workers).post("/v1/completions", json=body("suffix", {"suffix_scope": "whole"}))
    assert reply.status_code == 200, reply.text
    local = engine.complete(
        GenerationRequest(
            prompt=PROMPT,
            drafter={"name": "suffix", "params": {"suffix_scope": "whole"}},
            num_draft_tokens=6,
            sampling={"max_tokens": 24},
        )
    )
    assert held_tokens(draft.suffixes, "whole") == held_tokens(engine.suffixes, "whole") >= len(local.token_ids) == 24
