"""Node budgets for candidate trees, shared by the tree drafters (`heads`, `eagle3`'s trees,
`model_tree`, `mla_tree`): how many of a drafted tree's nodes a step verifies.

A node's value is the product of the draft's probabilities on its path (EAGLE-2's value): the
chance, as the draft sees it, that the target keeps the node, so a step verifying a set of nodes
expects 1 + the sum of their values in tokens. The budget keeps the n most valuable nodes for the
n that maximizes expected tokens per unit of verify cost (block_length.best_length, the trade the
chain drafters make for their block length, over the same curve of the target's device). On a
CPU, where a verify grows with its tokens past ~5, that is a few nodes; on a GPU, where a verify of
a few hundred tokens costs little more than one does, every node worth more than the 0.5% of a
step its verify costs: most of the tree. A child is never worth more than its
parent (a probability is at most 1), so the n most valuable nodes, ties to the earlier node, hold
each kept node's parent: they form a tree, named by its paths (`paths:..`, tree.py).

Vocabulary: N the drafted tree's nodes after its root, n the nodes kept."""

from __future__ import annotations

from typing import Sequence

import torch

from ..loop.stage_types import DraftBlock
from ..trees.topologies import default_bank
from ..trees.tree import Topology, listed_name
from .block_length import best_length


def path_values(tree: Topology, node_probs: torch.Tensor) -> torch.Tensor:
    """Each node's value `[N]`: the product of `node_probs` `[N]` (each node's draft probability
    after its parent) over its path."""
    values = torch.ones(tree.num_nodes + 1, dtype=torch.float64)  # [N + 1], the root 1
    probs = torch.cat([values[:1], node_probs.detach().double().cpu()])
    for nodes, parents, _ in tree.levels:  # parents come a depth before their children
        values[nodes] = values[parents] * probs[nodes]
    return values[1:]


def budget_tree(
    tree: Topology,
    tokens: torch.Tensor,
    node_probs: torch.Tensor,
    verify_cost: Sequence[float],
    batch_rows: int = 1,
    offset: int = 0,
    min_nodes: int = 0,
) -> DraftBlock:
    """The block of `tree`'s most valuable nodes that pays best for its verify (`tokens` `[offset + N]`:
    `offset` tokens before the tree's, kept, as a run-ahead guess is), at least `min_nodes` of
    them; empty where none pays."""
    values = path_values(tree, node_probs)  # [N]
    value_of = values.tolist()
    order = sorted(range(tree.num_nodes), key=lambda node: (-value_of[node], node))
    expected = [1.0, *(1.0 + float(total) for total in values[order].cumsum(0))]
    kept, _ = best_length(expected, verify_cost, batch_rows=batch_rows)
    return kept_nodes(tree, tokens, sorted(order[: max(kept, min_nodes)]), offset)


def kept_nodes(tree: Topology, tokens: torch.Tensor, nodes: list[int], offset: int = 0) -> DraftBlock:
    """The block of `tree`'s nodes `nodes` (indices after the root, each one's parent kept)."""
    if len(nodes) == tree.num_nodes:
        return DraftBlock(tokens=tokens, tree=tree)
    if not nodes:
        return DraftBlock.empty() if not offset else DraftBlock(tokens=tokens[:offset], tree=None)
    kept = default_bank().get(listed_name([tree.paths[node] for node in nodes]))
    index = torch.tensor([offset + node for node in nodes], device=tokens.device)
    return DraftBlock(tokens=torch.cat([tokens[:offset], tokens[index]]), tree=kept)
