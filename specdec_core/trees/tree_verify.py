"""Which path of a candidate tree (tree.py) the target accepts under a per-node rule, one tree at
a time: greedy's, where the step's argmax rows were not read back (processed rows).

Given per-node accept flags (a node's token is the target's argmax at its parent), `best_path`: a
path keeps its nodes while each is accepted; the best path is the longest kept, ties going to the
higher total target log-probability of the kept tokens, then to the first leaf's. Sampled trees,
many at once: policies/sampled_trees.py."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .tree import Topology


def best_path(
    tree: Topology,
    node_accepted: torch.Tensor,
    node_log_probs: torch.Tensor,
    next_token: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[list[int], int]:
    """`node_accepted` [N] bool and `node_log_probs` [N] (each node's token under the target at
    its parent); returns the root (0) and the best path's kept nodes, and the token after its last
    node (`next_token` of that node's index, a 0-d tensor), read back together once."""
    retrieve = tree.retrieve_indices.to(node_accepted.device)  # [L, D + 1], -1 past a leaf
    nodes = retrieve[:, 1:].clamp(min=0)
    present = retrieve[:, 1:] >= 0
    kept = (node_accepted[(nodes - 1).clamp(min=0)] & present).long().cumprod(-1).bool()  # all so far passed
    num_kept = kept.sum(-1)  # [L]
    # where, not a product: a compact row gives unlisted tokens -inf, and -inf * 0 is nan
    scores = torch.where(kept, node_log_probs[(nodes - 1).clamp(min=0)], 0.0).sum(-1)
    scores = torch.where(num_kept == num_kept.max(), scores, torch.full_like(scores, -torch.inf))
    best = scores.argmax()
    row, length = retrieve[best], num_kept[best]  # [D + 1], its kept nodes
    path = torch.where(torch.arange(len(row), device=row.device) <= length, row, -1)  # -1 past the kept
    read = torch.cat([path, next_token(row[length]).reshape(1)]).tolist()
    return [node for node in read[:-1] if node >= 0], read[-1]


def kept_chain(parents: Sequence[int], node_accepted: Sequence[bool]) -> Optional[list[int]]:
    """`best_path` on the host, where no two passing nodes share a parent (greedy over siblings of
    distinct tokens: a node passes only with its parent's argmax): the kept nodes then form one
    chain from the root, and no score is needed to choose. `parents`: the tree's `[N + 1]` (nodes
    follow their parents); None where two siblings pass."""
    passing = [node for node, accepted in enumerate(node_accepted, 1) if accepted]
    if len({parents[node] for node in passing}) < len(passing):
        return None
    path = [0]
    for node in passing:
        if parents[node] == path[-1]:
            path.append(node)
    return path
