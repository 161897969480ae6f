"""deploy_check.py's client side against the HTTP API over in-process workers: a start is measured
as a client that checks /v1/models first meets it (test_serve.py starts and redeploys the real
app; `specdec start-check` and `specdec rollout-check` drive `specdec serve` and `serve deploy`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from deployments.checks.deploy_check import Client, first_listing, service_url
from specdec_core import ModelSpec, SpeculativeEngine
from specdec_core.models.loader import load_tokenizer

from helpers.served import HttpServer, Workers
from helpers.tiny_models import perturbed_copy, tiny_llama

pytestmark = pytest.mark.needs_smollm2  # SmolLM2's tokenizer and chat template

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine():
    tokenizer = load_tokenizer(ModelSpec())
    target = tiny_llama(seed=6, vocab_size=len(tokenizer))
    return SpeculativeEngine(target, tokenizer, perturbed_copy(target, 0.002))


def test_the_configs_address_and_model_are_the_ones_served():
    assert service_url(ROOT / "cluster" / "local.yaml") == ("http://127.0.0.1:8000", "specdec-smollm2-135m")


def test_a_start_is_listed_only_with_a_target_and_the_chat_sent_then_is_served(engine):
    workers = Workers(engine)
    server = HttpServer(workers)
    try:
        start = first_listing(server.url, "tiny", time.perf_counter(), limit_s=30)
        assert start.listed_s is not None and start.chat_status == 200 and start.before == []
        client = Client(server.url, "tiny")
        time.sleep(0.5)
        client.close()
        assert {status for _, status, _ in client.sent} == {200} and len({ids for *_, ids in client.sent}) == 1
        workers.servers["target"].stop(None)
        never = first_listing(server.url, "tiny", time.perf_counter(), limit_s=1.0)
        assert never.listed_s is None and never.chat_status is None and never.before == ["503"]
    finally:
        server.stop()
        workers.stop()
