"""Node budgets (specdec_core/drafters/tree_budget.py): a drafted tree cut to the nodes that pay
for their verify on the target's device, and the curve each device gets by default."""

from __future__ import annotations

import math

import pytest
import torch

from specdec_core.drafters.block_length import VERIFY_COSTS, best_block, best_length, device_verify_cost
from specdec_core.drafters.tree_budget import budget_tree, kept_nodes, path_values
from specdec_core.trees.topologies import default_bank

TREE = default_bank().get("mc_sim_7b_63")


def rank_probs(tree, probs_by_rank):
    """Each node's probability after its parent from its last rank (Medusa's heads, roughly)."""
    return torch.tensor([probs_by_rank[path[-1]] for path in tree.paths])


def test_a_nodes_value_is_the_product_of_the_probabilities_on_its_path():
    probs = rank_probs(TREE, [0.5, 0.2] + [0.05] * 8)
    values = path_values(TREE, probs)
    for node, path in enumerate(TREE.paths):
        assert values[node] == pytest.approx(
            math.prod(0.5 if rank == 0 else 0.2 if rank == 1 else 0.05 for rank in path)
        )


def test_the_budget_keeps_the_most_valuable_nodes_as_a_tree():
    tokens = torch.arange(100, 100 + TREE.num_nodes)
    probs = rank_probs(TREE, [0.8, 0.1] + [0.01] * 8)
    block = budget_tree(TREE, tokens, probs, VERIFY_COSTS["cpu"])
    kept = block.tree.paths
    assert 1 <= len(kept) < TREE.num_nodes
    assert all(len(path) == 1 or path[:-1] in kept for path in kept)  # every parent kept
    values = dict(zip(TREE.paths, path_values(TREE, probs).tolist()))
    assert min(values[path] for path in kept) >= max(values[path] for path in TREE.paths if path not in kept)
    # each kept node carries its own token, in the kept tree's order
    assert block.tokens.tolist() == [100 + TREE.paths.index(path) for path in kept]
    # the budget is the cost model's best length over the nodes by value
    ordered = sorted(values.values(), reverse=True)
    expected = [1.0] + [1.0 + sum(ordered[:n]) for n in range(1, len(ordered) + 1)]
    assert len(kept) == best_length(expected, VERIFY_COSTS["cpu"]).length


def test_the_budget_follows_the_device_and_the_batch():
    tokens = torch.arange(TREE.num_nodes)
    probs = rank_probs(TREE, [0.7, 0.2, 0.1, 0.05, 0.05, 0.02, 0.02, 0.01, 0.01, 0.01])

    def kept(curve, rows=1):
        block = budget_tree(TREE, tokens, probs, curve, rows)
        return 0 if block.tree is None else block.tree.num_nodes

    cpu, cuda = kept(device_verify_cost("cpu")), kept(device_verify_cost("cuda"))
    assert cpu < 16 and cuda >= 3 * cpu  # a GPU verifies far larger trees than this CPU
    assert kept([1.0]) == TREE.num_nodes  # a free verify: the whole tree
    assert kept(device_verify_cost("cpu"), rows=64) < cpu  # under load a step holds fewer
    assert kept([100.0]) == 0 and budget_tree(TREE, tokens, probs, [100.0]).tokens.numel() == 0
    assert budget_tree(TREE, tokens, probs, [100.0], min_nodes=1).tree.paths == ((0,),)  # a learner's least
    assert device_verify_cost("mps") == device_verify_cost("cpu")  # unmeasured: the CPU's


def test_a_run_ahead_guess_before_the_tree_is_kept():
    tree = default_bank().get("medusa_8")
    tokens = torch.arange(50, 51 + tree.num_nodes)  # the guess 50, then the tree's nodes
    certain = budget_tree(tree, tokens, torch.ones(tree.num_nodes), [1.0], offset=1)
    assert certain.tree is tree and certain.tokens.tolist() == tokens.tolist()
    none = budget_tree(tree, tokens, torch.full((tree.num_nodes,), 1e-4), [2.0], offset=1)
    assert none.tree is None and none.tokens.tolist() == [50]  # the guess alone, a chain
    some = kept_nodes(tree, tokens, [0, 1], offset=1)
    assert some.tree.paths == tree.paths[:2] and some.tokens.tolist() == [50, 51, 52]


def test_best_block_is_best_length_over_a_geometric_acceptance():
    rate, curve = 0.7, VERIFY_COSTS["cpu"]
    expected = [sum(rate**j for j in range(k + 1)) for k in range(11)]
    assert best_block(rate, 10, curve) == pytest.approx(best_length(expected, curve))


def test_requests_are_priced_by_the_targets_device(tiny_engine, monkeypatch):
    from specdec_core import GenerationRequest

    frontend = tiny_engine.frontend

    def curve(drafter: dict, device: str):
        monkeypatch.setattr(frontend, "target_device", lambda: device)
        prepared = frontend.prepare(GenerationRequest(prompt_ids=[1, 2], drafter=drafter))
        return prepared.drafter.params.get("verify_cost")

    assert tiny_engine.frontend.target_device() == "cpu"
    assert curve({"name": "model_tree"}, "cpu") == list(VERIFY_COSTS["cpu"])
    assert curve({"name": "model"}, "cuda") == list(VERIFY_COSTS["cuda"])
    assert curve({"name": "model", "params": {"verify_cost": [1.5]}}, "cuda") == [1.5]  # the request's own
    assert curve({"name": "none"}, "cuda") is None  # nothing to price
