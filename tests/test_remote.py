"""The served engine over real gRPC draft and target workers (in-process servers, tiny models),
and the HTTP API over it without Ray: token-identical to the in-process engine for every policy,
compact wire, session cleanup and expiry, and what each kind of worker failure does to a
request (fallback, 503, 500 with a request id, an error event mid-stream)."""

from __future__ import annotations

import json
import logging
import time

import pytest
from conftest import repeating_prompt

pytest.importorskip("grpc")
pytest.importorskip("fastapi")

import grpc  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from deployments.config import AppConfig  # noqa: E402
from deployments.http_ingress import build_http_app  # noqa: E402
from deployments.remote_engine import RemoteEngine  # noqa: E402
from deployments.servicers import DraftServicer, TargetServicer, start_server  # noqa: E402
from deployments.watcher import WorkerWatcher  # noqa: E402
from deployments.wire import component_to_proto, sampling_to_proto  # noqa: E402
from protos import specdec_pb2 as pb  # noqa: E402
from protos import specdec_pb2_grpc as pb_grpc  # noqa: E402
from specdec_core import GenerationRequest, SpecdecError  # noqa: E402
from specdec_core.policies import POLICIES  # noqa: E402
from specdec_core.request import ComponentSpec  # noqa: E402
from specdec_core.sampling import SamplingParams  # noqa: E402

ADD = {"draft": pb_grpc.add_DrafterServicer_to_server, "target": pb_grpc.add_TargetServicer_to_server}


class Workers:
    """In-process draft and target servers and an engine pointed at them."""

    def __init__(self, engine, draft=None, target=None, deadline_s: float = 30.0, idle_timeout_s: float = 60.0):
        servicers = {
            "draft": draft or DraftServicer(engine.draft_model, idle_timeout_s),
            "target": target or TargetServicer(engine.target_model, idle_timeout_s),
        }
        self.servers, addresses = {}, {}
        for role, servicer in servicers.items():
            self.servers[role], port = start_server(servicer, ADD[role])
            addresses[role] = f"127.0.0.1:{port}"
        self.engine = RemoteEngine(engine.frontend, addresses, deadline_s)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop(None)


@pytest.fixture(scope="module")
def cluster(tiny_engine):
    workers = Workers(tiny_engine)
    yield workers.engine
    workers.stop()


def request(policy, drafter, temperature=0.0, k=6, **policy_params):
    return GenerationRequest(
        prompt_ids=repeating_prompt(7),
        policy={"name": policy, "params": policy_params},
        drafter={"name": drafter},
        num_draft_tokens=k,
        sampling={"max_tokens": 32, "temperature": temperature, "seed": 5},
    )


def remote_complete(engine, req):
    chunks = list(engine.stream(req))
    return [token for chunk in chunks for token in chunk.token_ids], chunks[-1].metrics


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_remote_output_equals_in_process_engine(cluster, tiny_engine, policy, temperature):
    if temperature > 0 and not POLICIES[policy].supports_sampling:
        pytest.skip("greedy-only policy")
    for drafter in ("model", "pld"):
        req = request(policy, drafter, temperature)
        tokens, metrics = remote_complete(cluster, req)
        local = tiny_engine.complete(req)
        assert tokens == local.token_ids
        assert metrics["spec_decode_num_accepted_tokens"] == local.metrics["spec_decode_num_accepted_tokens"]
        assert not metrics["draft_fallback"]


def test_compact_wire_ships_a_fraction_of_the_full_logits(cluster):
    _, greedy = remote_complete(cluster, request("greedy", "model"))
    _, fly = remote_complete(cluster, request("fly", "model"))
    _, sampled = remote_complete(cluster, request("rejection", "model", temperature=0.8))
    assert greedy["wire_bytes_per_step"] < 0.05 * greedy["full_logits_bytes_per_step"]
    assert fly["wire_bytes_per_step"] < 0.1 * fly["full_logits_bytes_per_step"]
    assert sampled["wire_bytes_per_step"] > sampled["full_logits_bytes_per_step"]  # rows + draft logits


def test_sessions_are_freed_on_finish_and_on_abandoned_streams(cluster):
    remote_complete(cluster, request("greedy", "model"))
    assert cluster.session_counts() == {"draft": 0, "target": 0}
    stream = cluster.stream(request("greedy", "model"))
    next(stream)
    assert cluster.session_counts() == {"draft": 1, "target": 1}
    stream.close()  # what a client disconnect does to the generator
    assert cluster.session_counts() == {"draft": 0, "target": 0}


def test_a_released_or_idle_session_is_not_found(tiny_engine):
    """A worker forgets a session on Release and after its idle timeout (no sweeper thread: the
    next Reset or Stats drops it); a call on it gets NOT_FOUND."""
    workers = Workers(tiny_engine, idle_timeout_s=0.5)
    stub = workers.engine.stubs["target"]
    greedy = component_to_proto(ComponentSpec(name="greedy"))
    prompt, sampling = repeating_prompt(7), sampling_to_proto(SamplingParams())
    try:
        for session in ("released", "idle"):
            stub.Reset(pb.TargetReset(session_id=session, prompt_ids=prompt, sampling=sampling, policy=greedy))
            stub.Score(pb.ScoreRequest(session_id=session, tokens=[prompt[-1]]))
        stub.Release(pb.SessionRef(session_id="released"))
        assert stub.Stats(pb.Empty()).sessions == 1
        time.sleep(0.6)
        assert stub.Stats(pb.Empty()).sessions == 0
        for session in ("released", "idle", "never-opened"):
            with pytest.raises(grpc.RpcError) as failure:
                stub.Score(pb.ScoreRequest(session_id=session, tokens=[prompt[-1]]))
            assert failure.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        workers.stop()


def test_bad_requests_are_rejected_before_any_session(cluster):
    with pytest.raises(SpecdecError, match="unknown policy"):
        cluster.stream(request("nope", "model"))
    with pytest.raises(SpecdecError, match="bad parameters for drafter 'pld'"):
        cluster.stream(GenerationRequest(prompt_ids=[1, 2], drafter={"name": "pld", "params": {"max_ngram": 0}}))
    assert cluster.session_counts() == {"draft": 0, "target": 0}


def test_draft_worker_failure_falls_back_to_target_only(tiny_engine):
    workers = Workers(tiny_engine, deadline_s=5)
    req = request("greedy", "model")
    stream = workers.engine.stream(req)
    tokens = list(next(stream).token_ids)
    workers.servers["draft"].stop(None)  # the draft worker dies mid-request
    chunks = list(stream)
    tokens += [token for chunk in chunks for token in chunk.token_ids]
    assert chunks[-1].metrics["draft_fallback"] is True
    assert tokens == tiny_engine.complete(req).token_ids  # greedy: same tokens, target-only
    workers.stop()


def test_the_watcher_reconnects_a_worker_that_came_back_elsewhere(tiny_engine):
    """The draft worker dies and a new one starts on another port: requests fall back until the
    watcher's next round repoints the engine, then speculate again. No request waits on it."""
    workers = Workers(tiny_engine, deadline_s=5)
    engine = workers.engine
    addresses = {"draft": "127.0.0.1:1", "target": "unused"}  # what the lookup answers now
    watcher = WorkerWatcher(
        addresses.__getitem__, engine.connect, {"draft": "old", "target": "unused"}, interval_s=3600
    )
    try:
        workers.servers["draft"].stop(None)
        assert remote_complete(engine, request("greedy", "model"))[1]["draft_fallback"] is True
        replacement, port = start_server(DraftServicer(tiny_engine.draft_model), ADD["draft"])
        addresses["draft"] = f"127.0.0.1:{port}"
        watcher.check()
        _, metrics = remote_complete(engine, request("greedy", "model"))
        assert metrics["draft_fallback"] is False and metrics["spec_decode_num_drafts"] > 0
        replacement.stop(None)
    finally:
        watcher.stop()
        workers.stop()


class ResetRaises(DraftServicer):
    """A draft worker with a bug in Reset."""

    def Reset(self, request, context):
        raise RuntimeError("draft reset exploded")


class ScoreRaisesLater(TargetServicer):
    """A target worker whose third Score fails with a bug (after the stream has begun)."""

    def Score(self, request, context):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise RuntimeError("score exploded")
        return super().Score(request, context)


def http_client(workers: Workers) -> TestClient:
    return TestClient(build_http_app(workers.engine, AppConfig(model_name="tiny")))


def completion_body(**fields) -> dict:
    return {"prompt": repeating_prompt(7), "max_tokens": 24, "temperature": 0, "drafter": "model", **fields}


def test_a_bug_in_the_draft_worker_is_a_500_with_a_request_id_not_a_fallback(tiny_engine, caplog):
    workers = Workers(tiny_engine, draft=ResetRaises(tiny_engine.draft_model))
    try:
        with caplog.at_level(logging.ERROR, logger="deployments"):
            response = http_client(workers).post("/v1/completions", json=completion_body())
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        request_id = error["message"].split("request id ")[1].rstrip(")")
        assert len(request_id) == 32 and "exploded" not in response.text  # no worker internals leak
        assert f"request {request_id} failed" in caplog.text and "Traceback" in caplog.text
        assert workers.engine.session_counts() == {"draft": 0, "target": 0}
    finally:
        workers.stop()


def test_a_gone_target_worker_is_a_503_with_retry_after(tiny_engine):
    workers = Workers(tiny_engine, deadline_s=5)
    client = http_client(workers)
    try:
        assert client.post("/v1/completions", json=completion_body()).status_code == 200
        workers.servers["target"].stop(None)
        for stream in (False, True):
            response = client.post("/v1/completions", json=completion_body(stream=stream))
            assert response.status_code == 503, response.text
            assert response.headers["Retry-After"] == "5"
            assert response.json()["error"]["code"] == "worker_unavailable"
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["down"] == ["target"]
    finally:
        workers.stop()


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done(tiny_engine):
    workers = Workers(tiny_engine, target=ScoreRaisesLater(tiny_engine.target_model))
    try:
        with http_client(workers).stream("POST", "/v1/completions", json=completion_body(stream=True)) as response:
            assert response.status_code == 200
            events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "internal_error" and "request id" in error["message"]
        assert all("choices" in json.loads(event) for event in events[:-2]) and len(events) > 3
        assert workers.engine.session_counts() == {"draft": 0, "target": 0}
    finally:
        workers.stop()


def test_http_matches_the_engine_and_rejects_bad_input_once(tiny_engine, cluster):
    client = TestClient(build_http_app(cluster, AppConfig(model_name="tiny")))
    body = completion_body(policy={"name": "fly"})
    payload = client.post("/v1/completions", json=body).json()
    local = tiny_engine.complete(
        GenerationRequest(
            prompt_ids=body["prompt"], policy={"name": "fly"}, drafter={"name": "model"}, sampling={"max_tokens": 24}
        )
    )
    assert payload["choices"][0]["token_ids"] == local.token_ids
    assert payload["id"].startswith("cmpl-") and "loose" in payload["speculative"]
    for fields, status, message, param in [
        ({"max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        ({"num_draft_tokens": 500}, 400, "num_draft_tokens", "num_draft_tokens"),
        ({"policy": {"name": "greedy"}, "temperature": 0.5}, 400, "needs temperature 0", None),
    ]:
        response = client.post("/v1/completions", json=completion_body(**fields))
        assert response.status_code == status and message in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == param
    bad_utf8 = client.post(
        "/v1/completions", content=b'{"prompt": "\xff"}', headers={"Content-Type": "application/json"}
    )
    assert bad_utf8.status_code == 400 and "malformed JSON" in bad_utf8.json()["error"]["message"]
    assert cluster.session_counts() == {"draft": 0, "target": 0}
