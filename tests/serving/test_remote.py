"""The served engine over real gRPC draft and target workers (in-process servers, tiny models),
and the HTTP API over it without Ray: token-identical to the in-process engine for every policy,
compact wire, session cleanup and expiry, and what each kind of worker failure does to a
request (fallback, 503, 500 with a request id, an error event mid-stream)."""

from __future__ import annotations

import functools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers.reference_scores import target_rows
from helpers.served import ADD, Workers, http_client, listening_addresses
from helpers.tiny_models import repeating_prompt

pytest.importorskip("grpc")
pytest.importorskip("fastapi")

import grpc  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from deployments.checks.hostile_inputs import GRPC_CASES, HttpCase, http_cases  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from deployments.coordination.wire import component_to_proto, sampling_to_proto, tensor_to_proto  # noqa: E402
from deployments.ingress.error_replies import WorkerUnavailable  # noqa: E402
from deployments.ingress.http_ingress import build_http_app  # noqa: E402
from deployments.ingress.remote_engine import RemoteEngine  # noqa: E402
from deployments.workers.draft_service import DraftService  # noqa: E402
from deployments.workers.servicers import DraftServicer, TargetServicer, checked, start_server  # noqa: E402
from deployments.workers.target_service import TargetService  # noqa: E402
from deployments.workers.worker_ops import OpenDraft, TargetRow  # noqa: E402
from protos import specdec_pb2 as pb  # noqa: E402
from protos import specdec_pb2_grpc as pb_grpc  # noqa: E402
from specdec_core import GenerationRequest, SpecdecError  # noqa: E402
from specdec_core.api.request import ComponentSpec  # noqa: E402
from specdec_core.api.sampling import SamplingParams  # noqa: E402
from specdec_core.policies import POLICIES  # noqa: E402
from specdec_core.trees.topologies import default_bank  # noqa: E402


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
        # sampled rules that decide from rows and draws alone are decided on the target worker
        assert metrics["verdicts_on_target"] == (temperature > 0 and policy in ("rejection", "typical"))


@pytest.mark.parametrize(
    ("policy", "drafter"), [("rejection", "model"), ("typical", "pld"), ("rejection", "model_tree")]
)
def test_sampled_verdicts_decided_on_the_target_apply_the_servers_rules(cluster, tiny_engine, policy, drafter):
    """The target worker decides a sampled request's verdicts beside its rows, after the rules the
    server's loop applies to them (penalties, logit_bias, min_tokens' stops): the in-process
    engine's tokens, under a seed."""
    free = tiny_engine.complete(request(policy, drafter, 0.8)).token_ids
    sampling = {
        "max_tokens": 32,
        "temperature": 0.8,
        "seed": 5,
        "min_tokens": 12,
        "stop_token_ids": free[2:4],  # tokens it would make early: held back within min_tokens
        "presence_penalty": 0.5,
        "repetition_penalty": 1.2,
        "logit_bias": {free[6]: 3.0},
    }
    req = request(policy, drafter, 0.8).model_copy(update={"sampling": SamplingParams(**sampling)})
    tokens, metrics = remote_complete(cluster, req)
    assert metrics["verdicts_on_target"]
    assert tokens == tiny_engine.complete(req).token_ids
    assert not set(free[2:4]) & set(tokens[:12])


def test_a_target_that_does_not_decide_verdicts_sends_its_rows(tiny_engine, monkeypatch):
    """A target that does not say it decides (an older one, or one that declines) gets the server's
    verdicts from its rows: the same tokens."""
    monkeypatch.setattr("deployments.workers.target_service.decides_on_target", lambda policy, sampling: False)
    workers = Workers(tiny_engine)
    try:
        req = request("rejection", "model", 0.8)
        tokens, metrics = remote_complete(workers.engine, req)
    finally:
        workers.stop()
    assert not metrics["verdicts_on_target"]
    assert metrics["wire_bytes_per_step"] > metrics["full_logits_bytes_per_step"]  # the rows and the draft's
    assert tokens == tiny_engine.complete(req).token_ids


@pytest.mark.parametrize(
    ("policy", "temperature", "drafter"),
    [
        (policy, temperature, drafter)
        for policy, temperature in (("greedy", 0.0), ("rejection", 0.8))
        for drafter in ("model", "mla")
    ]
    + [("greedy", 0.0, "model_tree"), ("typical", 0.8, "mla_tree")],
)
def test_run_ahead_serves_the_in_process_tokens(cluster, tiny_engine, policy, temperature, drafter):
    """Served, the ahead proposal (a chain or a tree) runs on the draft worker while the target
    worker verifies; the tokens and the proposals used and dropped are the in-process engine's
    (where they run one after the other), and at T = 0 target-only's, with the ahead blocks
    forwarded to the target worker and scored there before the server asks."""
    req = request(policy, drafter, temperature).model_copy(update={"run_ahead": True})
    tokens, metrics = remote_complete(cluster, req)
    local = tiny_engine.complete(req)
    assert tokens == local.token_ids
    for count in ("used", "discarded"):
        assert metrics["run_ahead"][count] == local.metrics["run_ahead"][count]
    assert not metrics["draft_fallback"]
    if temperature == 0:  # (sampled from the random tiny target, a bonus is seldom the guess)
        assert tokens == tiny_engine.complete(request(policy, "none")).token_ids
        # a tree's top-1 path is seldom the branch kept on these near-flat logits (the sharp
        # target of tests/core/test_run_ahead.py uses tree proposals)
        assert metrics["run_ahead"]["used"] > 0 or drafter.endswith("tree")
    # these verdicts are the target's to decide (greedy from its rows, sampled beside them): the
    # draft worker forwards its ahead blocks there (whether each is scored before its Score is a
    # race: test_forwarded_blocks.py counts them)
    assert metrics["run_ahead"]["forwarded"] <= metrics["run_ahead"]["used"]


@pytest.mark.parametrize(
    ("policy", "temperature", "drafter", "tree"),
    [("greedy", 0.0, "model_tree", "mc_sim_7b_63"), ("typical", 0.8, "model_tree", "mc_sim_7b_63")]
    + [("greedy", 0.0, "mla_tree", "spine_8x2")],
)
def test_draft_model_trees_travel_the_wire(cluster, tiny_engine, policy, temperature, drafter, tree):
    """Trees go out as node tokens + a tree name (NAME@DEPTH near the end) and their commits as
    paths: the served tokens and acceptance equal the in-process engine's."""
    req = GenerationRequest(
        prompt_ids=repeating_prompt(7),
        policy={"name": policy},
        # the whole tree (the tiny draft's near-flat probabilities would keep no node in the budget)
        drafter={"name": drafter, "params": {"tree": tree, "adaptive": False}},
        num_draft_tokens=6,
        sampling={"max_tokens": 32, "temperature": temperature, "seed": 5},
    )
    tokens, metrics = remote_complete(cluster, req)
    local = tiny_engine.complete(req)
    assert tokens == local.token_ids and not metrics["draft_fallback"]
    assert metrics["spec_decode_num_accepted_tokens"] == local.metrics["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize(("policy", "temperature"), [("greedy", 0.0), ("typical", 0.8), ("rejection", 0.8)])
@pytest.mark.parametrize("heads", ["medusa", "hydra"])
def test_heads_trees_come_from_the_target_worker(request, heads, policy, temperature):
    """The heads drafter asks the target worker for its heads' guesses (Heads, which carries the
    last commit) and uses no draft worker; the served tokens, acceptance and tree choices of a
    binary_tau scheduler equal the in-process engine's, with Medusa's heads and with Hydra's."""
    heads_engine = request.getfixturevalue("heads_engine" if heads == "medusa" else "hydra_engine")
    target = TargetService(heads_engine.target_model, 60.0, heads_engine.frontend.profile(), heads=heads_engine.heads)
    workers = Workers(heads_engine, target=target)
    params = {"scheduler": "binary_tau", "tree": "chain_2", "aggressive": "mc_sim_7b_63", "tau_on": 5e-4}
    req = GenerationRequest(
        prompt_ids=repeating_prompt(1),
        policy={"name": policy},
        drafter={"name": "heads", "params": {**params, "score": "path_value"}},
        sampling={"max_tokens": 32, "temperature": temperature, "seed": 5},
    )
    try:
        tokens, metrics = remote_complete(workers.engine, req)
        local = heads_engine.complete(req)
        assert tokens == local.token_ids
        assert metrics["tree_steps"] == local.metrics["tree_steps"] and len(metrics["tree_steps"]) > 1
        accepted = metrics["spec_decode_num_accepted_tokens"]
        assert accepted == local.metrics["spec_decode_num_accepted_tokens"]
        # (rejection accepts a node with its target probability: about 1 / V in these flat rows)
        assert accepted > 0 or policy == "rejection"
        assert workers.stubs["draft"].Stats(pb.Empty()).requests == 0
    finally:
        workers.stop()


@pytest.mark.parametrize(
    ("policy", "temperature", "params"),
    [
        ("greedy", 0.0, {}),
        ("greedy", 0.0, {"dynamic": True, "nodes": 24}),
        ("typical", 0.8, {"tree": "medusa_16"}),
        ("rejection", 0.8, {"dynamic": True, "nodes": 24}),
    ],
)
def test_eagle3_chains_and_dynamic_trees_come_from_the_target_worker(eagle3_engine, policy, temperature, params):
    """The eagle3 drafter asks the target worker's EAGLE-3 layer (a dynamic tree comes back by its
    paths): the served tokens, acceptance and trees equal the in-process engine's."""
    target = TargetService(
        eagle3_engine.target_model, 60.0, eagle3_engine.frontend.profile(), heads=eagle3_engine.heads
    )
    workers = Workers(eagle3_engine, target=target)
    req = GenerationRequest(
        prompt_ids=repeating_prompt(1),
        policy={"name": policy},
        drafter={"name": "eagle3", "params": params},
        sampling={"max_tokens": 32, "temperature": temperature, "seed": 5},
    )
    try:
        assert dict(workers.stubs["target"].Profile(pb.Empty()).heads) == {"medusa": 3, "eagle3": 8}
        tokens, metrics = remote_complete(workers.engine, req)
        local = eagle3_engine.complete(req)
        assert tokens == local.token_ids
        assert metrics["tree_steps"] == local.metrics["tree_steps"]
        assert metrics["spec_decode_num_accepted_tokens"] == local.metrics["spec_decode_num_accepted_tokens"]
    finally:
        workers.stop()


def test_a_target_worker_checks_heads_calls(heads_engine, tiny_engine):
    """A heads session on a target without heads, an unknown tree or a bad root, and a commit sent
    twice are refused."""
    with_medusa = TargetService(
        heads_engine.target_model, 60.0, heads_engine.frontend.profile(), heads=heads_engine.heads
    )
    workers = {"heads": Workers(heads_engine, target=with_medusa), "none": Workers(tiny_engine)}
    prompt, greedy = repeating_prompt(7), component_to_proto(ComponentSpec(name="greedy"))
    reset = pb.TargetReset(
        session_id="s",
        prompt_ids=prompt,
        sampling=sampling_to_proto(SamplingParams()),
        policy=greedy,
        heads_kind="medusa",
    )
    try:
        assert not workers["none"].stubs["target"].Profile(pb.Empty()).heads
        assert workers["none"].stubs["target"].Profile(pb.Empty()).device_type == "cpu"
        with pytest.raises(grpc.RpcError, match="no medusa heads"):
            workers["none"].stubs["target"].Reset(reset)
        stub = workers["heads"].stubs["target"]
        stub.Reset(reset)
        num_heads = heads_engine.heads["medusa"].num_heads
        assert dict(stub.Profile(pb.Empty()).heads) == {"medusa": num_heads}
        first = stub.Heads(pb.HeadsRequest(session_id="s", root_token=prompt[-1], tree="mc_sim_7b_63"))
        cut = f"mc_sim_7b_63@{num_heads}"  # the tree cut to the heads' depth
        assert first.tree == cut and list(first.tokens.shape) == [default_bank().get(cut).num_nodes]
        for fields, message in [
            ({"root_token": -1, "tree": "chain_2"}, "root_token"),
            ({"root_token": 1, "tree": "nope"}, "unknown tree"),
        ]:
            with pytest.raises(grpc.RpcError) as failure:
                stub.Heads(pb.HeadsRequest(session_id="s", **fields))
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in failure.value.details()
        stub.Score(pb.ScoreRequest(session_id="s", tokens=[prompt[-1], 1, 2, 3, 4], tree="chain_4"))
        stub.Heads(pb.HeadsRequest(session_id="s", root_token=1, tree="chain_2", commit_path=[0, 1]))
        with pytest.raises(grpc.RpcError, match="root-first path"):  # that commit was applied: not again
            stub.Score(pb.ScoreRequest(session_id="s", tokens=[5], commit_path=[0, 1]))
    finally:
        for group in workers.values():
            group.stop()


def test_a_target_worker_checks_trees_and_their_commits(tiny_engine):
    workers = Workers(tiny_engine)
    stub, prompt = workers.stubs["target"], repeating_prompt(7)
    greedy = component_to_proto(ComponentSpec(name="greedy"))
    try:
        stub.Reset(
            pb.TargetReset(
                session_id="s", prompt_ids=prompt, sampling=sampling_to_proto(SamplingParams()), policy=greedy
            )
        )
        stub.Score(pb.ScoreRequest(session_id="s", tokens=[prompt[-1], 1, 2, 3, 4], tree="chain_4"))
        for fields, message in [
            ({"tree": "nope", "tokens": [1, 2]}, "unknown tree 'nope'"),
            ({"tree": "chain_4", "tokens": [1, 2]}, "takes 5 tokens"),
            ({"tokens": [1], "commit_path": [0, 2]}, "root-first path"),
            ({"tokens": [1], "commit_path": [1, 2]}, "root-first path"),
        ]:
            with pytest.raises(grpc.RpcError) as failure:
                stub.Score(pb.ScoreRequest(session_id="s", **fields))
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in failure.value.details()
        stub.Score(pb.ScoreRequest(session_id="s", tokens=[3], commit_path=[0, 1, 2]))  # a path of the chain
    finally:
        workers.stop()


def test_concurrent_sessions_share_forwards_and_decode_as_they_would_alone(tiny_engine):
    """16 requests of different prompts, lengths, drafters and temperatures at once: the target
    and draft workers run them in shared steps (more session rows than steps), and each request's
    tokens equal its run alone (greedy, and seeded sampling at T = 0.9)."""
    workers = Workers(tiny_engine)
    requests = [
        GenerationRequest(
            prompt_ids=repeating_prompt(index, length=8 + 6 * index),
            policy={"name": "greedy" if index % 2 else "rejection"},
            drafter={"name": ("pld", "model", "mla", "none")[index % 4]},
            num_draft_tokens=2 + index % 5,
            sampling={"max_tokens": 12 + index, "temperature": 0.0 if index % 2 else 0.9, "seed": index},
        )
        for index in range(16)
    ]
    try:
        alone = [remote_complete(workers.engine, req)[0] for req in requests]
        stubs = workers.stubs
        before = {role: stubs[role].Stats(pb.Empty()) for role in ("draft", "target")}
        with ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda req: remote_complete(workers.engine, req)[0], requests))
        after = {role: stubs[role].Stats(pb.Empty()) for role in ("draft", "target")}
    finally:
        workers.stop()
    assert together == alone
    for role in ("draft", "target"):
        assert after[role].sessions == 0
        # some steps held several sessions
        assert after[role].step_rows - before[role].step_rows > after[role].steps - before[role].steps


def test_the_load_sweep_streams_from_concurrent_clients_and_compares_outputs_across_levels(tiny_engine, cluster):
    """`bench --concurrency` (tools/load.py) over the HTTP API: every request of every level
    answered, outputs equal across levels and to target-only's (run-ahead drafting as well),
    sessions freed."""
    from deployments.client import SpecdecHttpClient
    from specdec_core.tools.benchmarks.load import sweep

    app = build_http_app(cluster, AppConfig(model_name="tiny"))

    def connect() -> SpecdecHttpClient:
        client = SpecdecHttpClient("http://testserver")
        client.http = TestClient(app)  # an httpx.Client that calls the app in-process
        return client

    def method(drafter: str, run_ahead: bool = False):
        return lambda prompt, level: GenerationRequest(
            prompt_ids=prompt,
            drafter={"name": drafter},
            num_draft_tokens=4,
            run_ahead=run_ahead,
            sampling={"max_tokens": 10},
        )

    prompts = [repeating_prompt(seed, length=10 + 2 * seed) for seed in range(6)]
    methods = {"target": method("none"), "pld": method("pld"), "ahead": method("model", run_ahead=True)}
    rows = sweep(connect, methods, prompts, [1, 3])
    levels = [(row["method"], row["concurrency"]) for row in rows]
    assert levels == [(name, level) for name in methods for level in (1, 3)]
    assert all(
        row["requests"] == row["identical_to_first_level"] == row["identical_to_first_method"] == 6 for row in rows
    )
    assert rows[0]["mean_accept_len"] is None and rows[2]["mean_accept_len"] >= 1
    assert rows[2]["ahead_used"] is None and 0 < rows[4]["ahead_used"] <= 1
    assert all(row["target_ms_per_step"] > 0 and row["verify_ms_per_step"] > 0 for row in rows)
    assert rows[0]["draft_ms_per_step"] < rows[4]["draft_ms_per_step"]  # target-only awaits no draft
    assert cluster.session_counts() == {"draft": 0, "target": 0}


def test_target_only_decoding_makes_no_draft_worker_calls(tiny_engine):
    workers = Workers(tiny_engine)
    try:
        tokens, metrics = remote_complete(workers.engine, request("greedy", "none"))
        stats = workers.stubs["draft"].Stats(pb.Empty())
    finally:
        workers.stop()
    assert tokens == tiny_engine.complete(request("greedy", "none")).token_ids
    assert metrics["num_steps"] > 1 and not metrics["draft_fallback"]
    assert stats.steps == stats.step_rows == 0


def test_draft_steps_wait_only_for_sessions_of_model_drafters(tiny_engine):
    """A lookup row gains nothing from sharing a draft step, so the step window waits for the
    open sessions that draft with the model only."""
    draft = DraftService(tiny_engine.draft_model, tiny_engine.target_model.config)
    sampling, prompt = SamplingParams(), repeating_prompt(1)
    for session, drafter in (("a", "pld"), ("b", "pld"), ("c", "mla"), ("d", "model")):
        spec = ComponentSpec(name=drafter)
        draft.open(OpenDraft(session_id=session, prompt_ids=prompt, drafter=spec, sampling=sampling, with_logits=False))
    assert draft.table.counts()[0] == 4 and draft.sessions_in_steps() == 2


def test_compact_wire_ships_a_fraction_of_the_full_logits(cluster):
    _, greedy = remote_complete(cluster, request("greedy", "model"))
    _, fly = remote_complete(cluster, request("fly", "model"))
    _, sampled = remote_complete(cluster, request("rejection", "pld", temperature=0.8))
    _, sampled_model = remote_complete(cluster, request("rejection", "model", temperature=0.8))
    assert greedy["wire_bytes_per_step"] < 0.05 * greedy["full_logits_bytes_per_step"]
    assert fly["wire_bytes_per_step"] < 0.1 * fly["full_logits_bytes_per_step"]
    # sampled verdicts are the target worker's: it sends a verdict, not its rows
    assert sampled["verdicts_on_target"] and sampled_model["verdicts_on_target"]
    assert sampled["wire_bytes_per_step"] < 0.05 * sampled["full_logits_bytes_per_step"]
    # a sampled draft model's rows still come to the server (its residual reads them), the target's do not
    assert sampled_model["wire_bytes_per_step"] < sampled_model["full_logits_bytes_per_step"]


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
    stub = workers.stubs["target"]
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


class ProposeCancelled(DraftServicer):
    """A draft worker whose third Propose ends CANCELLED, as a stopping gRPC server ends the calls
    it had not yet handed to a handler (grpc/grpc#41785; seen when Ray kills the worker)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.proposals = 0

    def Propose(self, request, context):
        self.proposals += 1
        if self.proposals == 3:
            context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        return super().Propose(request, context)


def test_a_draft_call_cancelled_by_its_stopping_worker_falls_back(tiny_engine):
    draft = ProposeCancelled(DraftService(tiny_engine.draft_model, tiny_engine.target_model.config))
    workers = Workers(tiny_engine, draft=draft)
    req = request("greedy", "model")
    try:
        chunks = list(workers.engine.stream(req))
        assert draft.proposals == 3 and chunks[-1].metrics["draft_fallback"] is True
        assert [token for chunk in chunks for token in chunk.token_ids] == tiny_engine.complete(req).token_ids
    finally:
        workers.stop()


def test_each_request_asks_where_its_workers_are(tiny_engine):
    """The server's `locate` names a replica per request: a draft worker that came back on another
    port serves the next request; no draft replica is target-only, no target replica a 503."""
    workers = Workers(tiny_engine, deadline_s=5)
    where = {**workers.addresses, "draft": "127.0.0.1:1"}  # the draft's old replica is gone

    async def locate(role: str, wait: bool = True) -> str:
        if where[role] is None:
            raise WorkerUnavailable(f"no {role} worker replica ready")
        return where[role]

    engine = RemoteEngine(tiny_engine.frontend, locate, deadline_s=5)
    try:
        assert remote_complete(engine, request("greedy", "model"))[1]["draft_fallback"] is True
        replacement, port = start_server(
            DraftServicer(DraftService(tiny_engine.draft_model, tiny_engine.target_model.config)), ADD["draft"]
        )
        where["draft"] = f"127.0.0.1:{port}"
        _, metrics = remote_complete(engine, request("greedy", "model"))
        assert metrics["draft_fallback"] is False and metrics["spec_decode_num_drafts"] > 0
        where["draft"] = None
        tokens, metrics = remote_complete(engine, request("greedy", "model"))
        assert metrics["draft_fallback"] is True and tokens == tiny_engine.complete(request("greedy", "none")).token_ids
        where["target"] = None
        with pytest.raises(WorkerUnavailable):
            remote_complete(engine, request("greedy", "model"))
        replacement.stop(None)
    finally:
        engine.close()
        workers.stop()


def test_past_the_kv_budget_requests_get_503_and_the_admitted_ones_finish(tiny_engine):
    """A target worker whose KV budget holds two sessions and lets none wait: a third request
    gets 503 + Retry-After over HTTP (RESOURCE_EXHAUSTED from the worker) while two streams are
    open; one client leaving frees its session and memory at once, the other finishes with its
    usual tokens, and the next request is served."""
    import gc

    from deployments.workers.admission import Admission
    from specdec_core.runtime.kv_pool import BLOCK_SIZE
    from specdec_core.runtime.model_runner import runner_of

    req = request("greedy", "pld")
    model = tiny_engine.target_model
    growable_pool = runner_of(model.model).kv_pool()
    probe = TargetService(model, 60.0)  # what a session reserves, in whole blocks of the pool
    session_bytes = probe.max_len(req.prompt_ids, req.sampling) * probe.kv_bytes_per_token
    admission = Admission(2.5 * session_bytes, max_waiting=0, wait_s=0.0)
    target = TargetService(model, 60.0, tiny_engine.frontend.profile(), admission=admission)
    pool = runner_of(model.model).kv_pool()  # the budget's, allocated once
    assert (
        pool is not growable_pool
        and not pool.growable
        and pool.num_blocks * BLOCK_SIZE >= 2 * probe.max_len(req.prompt_ids, req.sampling)
    )
    workers = Workers(tiny_engine, target=target)
    try:
        expected = tiny_engine.complete(req).token_ids
        held = [workers.engine.stream(req) for _ in range(2)]
        firsts = [next(stream) for stream in held]  # both sessions open, holding their reservations
        assert target.admission.reserved_bytes == 2 * session_bytes
        response = http_client(workers).post("/v1/completions", json=completion_body(drafter="pld"))
        assert response.status_code == 503 and response.headers["Retry-After"]
        assert response.json()["error"]["code"] == "overloaded"
        with pytest.raises(grpc.RpcError) as direct:  # what the worker itself answers
            workers.stubs["target"].Reset(
                pb.TargetReset(
                    session_id="third",
                    prompt_ids=req.prompt_ids,
                    sampling=sampling_to_proto(req.sampling),
                    policy=component_to_proto(ComponentSpec(name="greedy")),
                )
            )
        assert direct.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held[0].close()  # a client gone mid-stream: its session and its memory are freed at once
        assert target.admission.reserved_bytes == session_bytes and target.table.counts()[0] == 1
        assert [*firsts[1].token_ids, *(token for chunk in held[1] for token in chunk.token_ids)] == expected
        stats = workers.stubs["target"].Stats(pb.Empty())
        assert stats.sessions == 0 and stats.kv_reserved_bytes == 0
        assert remote_complete(workers.engine, req)[0] == expected
        gc.collect()
        assert pool.num_used == 0  # every block back: nothing leaks
    finally:
        workers.stop()
        runner_of(model.model).pool = growable_pool  # the other tests' engine


class ResetRaises(DraftServicer):
    """A draft worker with a bug in Reset."""

    @checked
    def Reset(self, request, context):
        raise RuntimeError("draft reset exploded")


class ScoreRaisesLater(TargetServicer):
    """A target worker whose third Score fails with a bug (after the stream has begun)."""

    @checked
    def Score(self, request, context):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise RuntimeError("score exploded")
        return super().Score(request, context)


def completion_body(**fields) -> dict:
    return {"prompt": repeating_prompt(7), "max_tokens": 24, "temperature": 0, "drafter": "model", **fields}


def test_a_bug_in_the_draft_worker_is_a_500_with_a_request_id_not_a_fallback(tiny_engine, caplog):
    workers = Workers(
        tiny_engine, draft=ResetRaises(DraftService(tiny_engine.draft_model, tiny_engine.target_model.config))
    )
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
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert client.post("/v1/completions", json=completion_body()).status_code == 200
        workers.servers["target"].stop(None)
        for stream in (False, True):
            response = client.post("/v1/completions", json=completion_body(stream=stream))
            assert response.status_code == 503, response.text
            assert response.headers["Retry-After"] == "5"
            assert response.json()["error"]["code"] == "worker_unavailable"
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["down"] == ["target"]
        models = client.get("/v1/models")  # listed only while /health says the service can serve
        assert models.status_code == 503 and models.headers["Retry-After"] == "5", models.text
        assert models.json()["error"]["code"] == "worker_unavailable"
    finally:
        workers.stop()


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done(tiny_engine):
    workers = Workers(tiny_engine, target=ScoreRaisesLater(TargetService(tiny_engine.target_model)))
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
        ({"policy": {"name": "greedy"}, "temperature": 0.5}, 400, "needs temperature 0", "policy"),
    ]:
        response = client.post("/v1/completions", json=completion_body(**fields))
        assert response.status_code == status and message in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == param
    bad_utf8 = client.post(
        "/v1/completions", content=b'{"prompt": "\xff"}', headers={"Content-Type": "application/json"}
    )
    assert bad_utf8.status_code == 400 and "malformed JSON" in bad_utf8.json()["error"]["message"]
    assert cluster.session_counts() == {"draft": 0, "target": 0}


# ---------------------------------------------------------------- hostile input, keys, log-probs


def chat_body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0, **fields}


def post(client: TestClient, case: HttpCase, base: dict):
    if isinstance(case.body, bytes):
        return client.post(case.path, content=case.body, headers={"Content-Type": "application/json"})
    return client.post(case.path, json={**base, **case.body})


@pytest.fixture(scope="module")
def tokenizer_engine():
    """A tiny random pair with SmolLM2's vocabulary behind its real tokenizer, so chat requests
    and token strings work."""
    from specdec_core import ModelSpec, SpeculativeEngine
    from specdec_core.models.loader import load_tokenizer

    from helpers.tiny_models import perturbed_copy, tiny_llama

    tokenizer = load_tokenizer(ModelSpec())
    target = tiny_llama(vocab_size=len(tokenizer))
    engine = SpeculativeEngine(target, tokenizer, perturbed_copy(target, 0.002))
    workers = Workers(engine)
    yield engine, workers
    workers.stop()


def test_hostile_http_inputs_get_a_4xx_naming_the_field_and_the_service_goes_on(tokenizer_engine):
    _, workers = tokenizer_engine
    client = http_client(workers)
    bases = {"/v1/completions": completion_body(), "/v1/chat/completions": chat_body()}
    cases = http_cases()
    assert len(cases) >= 30
    for case in cases:
        response = post(client, case, bases[case.path])
        assert case.check(response.status_code, response.json().get("error"), response.text) is None, (
            case.label,
            response.text[:300],
        )
    good = client.post("/v1/chat/completions", json=chat_body())
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] is not None
    assert workers.engine.session_counts() == {"draft": 0, "target": 0}


def test_content_parts_are_joined_text(tokenizer_engine):
    _, workers = tokenizer_engine
    client = http_client(workers)
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]
    as_parts = client.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": parts}]))
    as_text = client.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": "Say\nhello."}]))
    assert as_parts.status_code == 200, as_parts.text
    assert as_parts.json()["choices"][0]["token_ids"] == as_text.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("policy", [{"name": "greedy"}, {"name": "fly", "params": {"theta": 0.0, "window": 0}}])
def test_log_probs_on_both_endpoints_are_the_targets(tokenizer_engine, policy):
    """Over the compact wire too: loosely accepted drafts (FLy) may lie outside the shipped top-k
    rows; their log-probs come exact from the worker (1e-4)."""
    engine, workers = tokenizer_engine
    client = http_client(workers)
    prompt = repeating_prompt(3, vocab_size=engine.frontend.vocab_size)
    body = completion_body(prompt=prompt, policy=policy, logprobs=2, max_tokens=16)
    completion = client.post("/v1/completions", json=body).json()
    choice, logprobs = completion["choices"][0], completion["choices"][0]["logprobs"]
    assert completion["speculative"].get("loose", 1) > 0 and completion["speculative"]["spec_decode_num_drafts"] > 0
    rows = target_rows(engine.target_model, prompt, choice["token_ids"])
    for row, token, value, top in zip(rows, choice["token_ids"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert abs(value - row[token].item()) < 1e-4
        shown = sorted({*row.topk(2).indices.tolist(), token})  # the top 2 and the chosen token (vLLM's)
        assert sorted(top.values()) == pytest.approx(sorted(row[shown].tolist()), abs=1e-4)
    assert len(logprobs["tokens"]) == len(choice["token_ids"]) == len(logprobs["text_offset"])

    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.post("/v1/chat/completions", json=chat_body(messages=messages, policy=policy, logprobs=True))
    chat_choice = chat.json()["choices"][0]
    prompt_ids = engine.frontend.encode(GenerationRequest(messages=messages))
    rows = target_rows(engine.target_model, prompt_ids, chat_choice["token_ids"])
    content = chat_choice["logprobs"]["content"]
    assert len(content) == len(chat_choice["token_ids"]) and content[0]["top_logprobs"] == []
    for row, token, entry in zip(rows, chat_choice["token_ids"], content):
        assert abs(entry["logprob"] - row[token].item()) < 1e-4 and entry["bytes"] == list(entry["token"].encode())


@pytest.fixture(scope="module")
def grpc_ingress(tokenizer_engine):
    from deployments.ingress.grpc_ingress import GrpcIngress

    _, workers = tokenizer_engine
    ingress = GrpcIngress(workers.engine, AppConfig(grpc_port=0, api_key="sk-test"))
    yield f"127.0.0.1:{ingress.port}"
    ingress.stop()


def test_streams_in_flight_hold_no_thread_each(tokenizer_engine, grpc_ingress):
    """12 streams opened from an event loop (as the HTTP ingress does) and 12 over the gRPC
    ingress, all in flight at once, add no thread to the process (the workers' own handler and
    torch threads aside): each is a coroutine on the coordinator's loop. Each stream then
    finishes with the tokens it gives alone."""
    import asyncio
    import threading

    from deployments.client import SpecdecGrpcClient

    _, workers = tokenizer_engine
    requests = [
        GenerationRequest(prompt=f"Count to {index}:", drafter={"name": "model"}, sampling={"max_tokens": 6 + index})
        for index in range(12)
    ]
    alone = [[token for chunk in workers.engine.stream(req) for token in chunk.token_ids] for req in requests]

    def coordinator_side_threads() -> set[int]:
        workers_own = ("grpc-handler", "torch")
        return {thread.ident for thread in threading.enumerate() if not thread.name.startswith(workers_own)}

    async def together():
        before = coordinator_side_threads()
        streams = [await workers.engine.open(req) for req in requests]
        channel = grpc.aio.insecure_channel(grpc_ingress)
        stub, metadata = pb_grpc.SpecdecStub(channel), (("authorization", "Bearer sk-test"),)
        calls = [stub.Generate(SpecdecGrpcClient.message(req), metadata=metadata) for req in requests]
        firsts = [await anext(stream) for stream in streams] + [await call.read() for call in calls]
        added_threads = coordinator_side_threads() - before
        sessions = await workers.engine.count_sessions()
        from_open = [[*first.token_ids] for first in firsts[:12]]
        for tokens, stream in zip(from_open, streams):
            tokens += [token async for chunk in stream for token in chunk.token_ids]
        from_grpc = [[*first.token_ids] for first in firsts[12:]]
        for tokens, call in zip(from_grpc, calls):
            while (chunk := await call.read()) is not grpc.aio.EOF:
                tokens += chunk.token_ids
        await channel.close()
        return added_threads, sessions, from_open, from_grpc

    added_threads, sessions, from_open, from_grpc = asyncio.run(together())
    assert not added_threads
    assert min(sessions.values()) >= 12  # the streams held open (gRPC ones run on without a reader)
    assert from_open == alone and from_grpc == alone
    assert workers.engine.session_counts() == {"draft": 0, "target": 0}


def test_hostile_grpc_inputs_are_invalid_argument_without_internals(grpc_ingress):
    from deployments.client import SpecdecGrpcClient

    stub = SpecdecGrpcClient(grpc_ingress, api_key="sk-test")
    for fields in GRPC_CASES:
        with pytest.raises(grpc.RpcError) as failure:
            stub.stub.GenerateUnary(pb.GenerateRequest(**fields), metadata=stub.metadata, timeout=30)
            pytest.fail(f"accepted {fields}")
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, failure.value.details())
        assert "Traceback" not in failure.value.details() and 'File "' not in failure.value.details()
    good = stub.generate(GenerationRequest(prompt="hi", sampling={"max_tokens": 4, "logprobs": 1}))
    assert len(good["token_ids"]) == 4


def test_grpc_scores_a_prompt_and_says_what_stopped_the_output(tokenizer_engine, grpc_ingress):
    """The same sampling fields as HTTP: prompt_logprobs with max_tokens 0 (the prefill's scores,
    the first token without one), stop_token_ids (the stop token id in the unary reply)."""
    from deployments.client import SpecdecGrpcClient

    engine, _ = tokenizer_engine
    stub = SpecdecGrpcClient(grpc_ingress, api_key="sk-test")
    scored = stub.stub.GenerateUnary(
        pb.GenerateRequest(prompt="Hello there, friend", sampling={"max_tokens": 0, "prompt_logprobs": 2, "top_p": 1}),
        metadata=stub.metadata,
        timeout=30,
    )
    prompt = engine.frontend.encode(GenerationRequest(prompt="Hello there, friend"))
    rows = target_rows(engine.target_model, prompt[:1], prompt[1:])
    assert list(scored.token_ids) == [] and scored.prompt_tokens == len(prompt) == len(scored.prompt_log_probs)
    assert not scored.prompt_log_probs[0].chosen.HasField("log_prob")
    for row, token, entry in zip(rows, prompt[1:], scored.prompt_log_probs[1:]):
        assert abs(entry.chosen.log_prob - row[token].item()) < 1e-4 and len(entry.top) == 2
    free = stub.generate(GenerationRequest(prompt="Hi", sampling={"max_tokens": 12, "ignore_eos": True}))
    stop = free["token_ids"][4]
    sampling = {"max_tokens": 12, "stop_token_ids": [stop], "top_p": 1}
    stopped = stub.stub.GenerateUnary(
        pb.GenerateRequest(prompt="Hi", sampling=sampling), metadata=stub.metadata, timeout=30
    )
    assert stopped.stop_token_id == stop and stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop


def test_api_key_is_required_on_http_and_grpc(tokenizer_engine, grpc_ingress):
    from deployments.client import SpecdecGrpcClient

    _, workers = tokenizer_engine
    client = TestClient(build_http_app(workers.engine, AppConfig(model_name="tiny", api_key="sk-test")))
    body = chat_body()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test"}):
        refused = client.post("/v1/chat/completions", json=body, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models").status_code == 401 and client.get("/health").status_code == 200
    accepted = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-test"})
    assert accepted.status_code == 200
    assert accepted.headers["x-request-id"] in accepted.json()["id"]
    tagged = client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-test", "x-request-id": "trace-7"}
    )
    assert tagged.headers["x-request-id"] == "trace-7" and tagged.json()["id"] == "chatcmpl-trace-7"
    request = GenerationRequest(prompt="hi", sampling={"max_tokens": 4})
    for api_key in (None, "wrong"):
        with pytest.raises(grpc.RpcError) as failure:
            SpecdecGrpcClient(grpc_ingress, api_key=api_key).generate(request)
        assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(SpecdecGrpcClient(grpc_ingress, api_key="sk-test").generate(request)["token_ids"]) == 4


def test_workers_check_the_secret_and_everything_they_receive(tiny_engine):
    """A direct caller of a worker: refused without the secret; with it, out-of-vocabulary ids,
    oversized blocks and bad settings are INVALID_ARGUMENT, and the worker keeps serving."""
    draft = DraftServicer(DraftService(tiny_engine.draft_model, tiny_engine.target_model.config))
    target = TargetServicer(TargetService(tiny_engine.target_model))
    servers, stubs = [], {}
    for role, servicer in (("draft", draft), ("target", target)):
        server, port = start_server(servicer, ADD[role], secret="s3cret")
        servers.append(server)
        stubs[role] = pb_grpc.DrafterStub if role == "draft" else pb_grpc.TargetStub
        stubs[role] = stubs[role](grpc.insecure_channel(f"127.0.0.1:{port}"))
    secret = (("x-specdec-secret", "s3cret"),)
    greedy, sampling = component_to_proto(ComponentSpec(name="greedy")), sampling_to_proto(SamplingParams())
    pld = component_to_proto(ComponentSpec(name="pld"))
    try:
        with pytest.raises(grpc.RpcError) as refused:
            stubs["target"].Stats(pb.Empty(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        target_reset = functools.partial(pb.TargetReset, session_id="a", policy=greedy)
        bad_calls = [
            (stubs["target"].Reset, target_reset(prompt_ids=[999_999], sampling=sampling)),
            (stubs["target"].Reset, target_reset(prompt_ids=[], sampling=sampling)),
            (stubs["target"].Reset, target_reset(prompt_ids=[1], sampling=pb.Sampling())),
            # a target that decides verdicts applies logit_bias itself: its ids are checked there too
            (stubs["target"].Reset, target_reset(prompt_ids=[1], sampling=pb.Sampling(logit_bias={999_999: 1.0}))),
            (stubs["draft"].Reset, pb.DraftReset(session_id="a", prompt_ids=[-3], sampling=sampling, drafter=pld)),
        ]
        for call, message in bad_calls:
            with pytest.raises(grpc.RpcError) as failure:
                call(message, metadata=secret, timeout=10)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value.details()
        stubs["target"].Reset(
            pb.TargetReset(session_id="s", prompt_ids=[1, 2, 3], sampling=sampling, policy=greedy), metadata=secret
        )
        for score in (
            pb.ScoreRequest(session_id="s", tokens=[3, 999_999]),
            pb.ScoreRequest(session_id="s", tokens=[3] * 100),
            pb.ScoreRequest(session_id="s", tokens=[]),
            pb.ScoreRequest(session_id="s", tokens=[3], commit_keep=5),
        ):
            with pytest.raises(grpc.RpcError) as failure:
                stubs["target"].Score(score, metadata=secret, timeout=10)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value.details()
        reply = stubs["target"].Score(pb.ScoreRequest(session_id="s", tokens=[3, 4]), metadata=secret, timeout=10)
        assert reply.vocab_size == tiny_engine.target_model.config.vocab_size
        # a sampled session whose verdicts the target decides: what it reads of the drafts is checked
        rejection = component_to_proto(ComponentSpec(name="rejection"))
        hot = sampling_to_proto(SamplingParams(temperature=0.8, seed=3))
        decided = pb.TargetReset(
            session_id="v", prompt_ids=[1, 2, 3], sampling=hot, policy=rejection, decides_verdicts=True, stop_ids=[0]
        )
        assert stubs["target"].Reset(decided, metadata=secret, timeout=10).decides_verdicts
        vocab_size = reply.vocab_size
        rows = torch.zeros(2, vocab_size)
        for score in (
            pb.ScoreRequest(session_id="s", tokens=[4, 5, 6], draft_token_probs=[0.5, 0.5]),  # not a deciding session
            pb.ScoreRequest(session_id="v", tokens=[3, 4, 5], draft_token_probs=[0.5]),  # one per draft
            pb.ScoreRequest(session_id="v", tokens=[3, 4, 5], draft_token_probs=[0.5, 1.5]),
            pb.ScoreRequest(session_id="v", tokens=[3, 4, 5], draft_token_probs=[0.5, 0.5]),  # rejection reads q rows
            pb.ScoreRequest(
                session_id="v", tokens=[3, 4, 5], draft_token_probs=[0.5, 0.5], draft_logits=tensor_to_proto(rows[:1])
            ),
            pb.ScoreRequest(
                session_id="v",
                tokens=[3, 4, 5],
                draft_token_probs=[0.5, 0.5],
                draft_logits=pb.Tensor(dtype="float32", shape=[2, vocab_size], data=b"\0" * 12),
            ),
        ):
            with pytest.raises(grpc.RpcError) as failure:
                stubs["target"].Score(score, metadata=secret, timeout=10)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value.details()
        score = pb.ScoreRequest(
            session_id="v", tokens=[3, 4, 5], draft_token_probs=[0.5, 0.5], draft_logits=tensor_to_proto(rows)
        )
        reply = stubs["target"].Score(score, metadata=secret, timeout=10)
        assert reply.HasField("verdict") and not reply.HasField("logits") and 0 <= reply.verdict.num_accepted <= 2
        model = component_to_proto(ComponentSpec(name="model"))
        for session_id, drafter in (("lookup", pld), ("drafted", model)):
            draft_reset = pb.DraftReset(session_id=session_id, prompt_ids=[1, 2, 3], sampling=sampling, drafter=drafter)
            stubs["draft"].Reset(draft_reset, metadata=secret, timeout=10)
        for propose in (
            pb.ProposeRequest(session_id="lookup", max_tokens=3, after_tokens=[4]),  # lookups never draft ahead
            pb.ProposeRequest(session_id="drafted", max_tokens=3, after_tokens=[999_999]),
            pb.ProposeRequest(session_id="drafted", max_tokens=3, after_tokens=[4] * 100),
            pb.ProposeRequest(session_id="drafted", max_tokens=65),
        ):
            with pytest.raises(grpc.RpcError) as failure:
                stubs["draft"].Propose(propose, metadata=secret, timeout=10)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value.details()
        ahead = pb.ProposeRequest(session_id="drafted", max_tokens=3, after_tokens=[4, 5])
        assert len(stubs["draft"].Propose(ahead, metadata=secret, timeout=10).tokens) == 1 + 3  # the guess, a block
        for commit_tokens in ([999_999], [4] * 200):  # a release's last commit is checked as a Propose's
            with pytest.raises(grpc.RpcError) as failure:
                stubs["draft"].Release(pb.SessionRef(session_id="lookup", commit_tokens=commit_tokens), metadata=secret)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value.details()
        stubs["draft"].Release(pb.SessionRef(session_id="lookup", commit_tokens=[4, 5]), metadata=secret, timeout=10)
    finally:
        for server in servers:
            server.stop(None)


def test_the_grpc_ingress_binds_the_configured_host(grpc_ingress):
    assert set(listening_addresses(int(grpc_ingress.rsplit(":", 1)[1]))) == {"127.0.0.1"}


def test_a_stopping_worker_answers_unavailable_not_internal(tiny_engine):
    """Once the process stops taking torch work (Ray shutting an actor down), calls get
    UNAVAILABLE, which the coordinator treats as a worker gone (a draft falls back), not a bug."""
    from deployments.workers.steps import StepBatcher, WorkerStopping

    stopped = ThreadPoolExecutor(max_workers=1)
    stopped.shutdown()
    batcher = StepBatcher(stopped, lambda rows: rows, lambda row: None, lambda: 1, 0.0, 8)
    with pytest.raises(WorkerStopping):
        batcher.submit(TargetRow(session_id="s", tokens=[1]))
    assert batcher.pending == [] and not batcher.scheduled

    draft = DraftService(tiny_engine.draft_model, tiny_engine.target_model.config)
    draft.batcher.executor = stopped
    server, port = start_server(DraftServicer(draft), ADD["draft"])
    try:
        stub = pb_grpc.DrafterStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        reset = pb.DraftReset(
            session_id="s",
            prompt_ids=[1, 2, 3],
            sampling=sampling_to_proto(SamplingParams()),
            drafter=component_to_proto(ComponentSpec(name="model")),
        )
        stub.Reset(reset)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Propose(pb.ProposeRequest(session_id="s", max_tokens=2))
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def test_a_repeated_prompt_is_served_from_the_prefix_cache(cluster, tiny_engine):
    """The second request of a prompt (another session on the same worker) finds its full
    blocks in the target's prefix cache, says so in its metrics, and decodes the same tokens."""
    req = request("greedy", "pld")
    req.prompt_ids = repeating_prompt(11, length=70)
    first_tokens, first = remote_complete(cluster, req)
    second_tokens, second = remote_complete(cluster, req)
    assert second_tokens == first_tokens
    assert second["prefix_cache_queries"] == 69 and second["prefix_cache_hits"] == 64
    assert first["prefix_cache_hits"] <= second["prefix_cache_hits"]
