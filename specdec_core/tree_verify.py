"""Which path of a candidate tree (tree.py) the target accepts, given per-node accept flags from
a policy's rule (greedy: the node's token is the target's argmax at its parent; typical: its
probability there clears the typical threshold). A path keeps its nodes while each is accepted;
the best path is the longest kept, ties going to the higher total target log-probability of the
kept tokens."""

from __future__ import annotations

import torch

from .tree import Topology


def best_path(tree: Topology, node_accepted: torch.Tensor, node_log_probs: torch.Tensor) -> list[int]:
    """`node_accepted` [N] bool and `node_log_probs` [N] (each node's token under the target at
    its parent); returns the root (0) and the best path's kept nodes."""
    retrieve = tree.retrieve_indices.to(node_accepted.device)  # [L, D + 1], -1 past a leaf
    nodes = retrieve[:, 1:].clamp(min=0)
    present = retrieve[:, 1:] >= 0
    kept = (node_accepted[(nodes - 1).clamp(min=0)] & present).long().cumprod(-1).bool()  # all so far passed
    num_kept = kept.sum(-1)
    # where, not a product: a compact row gives unlisted tokens -inf, and -inf * 0 is nan
    scores = torch.where(kept, node_log_probs[(nodes - 1).clamp(min=0)], 0.0).sum(-1)
    scores = torch.where(num_kept == num_kept.max(), scores, torch.full_like(scores, -torch.inf))
    best = int(scores.argmax())
    return retrieve[best, : int(num_kept[best]) + 1].tolist()
