"""clients_check.py against the HTTP API over in-process workers (a tiny random target behind
SmolLM2's tokenizer): the openai SDK, lm-evaluation-harness through both its OpenAI model types
(generate_until and the log-likelihood path) and guidellm at two concurrencies, unmodified, each
compared with the target in process. `specdec clients-check` runs the same checks, longer, against
the embedded service."""

from __future__ import annotations

import pytest

from helpers.tiny_models import perturbed_copy, tiny_llama

pytest.importorskip("lm_eval")
pytest.importorskip("guidellm")

from deployments.checks.clients_check import ClientsCheck  # noqa: E402
from specdec_core import ModelSpec, SpeculativeEngine  # noqa: E402
from specdec_core.models.loader import load_tokenizer  # noqa: E402

from helpers.served import HttpServer, Workers  # noqa: E402

pytestmark = pytest.mark.needs_smollm2  # SmolLM2's tokenizer


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    tokenizer = load_tokenizer(ModelSpec())
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    target = tiny_llama(seed=6, vocab_size=len(tokenizer))
    engine = SpeculativeEngine(target, tokenizer, perturbed_copy(target, 0.002))
    workers = Workers(engine)
    server = HttpServer(workers)
    yield ClientsCheck(server.url, tokenizer_dir, engine)
    server.stop()
    workers.stop()


def test_the_openai_sdk_gets_what_the_target_gives(check):
    check.openai_sdk()
    assert [row.name for row in check.checks if row.part == "openai" and not row.passed] == []


def test_lm_eval_runs_both_model_types_and_its_log_likelihoods_are_the_targets(check):
    results = check.lm_eval(
        limit=3, gen_kwargs={"policy": "greedy", "drafter": "model", "max_gen_toks": 24}, concurrency=2
    )
    failed = [(row.name, row.result) for row in check.checks if row.part == "lm-eval" and not row.passed]
    assert failed == [] and len([row for row in check.checks if row.part == "lm-eval"]) == 3
    assert len(results["local-completions mc"]["samples"]) == 3


def test_guidellm_gets_every_token_it_asks_for(check, tmp_path):
    rows = check.guidellm([1, 3], [3, 6], prompt_tokens=32, output_tokens=12, out=tmp_path)
    assert [row["concurrency"] for row in rows] == [1, 3]
    assert all(row["ok"] == count and row["mean_output_tokens"] == 12 for row, count in zip(rows, [3, 6]))
    assert [row.name for row in check.checks if row.part == "guidellm" and not row.passed] == []


def test_guidellm_passes_the_speculative_fields_through_its_backend_extras(check, tmp_path):
    """A drafter the service does not know fails every request: the field reached it."""
    refused = ClientsCheck(check.url, check.tokenizer_dir, check.engine)
    rows = refused.guidellm([1], [2], prompt_tokens=16, output_tokens=4, out=tmp_path, extra_body={"drafter": "nope"})
    assert rows[0]["errored"] == 2 and rows[0]["ok"] == 0 and refused.failed


def test_every_client_sends_the_api_key(check, tmp_path):
    workers = Workers(check.engine)
    server = HttpServer(workers, api_key="sk-test")
    try:
        keyed = ClientsCheck(server.url, check.tokenizer_dir, check.engine, api_key="sk-test")
        keyed.openai_sdk()
        keyed.lm_eval(limit=1, gen_kwargs={"max_gen_toks": 4}, concurrency=1)
        keyed.guidellm([1], [2], prompt_tokens=16, output_tokens=4, out=tmp_path)
        assert [row.name for row in keyed.checks if not row.passed] == [] and len(keyed.checks) == 8
    finally:
        server.stop()
        workers.stop()
