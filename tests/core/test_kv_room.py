"""kv_room.py with lockstep.py: a fixed KV pool admits requests by what they hold now, preempts the
youngest sessions when it runs out, and resumes them by recompute; every output equals the
request's output alone, and no block is lost."""

from __future__ import annotations

import pytest

from specdec_core import GenerationRequest
from specdec_core.api.errors import SpecdecError
from specdec_core.loop import lockstep
from specdec_core.loop.lockstep import complete_together
from specdec_core.runtime.kv_pool import KVPool, PagedKV

from helpers.tiny_models import repeating_prompt

CONTEXT = 1024  # the tiny models' max_position_embeddings


def chat(seed: int, drafter: str = "model", max_tokens=None, policy="greedy", temperature=0.0):
    """A request without max_tokens runs to the end of the context (the tiny models have no EOS)."""
    sampling = {"temperature": temperature, "seed": seed}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    return GenerationRequest(
        prompt_ids=repeating_prompt(seed, length=12 + 2 * seed),
        policy={"name": policy},
        drafter={"name": drafter},
        num_draft_tokens=4,
        sampling=sampling,
    )


@pytest.fixture
def rooms(monkeypatch):
    """Every KVRoom complete_together makes, to look at after."""
    made = []

    class Kept(lockstep.KVRoom):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(lockstep, "KVRoom", Kept)
    return made


def test_a_pool_of_two_contexts_runs_six_chats_to_the_end_of_the_context(tiny_engine, rooms):
    requests = [chat(seed) for seed in range(6)]
    alone = [tiny_engine.complete(one) for one in requests]
    # to the end of the context: its room after the prompt and a block of drafts (K = 4)
    assert [len(done.token_ids) for done in alone] == [CONTEXT - len(one.prompt_ids) - 4 for one in requests]
    on_demand = complete_together(tiny_engine, requests, kv_positions=2 * CONTEXT)
    reach = complete_together(tiny_engine, requests, kv_positions=2 * CONTEXT, admission="reach")
    expected = [done.token_ids for done in alone]
    assert [done.token_ids for done in on_demand] == expected and [done.token_ids for done in reach] == expected
    preempted, reserved = rooms
    # on demand all six start and the youngest give way; by reach two run at a time, none preempted
    assert preempted.preemptions > 0 and reserved.preemptions == 0
    assert sum(done.metrics["preemptions"] for done in on_demand) == preempted.preemptions
    assert all(done.metrics["preemptions"] == 0 for done in reach)
    for room in rooms:  # every block back: free, or cached for the prefix cache
        assert room.pool.available == room.pool.num_blocks and room.pool.num_used == 0
        assert not room.running and not room.preempted and not room.arrival


def test_a_preempted_sampled_request_continues_its_seeded_stream(tiny_engine, rooms):
    requests = [chat(seed, max_tokens=150, policy="rejection", temperature=0.8) for seed in range(4)]
    alone = [tiny_engine.complete(one).token_ids for one in requests]
    together = complete_together(tiny_engine, requests, kv_positions=320)
    assert [done.token_ids for done in together] == alone and rooms[0].preemptions > 0


@pytest.mark.parametrize("drafter", ["none", "pld", "model_tree"])
def test_preemption_keeps_every_drafter_exact(tiny_engine, rooms, drafter):
    requests = [chat(seed, drafter, max_tokens=120) for seed in range(4)]
    alone = [tiny_engine.complete(one).token_ids for one in requests]
    assert [done.token_ids for done in complete_together(tiny_engine, requests, kv_positions=288)] == alone
    assert rooms[0].preemptions > 0


def test_a_request_whose_reach_is_more_than_the_pool_fails_alone(tiny_engine):
    requests = [chat(0, max_tokens=40), chat(1, max_tokens=600)]
    with pytest.raises(SpecdecError, match="max_tokens=600 need 39 KV blocks; the pool holds 16"):
        complete_together(tiny_engine, requests, kv_positions=256)


def test_a_dropped_cache_gives_its_blocks_back_and_keeps_its_published_ones_cached():
    pool = KVPool(num_layers=1, num_blocks=8, growable=False)
    cache = PagedKV()
    cache.reserve(pool, 40)  # 3 blocks
    cache.advance(40)
    cache.publish(list(range(40)))  # 2 full blocks
    assert pool.available == 5 and cache.blocks_wanted(64, pool.block_size) == 1
    cache.drop()
    assert (pool.available, pool.num_used, len(pool.idle), cache.table, cache.length) == (8, 0, 2, [], 0)
    again = PagedKV()
    assert again.reuse(pool, list(range(40))) == 32  # the published blocks, found again


@pytest.mark.parametrize(
    "engine, drafter",
    [("hydra_engine", {"name": "heads", "params": {"tree": "mc_sim_7b_63"}}), ("eagle3_engine", {"name": "eagle3"})],
)
def test_a_preempted_session_feeds_its_heads_every_position_again(request, rooms, engine, drafter):
    engine = request.getfixturevalue(engine)
    requests = [
        GenerationRequest(prompt_ids=repeating_prompt(seed), drafter=drafter, sampling={"max_tokens": 100})
        for seed in range(4)
    ]
    alone = [engine.complete(one).token_ids for one in requests]
    assert [done.token_ids for done in complete_together(engine, requests, kv_positions=256)] == alone
    assert rooms[0].preemptions > 0


def test_kv_pressure_reports_both_admissions(tiny_engine):
    from specdec_core.tools.measuring.kv_pressure import pressure_row

    requests = [chat(seed, "pld", max_tokens=60) for seed in range(3)]
    alone = [tiny_engine.complete(one).token_ids for one in requests]
    rows = [pressure_row(tiny_engine, requests, alone, admission, 160) for admission in ("reach", "on_demand")]
    assert [row["same as alone"] for row in rows] == ["3/3", "3/3"]
    assert rows[0]["preemptions"] == 0 and rows[1]["preemptions"] > 0 and rows[1]["preempted chats"] >= 1
    # by reach (prompt, 60 tokens and 4 drafts: 5 blocks) two of the 10 blocks' pool run at a time
    assert rows[0]["rows a step (mean / most)"].endswith("/ 2") and rows[0]["tokens"] == rows[1]["tokens"] == 180
