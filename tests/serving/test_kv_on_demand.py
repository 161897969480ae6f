"""A served target worker whose KV pool is shared on demand (pool_scheduler.py): chats without
max_tokens run to the end of the context in a pool of two contexts, the youngest sessions are
preempted and resume by recompute, every stream pauses and never fails, and every output equals
the request's own output in process. In-process gRPC workers (helpers/served.py), tiny models."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.served import Workers
from helpers.tiny_models import repeating_prompt

pytest.importorskip("grpc")

from deployments.workers.admission import Admission  # noqa: E402
from deployments.workers.held_answers import HeldAnswers  # noqa: E402
from deployments.workers.target_service import TargetService  # noqa: E402
from protos import specdec_pb2 as pb  # noqa: E402
from specdec_core import GenerationRequest  # noqa: E402
from specdec_core.runtime.model_runner import runner_of  # noqa: E402

CONTEXT = 1024  # the tiny models' max_position_embeddings


def chat(seed: int, drafter: str = "model", policy: str = "greedy", temperature: float = 0.0, max_tokens=None):
    sampling = {"temperature": temperature, "seed": seed, "max_tokens": max_tokens}
    return GenerationRequest(
        prompt_ids=repeating_prompt(seed, length=12 + 2 * seed),
        policy={"name": policy},
        drafter={"name": drafter},
        num_draft_tokens=4,
        sampling={name: value for name, value in sampling.items() if value is not None},
    )


def streamed(engine, request) -> tuple[list[int], dict]:
    chunks = list(engine.stream(request))
    return [token for chunk in chunks for token in chunk.token_ids], chunks[-1].metrics


@pytest.fixture
def on_demand(tiny_engine):
    """Workers whose target pool holds `positions` positions, shared on demand; each test's pool
    is its own, and the engine's pool comes back after."""
    model = tiny_engine.target_model
    kept = runner_of(model.model).kv_pool()
    made = []

    def workers(positions: int, deadline_s: float = 30.0, max_waiting: int = 64, wait_s: float = 60.0) -> Workers:
        probe = TargetService(model, 60.0)
        admission = Admission(positions * probe.kv_bytes_per_token, max_waiting, wait_s, on_demand=True)
        target = TargetService(model, 60.0, tiny_engine.frontend.profile(), admission=admission)
        made.append(Workers(tiny_engine, target=target, deadline_s=deadline_s))
        return made[-1]

    yield workers
    for each in made:
        each.stop()
    runner_of(model.model).pool = kept


def run_together(workers: Workers, requests) -> list[tuple[list[int], dict]]:
    with ThreadPoolExecutor(len(requests)) as threads:
        return list(threads.map(lambda request: streamed(workers.engine, request), requests))


def test_six_chats_without_max_tokens_run_to_the_context_end_in_a_pool_of_two(tiny_engine, on_demand, monkeypatch):
    """The short deadline makes preempted sessions' Score calls come back held and ask again."""
    held = []
    wait = HeldAnswers.wait
    monkeypatch.setattr(HeldAnswers, "wait", lambda *args: held.append(answer := wait(*args)) or answer)
    requests = [chat(seed, drafter=("model", "pld", "none")[seed % 3]) for seed in range(6)]
    alone = [tiny_engine.complete(request).token_ids for request in requests]
    assert [len(tokens) for tokens in alone] == [CONTEXT - len(one.prompt_ids) - 4 for one in requests]
    workers = on_demand(2 * CONTEXT, deadline_s=2.0)
    together = run_together(workers, requests)
    assert [tokens for tokens, _ in together] == alone
    stats = workers.stubs["target"].Stats(pb.Empty())
    assert stats.preemptions > 0 and sum(metrics["preemptions"] for _, metrics in together) == stats.preemptions
    assert not any(metrics["draft_fallback"] for _, metrics in together)
    assert None in held  # some Score calls came back held (the session waited past the deadline)
    target_pool = runner_of(tiny_engine.target_model.model).kv_pool()
    assert stats.sessions == 0 and target_pool.num_used == 0 and target_pool.available == target_pool.num_blocks


def test_preempted_sampled_and_tree_requests_continue_exactly(tiny_engine, on_demand):
    requests = [
        chat(0, policy="rejection", temperature=0.8, max_tokens=200),
        chat(1, drafter="model_tree", max_tokens=200),
        chat(2, policy="typical", temperature=0.7, max_tokens=200),
        chat(3, drafter="pld", max_tokens=200),
    ]
    alone = [tiny_engine.complete(request).token_ids for request in requests]
    workers = on_demand(400)
    together = run_together(workers, requests)
    assert [tokens for tokens, _ in together] == alone
    assert workers.stubs["target"].Stats(pb.Empty()).preemptions > 0


def test_a_reach_past_the_pool_is_refused_and_a_full_queue_is_overloaded(tiny_engine, on_demand):
    """A pool of 640 positions, none may wait: a reach past the pool is a 400-class error; two open
    streams of 280-token prompts leave no room for a third prompt and its drafts, which gets
    Overloaded (503); once a client leaves, its blocks are back at once and the next is served."""
    from deployments.ingress.error_replies import WorkerOverloaded
    from specdec_core.api.errors import SpecdecError

    workers = on_demand(640, max_waiting=0, wait_s=0.5)
    with pytest.raises(SpecdecError, match="KV cache"):
        streamed(workers.engine, chat(0, max_tokens=700))
    long = [chat(seed, max_tokens=40).model_copy(update={"prompt_ids": repeating_prompt(seed, 280)}) for seed in (1, 2)]
    held = [workers.engine.stream(request) for request in long]
    for stream in held:
        next(stream)  # open, holding its prompt's blocks
    with pytest.raises(WorkerOverloaded):
        streamed(workers.engine, chat(0, max_tokens=40))
    held[0].close()
    tokens, metrics = streamed(workers.engine, chat(0, max_tokens=40))
    assert tokens == tiny_engine.complete(chat(0, max_tokens=40)).token_ids and metrics["preemptions"] == 0
    held[1].close()
