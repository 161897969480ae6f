"""EAGLE-2's dynamic tree (specdec_core/trees/dynamic_tree.py) over a drafter whose next-token
probabilities are known, and trees named by their paths (tree.py's `listed_name`)."""

from __future__ import annotations

import math

import pytest
import torch

from specdec_core.api.errors import SpecdecError
from specdec_core.trees.dynamic_tree import DynamicTree, grow
from specdec_core.trees.topologies import default_bank
from specdec_core.trees.tree import listed_name, listed_paths

# every node's children: probabilities 0.6, 0.3, 0.1 (tokens 10 * depth + rank)
PROBS = torch.tensor([0.6, 0.3, 0.1]).log()


def expand(frontier, tokens):
    assert all(path in tokens for path in frontier)  # each frontier node's token is known
    return PROBS.expand(len(frontier), -1), torch.tensor(
        [[10 * (len(path) + 1) + rank for rank in range(3)] for path in frontier]
    )


def test_a_dynamic_tree_expands_the_most_valuable_nodes_and_keeps_the_best_as_a_tree():
    paths, tokens, probs = grow(DynamicTree(top_k=2, depth=3, nodes=6), (PROBS[:2], torch.tensor([10, 11])), expand)
    value = {path: sum(math.log([0.6, 0.3, 0.1][rank]) for rank in path) for path in paths}
    # depth 1: (0,) 0.6, (1,) 0.3; the frontier after: (0,0) 0.36, (0,1) 0.18, not (1,0) 0.18 (later in order)
    assert paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert tokens == [10, 11, 20, 21, 20, 30]
    assert probs == pytest.approx([0.6, 0.3, 0.6, 0.3, 0.6, 0.6])  # each node's after its parent
    assert all(path[:-1] in value or len(path) == 1 for path in paths)  # every parent kept
    # the best left out, (0, 0, 1) or (0, 1, 0), are worth 0.108: less than any node kept
    assert min(value.values()) > math.log(0.6 * 0.6 * 0.3)


def test_a_dynamic_tree_is_named_by_its_shape_and_travels_by_its_paths():
    assert DynamicTree.parse("dynamic_k10_d8_n59") == DynamicTree(10, 8, 59)
    with pytest.raises(SpecdecError, match="named dynamic_k<K>_d<D>_n<N>"):
        DynamicTree.parse("dynamic_10")
    with pytest.raises(SpecdecError, match="K in 1..16"):
        DynamicTree.parse("dynamic_k99_d8_n59")
    with pytest.raises(SpecdecError, match="named dynamic_k<K>_d<D>_n<N>"):
        DynamicTree.parse("dynamic_x1_y2_z3")
    paths = [(0,), (1,), (0, 0), (0, 1), (0, 0, 2)]
    name = listed_name(paths)
    assert name == "paths:0;1;0.0;0.1;0.0.2" and listed_paths(name) == paths
    tree = default_bank().get(name)
    assert tree.paths == tuple(paths) and default_bank().limited(name, 2).paths == tuple(paths[:4])
    hostile = ("paths:0.99", "paths:1;0", "paths:0;0", "paths:1.x", "paths:0.1", "paths:" + ";".join(["0"] * 300))
    for bad in hostile:  # a huge rank, not canonical, a duplicate, not a number, no parent, too many
        with pytest.raises(SpecdecError):
            default_bank().get(bad)
