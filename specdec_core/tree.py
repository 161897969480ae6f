"""Candidate trees for tree verification (Medusa's "choices" layout, built here from scratch).

A tree is a set of paths, each a tuple of top-k ranks per depth: (0,) is the first head's best
token, (0, 1) the second head's second-best token after it. Node 0 is the root, the last
committed token; the tree's nodes follow it in the order (depth, ranks), so every node's
ancestors come before it. From the paths alone `Topology` precomputes what one target forward
over `[root, nodes...]` and its verification need:

- `attention_mask` [N+1, N+1] bool: node i sees node j iff j is i or one of its ancestors;
- `depths` [N+1]: each node's position offset after the root (the root 0);
- `parents` [N+1]: each node's parent (the root -1);
- `candidate_index` [N]: where node n's token lies in a [depth, top_k] table of candidates
  (row depth - 1, column its last rank), flattened;
- `retrieve_indices` [L, D+1]: the root-to-leaf node paths, one per leaf, padded with -1.

A `TopologyBank` builds several once, so switching trees between steps is a lookup."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

Path = tuple[int, ...]


def check_paths(paths: Iterable[Sequence[int]]) -> tuple[Path, ...]:
    """The tree's paths sorted by (depth, ranks); raises ValueError for an empty path, a negative
    rank, a duplicate, or a path whose parent is missing."""
    ordered = sorted({tuple(path) for path in paths}, key=lambda path: (len(path), path))
    listed = [tuple(path) for path in paths]
    if len(ordered) != len(listed):
        raise ValueError("a tree lists a path twice")
    present = set(ordered)
    for path in ordered:
        if not path or min(path) < 0:
            raise ValueError(f"path {list(path)}: a path is a non-empty list of ranks >= 0")
        if len(path) > 1 and path[:-1] not in present:
            raise ValueError(f"path {list(path)} has no parent {list(path[:-1])} in the tree")
    if not ordered:
        raise ValueError("a tree needs at least one path")
    return tuple(ordered)


@dataclass(frozen=True)
class Topology:
    name: str
    paths: tuple[Path, ...]
    attention_mask: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    candidate_index: torch.Tensor
    retrieve_indices: torch.Tensor
    top_k: int

    @classmethod
    def build(cls, name: str, paths: Iterable[Sequence[int]]) -> "Topology":
        ordered = check_paths(paths)
        node_of = {path: index + 1 for index, path in enumerate(ordered)}
        size = len(ordered) + 1
        top_k = max(max(path) for path in ordered) + 1
        parents = torch.full((size,), -1, dtype=torch.long)
        depths = torch.zeros(size, dtype=torch.long)
        mask = torch.eye(size, dtype=torch.bool)
        mask[:, 0] = True
        for path, node in node_of.items():
            depths[node] = len(path)
            parents[node] = node_of.get(path[:-1], 0)
            for depth in range(1, len(path)):
                mask[node, node_of[path[:depth]]] = True
        candidate_index = torch.tensor([(len(path) - 1) * top_k + path[-1] for path in ordered], dtype=torch.long)
        leaves = [path for path in ordered if not any(other[:-1] == path for other in ordered)]
        width = max(len(path) for path in ordered) + 1
        retrieve = torch.full((len(leaves), width), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            retrieve[row, 0] = 0
            for depth in range(1, len(leaf) + 1):
                retrieve[row, depth] = node_of[leaf[:depth]]
        return cls(name, ordered, mask, depths, parents, candidate_index, retrieve, top_k)

    @property
    def num_nodes(self) -> int:
        """Tree nodes after the root."""
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return self.retrieve_indices.shape[1] - 1


class TopologyBank:
    """Named topologies, each built once (`Topology.build`); `get` is a lookup. "NAME@D" names
    the tree's nodes of depth <= D (what fits before a request's last tokens), built on first use."""

    def __init__(self, trees: Mapping[str, Iterable[Sequence[int]]]):
        self.topologies = {name: Topology.build(name, paths) for name, paths in trees.items()}
        self.known = sorted(self.topologies)

    def get(self, name: str) -> Topology:
        if name not in self.topologies:
            base, _, depth = name.partition("@")
            if base not in self.known or not depth.isdigit() or int(depth) < 1:
                raise KeyError(f"unknown tree {name!r}; known: {', '.join(self.known)} (or NAME@DEPTH)")
            paths = [path for path in self.topologies[base].paths if len(path) <= int(depth)]
            self.topologies[name] = Topology.build(name, paths)
        return self.topologies[name]

    def add(self, name: str, paths: Iterable[Sequence[int]]) -> Topology:
        """Register a tree (e.g. from a `specdec frontier` bank file); a name keeps its paths."""
        tree = Topology.build(name, paths)
        if name in self.topologies and self.topologies[name].paths != tree.paths:
            raise ValueError(f"tree {name!r} is already registered with other paths")
        if "@" in name:
            raise ValueError(f"tree name {name!r} may not hold '@' (NAME@DEPTH names a depth limit)")
        self.topologies[name] = tree
        self.known = sorted({*self.known, name})
        return tree

    def limited(self, name: str, max_depth: int) -> Topology:
        """The tree `name` (NAME or NAME@D), or its nodes of depth <= `max_depth` where it is deeper."""
        tree = self.get(name)
        base = name.partition("@")[0]
        return tree if tree.max_depth <= max_depth else self.get(f"{base}@{max_depth}")

    def __contains__(self, name: str) -> bool:
        try:
            self.get(name)
        except KeyError:
            return False
        return True

    def names(self) -> list[str]:
        return self.known
