"""EAGLE-2's dynamic draft tree (Li et al., 2024, "EAGLE-2: Faster Inference of Language Models
with Dynamic Draft Trees"): a tree grown per step from the drafter's own confidence, instead of a
fixed shape.

A node's value is the product of the draft probabilities on its path (a sum of log-probs here).
The root's top-k tokens are depth 1; each further depth expands the k most valuable nodes of the
depth before (the frontier), each into its top-k children, and keeps the k most valuable of those
k * k as the next frontier; then every node met is reranked by value and the best `nodes` kept.
A child is never worth more than its parent (a probability is at most 1), so the kept nodes, taken
by value and then by depth, hold every kept node's parent: they form a tree. A node's path is its
ranks among its parent's top-k, the form of tree.py's trees (`listed_name` names it).

Vocabulary: k the top-k, F the frontier's nodes (k, or fewer at depth 1)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..api.errors import SpecdecError
from .topologies import default_bank
from .tree import Path

PREFIX = "dynamic_"


@dataclass(frozen=True)
class DynamicTree:
    """The shape of a dynamic tree: `top_k` children per expanded node, paths of at most
    `depth` tokens, `nodes` kept. Named `dynamic_k{top_k}_d{depth}_n{nodes}` in a guess call."""

    top_k: int
    depth: int
    nodes: int

    @property
    def name(self) -> str:
        return f"{PREFIX}k{self.top_k}_d{self.depth}_n{self.nodes}"

    @classmethod
    def parse(cls, name: str) -> "DynamicTree":
        parts = name.removeprefix(PREFIX).split("_")
        try:
            if [part[:1] for part in parts] != ["k", "d", "n"]:
                raise ValueError
            top_k, depth, nodes = (int(part[1:]) for part in parts)
        except ValueError:
            raise SpecdecError(f"a dynamic tree is named {PREFIX}k<K>_d<D>_n<N>; got {name[:80]!r}") from None
        if not (1 <= top_k <= 16 and 1 <= depth <= 16 and 1 <= nodes <= 128):
            raise SpecdecError(f"dynamic tree {name!r}: K in 1..16, D in 1..16 and N in 1..128")
        return cls(top_k, depth, nodes)


def check_guess_tree(name: str) -> None:
    """A guess call's tree: a dynamic tree's shape or a tree of the bank (SpecdecError if neither)."""
    if name.startswith(PREFIX):
        DynamicTree.parse(name)
    else:
        default_bank().get(name)


# (log-probs [F, k] best first, tokens [F, k]) of the top-k next tokens after each of the F
# frontier nodes (by path), given every node's token so far
Expand = Callable[[list[Path], dict[Path, int]], tuple[torch.Tensor, torch.Tensor]]


def grow(
    shape: DynamicTree, root: tuple[torch.Tensor, torch.Tensor], expand: Expand
) -> tuple[list[Path], list[int], list[float]]:
    """The kept nodes' paths (by depth, then ranks), tokens and draft probabilities (each after
    its parent), from the root's top-k `(log-probs [k], tokens [k])` and `expand` for each frontier."""
    values: dict[Path, float] = {}
    tokens: dict[Path, int] = {}
    frontier: list[Path] = []
    log_probs, ids = (part.tolist() for part in root)  # one transfer from the device per depth
    for rank in range(min(shape.top_k, len(ids))):
        path = (rank,)
        values[path], tokens[path] = log_probs[rank], ids[rank]
        frontier.append(path)
    for _ in range(shape.depth - 1):
        log_probs, ids = (part.tolist() for part in expand(frontier, tokens))  # [F, k] each
        children = [
            ((*parent, rank), values[parent] + log_probs[row][rank], ids[row][rank])
            for row, parent in enumerate(frontier)
            for rank in range(len(log_probs[row]))
        ]
        for path, value, token in children:
            values[path], tokens[path] = value, token
        frontier = [path for path, _, _ in sorted(children, key=lambda child: -child[1])[: shape.top_k]]
    kept = sorted(values, key=lambda path: (-values[path], len(path)))[: shape.nodes]
    kept.sort(key=lambda path: (len(path), path))
    probs = [math.exp(values[path] - values.get(path[:-1], 0.0)) for path in kept]
    return kept, [tokens[path] for path in kept], probs
