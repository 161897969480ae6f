"""EntMTP's offline tree search (specdec_core/tools/training/frontier_search.py): the greedy replay of a tree equals
what the engine accepts with it, and Algorithm 1 grows trees by what-if scoring, as the paper
states it."""

from __future__ import annotations

import pytest
import torch

from specdec_core import GenerationRequest
from specdec_core.tools.training.frontier_search import (
    accept_lengths,
    acceptance_frontier,
    next_children,
    own_acceptance,
    rank_table,
    visited_starts,
)
from specdec_core.trees.topologies import default_bank

from helpers.tiny_models import repeating_prompt


@pytest.mark.parametrize("tree", ["medusa_8", "chain_4", "mc_sim_7b_63"])
def test_the_replay_of_a_tree_is_what_the_engine_accepts_with_it(heads_engine, tree):
    heads = heads_engine.heads["medusa"]
    topology = default_bank().limited(tree, heads.num_heads)
    for seed in (0, 1, 5):
        prompt = repeating_prompt(seed)
        sampling = {"max_tokens": 40}
        output = heads_engine.complete(GenerationRequest(prompt_ids=prompt, sampling=sampling)).token_ids
        table = rank_table(heads_engine.target_model, heads, prompt, output, topology.top_k)
        run = heads_engine.complete(
            GenerationRequest(
                prompt_ids=prompt,
                sampling=sampling,
                drafter={"name": "heads", "params": {"tree": tree, "adaptive": False}},
            )
        )
        lengths = accept_lengths(table, topology.paths)
        starts = visited_starts(lengths)
        assert len(starts) == run.metrics["num_steps"]
        assert int(lengths[starts].sum()) == run.metrics["spec_decode_num_accepted_tokens"] > 0
        assert own_acceptance([table], topology.paths) == int(lengths[starts].sum()) / len(starts)
        # a guess past the table's width is never credited (a miss is not a rank)
        assert not accept_lengths(table, [(topology.top_k,)]).any()


def test_algorithm_1_adds_the_best_what_if_extension_with_its_tie_breaks():
    # rows are step starts, columns heads: the true token's rank among each head's guesses (-1: none)
    table = torch.tensor([[0, 1, -1], [0, 0, -1], [1, 0, 0], [0, 1, 0], [2, -1, -1], [0, 1, 1], [0, -1, -1], [-1] * 3])
    assert sorted(next_children([(0,), (0, 0), (1,)], 3)) == [(0, 0, 0), (0, 1), (1, 0), (2,)]
    assert next_children([(0,)], 1) == [(1,)]
    frontier = acceptance_frontier([table], max_depth=3, budget=4)
    # (0,) then: (1,) (what-if 1.0 over (0, 0)'s 0.75); (1, 0) ties (2,) at 1.0 and wins on its
    # smaller rank sum; (1, 0, 0) at 5/3
    assert [point.paths[-1] for point in frontier] == [(0,), (1,), (1, 0), (1, 0, 0)]
    assert [point.estimate for point in frontier[1:]] == pytest.approx([1.0, 1.0, 5 / 3])
    # own rollouts: {(0,)} visits starts 0, 2, 3, 5 (3 drafts in 4 steps); {(0,), (1,)} visits
    # 0, 2, 4, 5 (the what-if credited it at 0, 2, 3, 5: biased up); with (1, 0): 0, 2, 5
    assert [point.own for point in frontier] == pytest.approx([3 / 4, 3 / 4, 4 / 3, 5 / 3])
