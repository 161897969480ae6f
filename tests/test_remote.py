"""The coordinator over real gRPC draft and target workers (in-process servers, tiny models):
token-identical to the in-process engine for every policy, compact wire, session cleanup and
draft-worker failure."""

from __future__ import annotations

import pytest
from conftest import repeating_prompt

pytest.importorskip("grpc")

from deployments.coordinator import Coordinator  # noqa: E402
from deployments.workers import DraftServicer, TargetServicer, start_server  # noqa: E402
from deployments.wire import component_to_proto, sampling_to_proto  # noqa: E402
from protos import specdec_pb2 as pb  # noqa: E402
from protos import specdec_pb2_grpc as pb_grpc  # noqa: E402
from specdec_core.engine import ComponentSpec  # noqa: E402
from specdec_core.sampling import SamplingParams  # noqa: E402
from specdec_core import GenerationRequest, SpecdecError  # noqa: E402
from specdec_core.policies import POLICIES  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tiny_engine):
    draft_server, draft_port = start_server(
        DraftServicer(tiny_engine.draft_model, idle_timeout_s=60), pb_grpc.add_DrafterServicer_to_server
    )
    target_server, target_port = start_server(
        TargetServicer(tiny_engine.target_model, idle_timeout_s=60), pb_grpc.add_TargetServicer_to_server
    )
    coordinator = Coordinator(tiny_engine.frontend, f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}", deadline_s=30)
    yield coordinator
    draft_server.stop(None)
    target_server.stop(None)


def request(policy, drafter, temperature=0.0, k=6, **policy_params):
    return GenerationRequest(
        prompt_ids=repeating_prompt(7),
        policy={"name": policy, "params": policy_params},
        drafter={"name": drafter},
        num_draft_tokens=k,
        sampling={"max_tokens": 32, "temperature": temperature, "seed": 5},
    )


def remote_complete(coordinator, req):
    chunks = list(coordinator.stream(req))
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


def test_commit_folded_into_the_next_call_equals_the_commit_rpc(cluster):
    """The coordinator sends each step's commits with the next Propose / Score; that must act
    exactly like the explicit Commit RPCs."""
    draft, target = cluster.draft_stub, cluster.target_stub
    prompt, sampling = repeating_prompt(7), sampling_to_proto(SamplingParams())
    greedy, model = component_to_proto(ComponentSpec(name="greedy")), component_to_proto(ComponentSpec(name="model"))
    replies = {}
    for session, folded in (("explicit", False), ("folded", True)):
        target.Reset(pb.TargetReset(session_id=session, prompt_ids=prompt, sampling=sampling, policy=greedy))
        draft.Reset(pb.DraftReset(session_id=session, prompt_ids=prompt, sampling=sampling, drafter=model))
        proposed = list(draft.Propose(pb.ProposeRequest(session_id=session, max_tokens=4)).tokens)
        target.Score(pb.ScoreRequest(session_id=session, tokens=[prompt[-1], *proposed]))
        kept = proposed[:2] + [3]  # accept two drafts, then a correction token
        if folded:
            next_draft = draft.Propose(pb.ProposeRequest(session_id=session, max_tokens=4, commit_tokens=kept))
            next_score = target.Score(pb.ScoreRequest(session_id=session, tokens=[3, 5, 6], commit_keep=3))
        else:
            draft.Commit(pb.DraftCommit(session_id=session, new_tokens=kept))
            target.Commit(pb.TargetCommit(session_id=session, num_keep=3))
            next_draft = draft.Propose(pb.ProposeRequest(session_id=session, max_tokens=4))
            next_score = target.Score(pb.ScoreRequest(session_id=session, tokens=[3, 5, 6]))
        replies[session] = (list(next_draft.tokens), next_score.top_ids.data, next_score.top_log_probs.data)
        draft.Release(pb.SessionRef(session_id=session))
        target.Release(pb.SessionRef(session_id=session))
    assert replies["folded"] == replies["explicit"]


def test_sessions_are_freed_on_finish_and_on_abandoned_streams(cluster):
    remote_complete(cluster, request("greedy", "model"))
    assert cluster.session_counts() == {"draft": 0, "target": 0}
    stream = cluster.stream(request("greedy", "model"))
    next(stream)
    assert cluster.session_counts() == {"draft": 1, "target": 1}
    stream.close()  # what a client disconnect does to the generator
    assert cluster.session_counts() == {"draft": 0, "target": 0}


def test_bad_requests_are_rejected_before_any_session(cluster):
    with pytest.raises(SpecdecError, match="unknown policy"):
        list(cluster.stream(request("nope", "model")))
    with pytest.raises(SpecdecError, match="bad parameters for drafter 'pld'"):
        list(cluster.stream(GenerationRequest(prompt_ids=[1, 2], drafter={"name": "pld", "params": {"max_ngram": 0}})))
    assert cluster.session_counts() == {"draft": 0, "target": 0}


def test_draft_worker_failure_falls_back_to_target_only(tiny_engine):
    draft_server, draft_port = start_server(DraftServicer(tiny_engine.draft_model), pb_grpc.add_DrafterServicer_to_server)
    target_server, target_port = start_server(TargetServicer(tiny_engine.target_model), pb_grpc.add_TargetServicer_to_server)
    coordinator = Coordinator(tiny_engine.frontend, f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}", deadline_s=5)
    req = request("greedy", "model")
    stream = coordinator.stream(req)
    tokens = list(next(stream).token_ids)
    draft_server.stop(None)  # the draft worker dies mid-request
    chunks = list(stream)
    tokens += [token for chunk in chunks for token in chunk.token_ids]
    assert chunks[-1].metrics["draft_fallback"] is True
    assert tokens == tiny_engine.complete(req).token_ids  # greedy: same tokens, target-only
    target_server.stop(None)
