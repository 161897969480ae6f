"""Verification of a candidate tree (tree.py) against the target's logits at every node, one
path per leaf (the topology's retrieve rows). Greedy: a path keeps its nodes while each node's
token is the target's argmax at its parent; the best path is the longest kept, ties going to the
higher total target log-probability of its kept tokens; the next token is the argmax at the
path's last kept node, so greedy tree decoding emits what target-only greedy decoding does."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import Topology


@dataclass
class TreeVerdict:
    nodes: list[int]  # the root (0) and the accepted path's nodes, tree node indices
    next_token: int  # the target's own token after them

    @property
    def num_accepted(self) -> int:
        return len(self.nodes) - 1


def verify_tree_greedy(tokens: torch.Tensor, logits: torch.Tensor, tree: Topology) -> TreeVerdict:
    """`tokens` [N + 1]: the root then the nodes; `logits` [N + 1, V]: the target's at each."""
    retrieve = tree.retrieve_indices.to(logits.device)  # [L, D + 1], -1 past a leaf
    present = retrieve >= 0
    nodes = retrieve.clamp(min=0)
    predicted = logits.argmax(-1)
    log_probs = torch.log_softmax(logits, -1)
    child, parent = nodes[:, 1:], nodes[:, :-1]
    child_tokens = tokens.to(logits.device)[child]
    matches = (child_tokens == predicted[parent]) & present[:, 1:]
    kept = matches.long().cumprod(-1)  # 1 while every node so far matched
    num_kept = kept.sum(-1)
    path_log_probs = (log_probs[parent, child_tokens] * kept).sum(-1)
    longest = num_kept == num_kept.max()
    best = int(torch.where(longest, path_log_probs, torch.full_like(path_log_probs, -torch.inf)).argmax())
    accepted = int(num_kept[best])
    path = nodes[best, : accepted + 1].tolist()
    return TreeVerdict(nodes=path, next_token=int(predicted[path[-1]]))
