"""A draining server replica (deployments/ingress/drain.py) over in-process workers: new requests get
503 with Retry-After and /health says draining, a stream in flight that finishes within the grace
period completes, and one still running when it ends gets an error event and [DONE], never a cut.
`specdec drain-check` measures the same through SIGTERM to `specdec serve` (docs/serving.md)."""

from __future__ import annotations

import json
import time

import pytest

from helpers.served import Workers, http_client
from helpers.tiny_models import repeating_prompt

pytest.importorskip("fastapi")

from deployments.checks.drain_check import stream_end  # noqa: E402
from deployments.checks.probe_client import Outcome  # noqa: E402


def events(lines) -> list:
    """A stream's events (its lines left): its chunks' JSON, then "[DONE]"."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line]


def body(max_tokens: int, stream: bool = True) -> dict:
    # target-only: a token a step, so the long stream surely outlasts the grace period
    return {
        "prompt": repeating_prompt(3),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "drafter": "none",
    }


@pytest.fixture
def draining(tiny_engine):
    workers = Workers(tiny_engine)
    yield workers, http_client(workers)
    workers.stop()


def test_a_draining_replica_refuses_new_requests_and_ends_late_streams_with_an_error_event(draining):
    workers, client = draining
    drain = workers.engine.drain
    with (
        client.stream("POST", "/v1/completions", json=body(990)) as late,
        client.stream("POST", "/v1/completions", json=body(4)) as short,
    ):
        late_lines = late.iter_lines()
        assert next(late_lines).startswith("data: ")
        drain.deadline = time.time() + 60  # draining, the grace period running
        refused = client.post("/v1/completions", json=body(8, stream=False))
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert "shutting down" in refused.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        finished = events(short.iter_lines())
        assert finished[-1] == "[DONE]" and finished[-2]["choices"][0]["finish_reason"] == "length"
        drain.deadline = time.time() - 1  # the grace period is over
        ended = events(late_lines)
    assert ended[-1] == "[DONE]" and ended[-2]["error"]["code"] == "worker_unavailable"
    assert "grace period" in ended[-2]["error"]["message"]
    assert sum(len(event["choices"][0]["token_ids"]) for event in ended[:-2] if "choices" in event) < 989


def test_drain_check_names_how_each_stream_ended():
    assert stream_end(Outcome(stream=True, status=200, done=True, finish_reason="stop")) == "completed"
    assert stream_end(Outcome(stream=True, status=200, done=True, error={"code": "worker_unavailable"})) == (
        "error event: worker_unavailable"
    )
    assert stream_end(Outcome(stream=True, status=200, finish_reason="length")) == "cut"  # no [DONE]
    assert stream_end(Outcome(stream=True, problem="lost: RemoteProtocolError")) == "cut"
    assert stream_end(Outcome(stream=True, problem="hung: no answer within 300 s")) == "hung"
    assert stream_end(Outcome(stream=True, status=503, retry_after="5")) == "status 503 + Retry-After"
