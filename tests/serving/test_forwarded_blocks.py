"""Forwarded blocks on the target worker (deployments/workers/forwarded_blocks.py): a block the draft
worker sends ahead is scored before the server's Score only on the verdict it assumed, and that
Score gets exactly the rows a fresh forward would give; stale, wrong and cut blocks cost nothing
but their own forward; a Score that commits otherwise than the target's verdict fails. A session
whose sampled verdicts the target decides takes them too, with their drafts' probabilities: its
verdicts, and its verify stream where a block scored ahead goes unused, are a fresh session's."""

from __future__ import annotations

import time

import pytest
import torch

from helpers.tiny_models import repeating_prompt

pytest.importorskip("grpc")

import grpc  # noqa: E402

from deployments.coordination.wire import component_to_proto, sampling_to_proto  # noqa: E402
from deployments.workers.forwarded_blocks import ForwardedBlock  # noqa: E402
from deployments.workers.target_service import TargetService  # noqa: E402
from protos import specdec_pb2 as pb  # noqa: E402
from specdec_core import GenerationRequest, SpecdecError  # noqa: E402
from specdec_core.api.request import ComponentSpec  # noqa: E402
from specdec_core.api.sampling import SamplingParams  # noqa: E402

from helpers.served import Workers  # noqa: E402

GREEDY = ComponentSpec(name="greedy")
PROMPT = repeating_prompt(3)


def open_session(service: TargetService, session_id: str, takes_forwarded: bool = True) -> None:
    service.reset(session_id, PROMPT, GREEDY, SamplingParams(max_tokens=64), None, takes_forwarded)


def greedy_outcome(drafts: list[int], rows: torch.Tensor) -> list[int]:
    """The greedy verdict's new tokens on a chain `drafts` scored as `rows [K + 1, V]`."""
    argmax = rows.argmax(-1).tolist()
    accepted = next((index for index, token in enumerate(drafts) if token != argmax[index]), len(drafts))
    return [*drafts[:accepted], argmax[accepted]]


def wait_for_steps(service: TargetService, steps: int) -> None:
    deadline = time.monotonic() + 30
    while service.batcher.steps < steps:
        assert time.monotonic() < deadline, "the forwarded block was not scored"
        time.sleep(0.005)


@pytest.fixture
def service(tiny_engine):
    return TargetService(tiny_engine.target_model, 60.0, tiny_engine.frontend.profile())


def test_a_block_forwarded_on_the_right_verdict_is_scored_before_its_score(service):
    open_session(service, "ahead")
    open_session(service, "fresh", takes_forwarded=False)
    drafts = [5, 6, 7]
    for session in ("ahead", "fresh"):
        scored = service.score(session, [PROMPT[-1], *drafts], 0, [], "")
    new_tokens = greedy_outcome(drafts, scored.block.logits)
    next_tokens = [new_tokens[-1], 9, 10]
    keep = len(new_tokens)  # the root and the drafts kept
    steps = service.batcher.steps
    service.forward("ahead", ForwardedBlock(len(PROMPT), new_tokens, next_tokens))
    wait_for_steps(service, steps + 1)  # scored without the server asking
    ahead = service.score("ahead", next_tokens, keep, [], "")
    assert ahead.forwarded and service.batcher.steps == steps + 1  # no forward for the Score itself
    fresh = service.score("fresh", next_tokens, keep, [], "")
    assert not fresh.forwarded
    torch.testing.assert_close(ahead.block.logits, fresh.block.logits, rtol=0, atol=1e-5)
    assert service.stats()["forwarded_scored"] == service.stats()["forwarded_used"] == 1


def test_a_block_that_arrives_before_its_verdict_waits_for_it(service):
    open_session(service, "s")
    open_session(service, "fresh", takes_forwarded=False)  # where the verdicts are found first
    scored = service.score("fresh", [PROMPT[-1], 5], 0, [], "")
    first = greedy_outcome([5], scored.block.logits)
    scored = service.score("fresh", [first[-1], 11, 12], len(first), [], "")
    second = greedy_outcome([11, 12], scored.block.logits)
    service.score("s", [PROMPT[-1], 5], 0, [], "")
    # the block after block 2 comes while block 1 is the last scored: it waits ...
    service.forward("s", ForwardedBlock(len(PROMPT) + len(first), second, [second[-1], 13]))
    assert service.forwarded.scored == 0
    # ... for block 2's verdict, which the server's Score of block 2 brings
    assert not service.score("s", [first[-1], 11, 12], len(first), [], "").forwarded
    assert service.forwarded.scored == 1
    assert service.score("s", [second[-1], 13], len(second), [], "").forwarded


def test_wrong_stale_and_cut_blocks_cost_only_their_own_forward(service):
    open_session(service, "s")
    open_session(service, "fresh", takes_forwarded=False)
    for session in ("s", "fresh"):
        scored = service.score(session, [PROMPT[-1], 5, 6], 0, [], "")
    new_tokens = greedy_outcome([5, 6], scored.block.logits)
    wrong = [*new_tokens[:-1], (new_tokens[-1] + 1) % service.vocab_size]
    service.forward("s", ForwardedBlock(len(PROMPT), wrong, [wrong[-1], 9]))
    assert service.forwarded.scored == 0  # the verdict went otherwise: dropped
    service.forward("s", ForwardedBlock(len(PROMPT), new_tokens, [new_tokens[-1], 9, 10]))
    assert service.forwarded.scored == 1
    # the server cuts the block shorter (the request's last tokens): scored anew, the commit not again
    cut = [new_tokens[-1], 9]
    scored = service.score("s", cut, len(new_tokens), [], "")
    fresh = service.score("fresh", cut, len(new_tokens), [], "")
    assert not scored.forwarded and service.forwarded.used == 0
    torch.testing.assert_close(scored.block.logits, fresh.block.logits, rtol=0, atol=1e-5)
    # a block for the verdict the server has moved past arrives late: dropped
    service.forward("s", ForwardedBlock(len(PROMPT), new_tokens, [new_tokens[-1], 9, 10]))
    assert service.forwarded.scored == 1


def test_a_score_that_commits_otherwise_than_the_targets_verdict_fails(service):
    open_session(service, "s")
    scored = service.score("s", [PROMPT[-1], 5, 6], 0, [], "")
    new_tokens = greedy_outcome([5, 6], scored.block.logits)
    service.forward("s", ForwardedBlock(len(PROMPT), new_tokens, [new_tokens[-1], 9]))
    with pytest.raises(RuntimeError, match="the target's own verdict"):
        service.score("s", [new_tokens[-1], 9], len(new_tokens) + 1, [], "")


def sampled_draft(tokens: list[int], seed: int, vocab: int) -> tuple[list[float], torch.Tensor]:
    """Made-up sampled drafts `tokens`: their p_d `[K]` under made-up rows `[K, V]`, and the rows."""
    logits = torch.randn(len(tokens), vocab, generator=torch.Generator().manual_seed(seed))
    probs = (logits / 0.8).softmax(-1)[torch.arange(len(tokens)), torch.tensor(tokens)]
    return probs.clamp(min=1e-6).tolist(), logits


def score_sampled(service: TargetService, session: str, tokens: list[int], keep: int, seed: int):
    return service.score(session, tokens, keep, [], "", None, *sampled_draft(tokens[1:], seed, service.vocab_size))


def verdict_of(scored) -> tuple:
    return scored.block.verdict.num_accepted, scored.block.verdict.next_token


def test_a_session_deciding_sampled_verdicts_takes_forwarded_blocks_unasked(service):
    """Rejection sampling at T 0.8 decided on the target: a forwarded block on the verdict's
    outcome is scored and decided ahead, and the Score gets a fresh session's verdict; a block
    scored ahead and unused (the Score cut it shorter, or its drafts came with other
    probabilities) leaves the verify stream as it found it."""
    sampling = SamplingParams(temperature=0.8, seed=11, max_tokens=64)
    for session in ("ahead", "fresh"):
        service.reset(session, PROMPT, ComponentSpec(name="rejection"), sampling, None, stop_ids=[])
    assert service.forwarded.takes("ahead")  # unasked
    first = [PROMPT[-1], 5, 6, 7]
    with pytest.raises(SpecdecError, match="drafts_as_scored"):  # from a draft worker that sends no p_d
        service.forward("ahead", ForwardedBlock(len(PROMPT), [1], [1, 2], drafts_as_scored=False))
    decided = [score_sampled(service, session, first, 0, seed=1) for session in ("ahead", "fresh")]
    assert verdict_of(decided[0]) == verdict_of(decided[1])
    accepted, next_token = verdict_of(decided[0])
    outcome, keep, after_length = [*first[1 : 1 + accepted], next_token], accepted + 1, len(PROMPT)
    for asked_otherwise in (None, "cut", "other probabilities"):
        block = [outcome[-1], 9, 10, 11]
        steps = service.batcher.steps
        probs, logits = sampled_draft(block[1:], seed=2, vocab=service.vocab_size)
        service.forward("ahead", ForwardedBlock(after_length, outcome, block), probs, logits)
        wait_for_steps(service, steps + 1)  # scored, and its verdict drawn, before the Score
        asked = block[:-1] if asked_otherwise == "cut" else block  # the request's last tokens
        seed = 3 if asked_otherwise == "other probabilities" else 2
        scored = [score_sampled(service, session, asked, keep, seed) for session in ("ahead", "fresh")]
        assert scored[0].forwarded is (asked_otherwise is None) and not scored[1].forwarded
        assert verdict_of(scored[0]) == verdict_of(scored[1])
        streams = [service.session(session).verdicts.generator.get_state() for session in ("ahead", "fresh")]
        assert torch.equal(*streams)
        after_length += len(outcome)
        accepted, next_token = verdict_of(scored[0])
        outcome, keep = [*asked[1 : 1 + accepted], next_token], accepted + 1
    assert service.forwarded.scored == 3 and service.forwarded.used == 1


def test_only_sessions_of_target_decided_policies_take_forwarded_blocks(tiny_engine, service):
    with pytest.raises(SpecdecError, match="decides with the server"):
        service.reset("t", PROMPT, ComponentSpec(name="typical"), SamplingParams(temperature=0.7), None, True)
    with pytest.raises(SpecdecError, match="decides with the server"):
        service.reset("r", PROMPT, ComponentSpec(name="rejection"), SamplingParams(temperature=0.7), None, True)
    service.reset("r", PROMPT, ComponentSpec(name="rejection"), SamplingParams(), None, True)  # T = 0: argmax
    workers = Workers(tiny_engine)
    stub = workers.stubs["target"]
    try:
        reset = pb.TargetReset(
            session_id="s",
            prompt_ids=PROMPT,
            sampling=sampling_to_proto(SamplingParams()),
            policy=component_to_proto(GREEDY),
        )
        assert not stub.Reset(reset).takes_forwarded
        for fields, code, message in [
            ({"session_id": "s"}, grpc.StatusCode.INVALID_ARGUMENT, "not reset to take forwarded blocks"),
            ({"session_id": "gone"}, grpc.StatusCode.NOT_FOUND, "no session"),
        ]:
            with pytest.raises(grpc.RpcError) as failure:
                stub.Forward(pb.ForwardedBlock(after_length=len(PROMPT), assumed=[1], tokens=[1, 2], **fields))
            assert failure.value.code() == code and message in failure.value.details()
        reset.session_id, reset.takes_forwarded = "f", True
        assert stub.Reset(reset).takes_forwarded
        with pytest.raises(grpc.RpcError, match="tokens must hold"):
            stub.Forward(pb.ForwardedBlock(session_id="f", after_length=len(PROMPT), assumed=[1], tokens=[]))
    finally:
        workers.stop()


def served_request(drafter: str, k: int) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=repeating_prompt(6),
        drafter={"name": drafter},
        num_draft_tokens=k,
        run_ahead=True,
        sampling={"max_tokens": 40},
    )


def served_sampled(policy: str, seed: int) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=repeating_prompt(6),
        policy={"name": policy},
        drafter={"name": "model"},
        num_draft_tokens=4,
        run_ahead=True,
        sampling={"max_tokens": 40, "temperature": 0.8, "seed": seed},
    )


@pytest.mark.parametrize("policy", ["rejection", "typical"])
def test_served_sampled_with_forwarded_blocks_is_the_in_process_output(sharp_engine, policy):
    """Over real gRPC workers, sampled verdicts decided on the target worker: the draft worker
    forwards its ahead chains with their probabilities, the target decides the verdicts of those
    it scores ahead, and every seed's tokens are the in-process engine's."""
    workers = Workers(sharp_engine)
    try:
        forwarded = 0
        for seed in range(3):
            chunks = list(workers.engine.stream(served_sampled(policy, seed)))
            assert [token for chunk in chunks for token in chunk.token_ids] == sharp_engine.complete(
                served_sampled(policy, seed)
            ).token_ids
            assert chunks[-1].metrics["verdicts_on_target"]
            forwarded += chunks[-1].metrics["run_ahead"]["forwarded"]
        assert forwarded > 0
    finally:
        workers.stop()


@pytest.mark.parametrize("drafter", ["model", "mla", "model_tree", "mla_tree"])
def test_served_greedy_with_forwarded_blocks_is_target_only_output(sharp_engine, drafter):
    """Over real gRPC workers, a peaked target whose verdicts the draft often guesses: the draft
    worker forwards its ahead chains and trees to the target worker, which scores most of those
    used before the server asks; the output is target-only output."""
    workers = Workers(sharp_engine)
    try:
        target_only = sharp_engine.complete(served_request("none", 1)).token_ids
        for k in (1, 4):
            chunks = list(workers.engine.stream(served_request(drafter, k)))
            assert [token for chunk in chunks for token in chunk.token_ids] == target_only
            counts = chunks[-1].metrics["run_ahead"]
            assert 0 < counts["forwarded"] <= counts["used"]
        stats = workers.stubs["target"].Stats(pb.Empty())
        assert 0 < stats.forwarded_used <= stats.forwarded_scored
    finally:
        workers.stop()
