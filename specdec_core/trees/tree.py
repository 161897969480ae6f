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
- `retrieve_indices` [L, D+1]: the root-to-leaf node paths, one per leaf, padded with -1;
- `levels`: per depth, its nodes, their parents and their last ranks, for drafters that expand a
  tree depth by depth (a draft model, Hydra's heads): node n is its parent's rank-th child;
- `top1_path`: the nodes of paths (0,), (0, 0), .., root first (the chain of top-1 guesses);
- `earlier_siblings` [N, N] bool: node m (column) shares node n's (row) parent and ranks before it;
- `inner` [I]: the nodes that have children, the root (0) first; `parent_inner` [N]: where each
  node's parent lies among them (rules that read p at every node's parent warp only these rows);
- `first_leaf` [N]: the first row of `retrieve_indices` through each node (which of two equally
  good paths a rule takes: the first leaf's, as `tree_verify.best_path` does).

A `TopologyBank` builds several once, so switching trees between steps is a lookup."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import torch

from ..api.errors import SpecdecError

Path = tuple[int, ...]
# a tree given by its paths in its name ("paths:0;1;0.0"): a dynamic tree (dynamic_tree.py), built
# per step, that travels between workers by name like the others
LISTED = "paths:"
MAX_LISTED_NODES, MAX_LISTED_RANK = 256, 64


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
    levels: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]  # per depth: (nodes, parents, ranks)
    top_k: int
    top1_path: tuple[int, ...]
    earlier_siblings: torch.Tensor
    inner: torch.Tensor
    parent_inner: torch.Tensor
    first_leaf: torch.Tensor

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
        levels = tuple(
            (nodes, parents[nodes], torch.tensor([ordered[node - 1][-1] for node in nodes.tolist()]))
            for nodes in (torch.nonzero(depths == depth).flatten() for depth in range(1, width))
        )
        top1_path = (0, *(node_of[(0,) * depth] for depth in range(1, width) if (0,) * depth in node_of))
        # siblings follow each other in rank order, so an earlier sibling is a lower-numbered one
        earlier_siblings = (parents[1:, None] == parents[None, 1:]).tril(-1)
        inner, parent_inner = parents[1:].unique(return_inverse=True)  # sorted: the root first
        first_leaf = torch.tensor(
            [next(row for row, leaf in enumerate(leaves) if leaf[: len(path)] == path) for path in ordered]
        )
        return cls(
            name,
            ordered,
            mask,
            depths,
            parents,
            candidate_index,
            retrieve,
            levels,
            top_k,
            top1_path,
            earlier_siblings,
            inner,
            parent_inner,
            first_leaf,
        )

    @property
    def num_nodes(self) -> int:
        """Tree nodes after the root."""
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return self.retrieve_indices.shape[1] - 1


class TopologyBank:
    """Named topologies, each built once (`Topology.build`). Every name resolves through `get`.
    Derived names are built on first use: "NAME@D" names the tree's nodes of depth <= D (what fits
    before a request's last tokens), "A+B" the union of trees' paths (every node a schedule may
    verify). Requests pick named trees only (`named_only`); the derived ones a process has built
    are kept least-recently-used, at most `max_derived`, since their names come off the wire."""

    def __init__(self, trees: Mapping[str, Iterable[Sequence[int]]], max_derived: int = 256):
        self.named = {name: Topology.build(name, paths) for name, paths in trees.items()}
        self.max_derived = max_derived
        self.derived: OrderedDict[str, Topology] = OrderedDict()
        self.indices: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()

    def get(self, name: str, named_only: bool = False) -> Topology:
        """The tree `name`: a registered one, or (unless `named_only`: a request's choice) a
        derived one. An unknown name is the caller's error (SpecdecError, naming the known)."""
        if name in self.named:
            return self.named[name]
        base, depth = split_depth(name)
        listed = name.startswith(LISTED) and depth is None
        if named_only or (depth is None and "+" not in name and not listed):
            derived = "" if named_only else " (or NAME@DEPTH, A+B, paths:..)"
            raise SpecdecError(f"unknown tree {name!r}; known: {', '.join(self.names())}{derived}")
        if name not in self.derived:
            if depth is not None:
                paths = [path for path in self.get(base).paths if len(path) <= depth]
            elif listed:
                paths = listed_paths(name)
            else:
                paths = list(dict.fromkeys(path for part in name.split("+") for path in self.get(part).paths))
            self.derived[name] = Topology.build(name, paths)
        return recent(self.derived, name, self.max_derived)

    def add(self, name: str, paths: Iterable[Sequence[int]]) -> Topology:
        """Register a tree (e.g. from a `specdec frontier` bank file); a name keeps its paths."""
        if "@" in name or "+" in name:
            raise ValueError(f"tree name {name!r} may not hold '@' or '+' (NAME@DEPTH and A+B name derived trees)")
        tree = Topology.build(name, paths)
        if name in self.named and self.named[name].paths != tree.paths:
            raise ValueError(f"tree {name!r} is already registered with other paths")
        self.named[name] = tree
        return tree

    def limited(self, name: str, max_depth: int) -> Topology:
        """The tree `name`, or its nodes of depth <= `max_depth` where it is deeper."""
        tree = self.get(name)
        return tree if tree.max_depth <= max_depth else self.get(f"{split_depth(name)[0]}@{max_depth}")

    def node_index(self, name: str, within: str) -> torch.Tensor:
        """Where each node of tree `name` lies among the nodes of tree `within` (which holds all of
        its paths), so that one's node tokens gather from the other's."""
        if (name, within) not in self.indices:
            position = {path: index for index, path in enumerate(self.get(within).paths)}
            self.indices[name, within] = torch.tensor([position[path] for path in self.get(name).paths])
        return recent(self.indices, (name, within), self.max_derived)

    def names(self) -> list[str]:
        return sorted(self.named)


def listed_name(paths: Iterable[Sequence[int]]) -> str:
    """The name that lists a tree's paths (`TopologyBank.get` builds the tree from it)."""
    return LISTED + ";".join(".".join(map(str, path)) for path in check_paths(paths))


def listed_paths(name: str) -> list[Path]:
    """The paths a `listed_name` lists (a name off the wire: SpecdecError where it is malformed)."""
    parts = name[len(LISTED) :].split(";")
    if len(parts) > MAX_LISTED_NODES:
        raise SpecdecError(f"a listed tree has at most {MAX_LISTED_NODES} nodes; got {len(parts)}")
    try:
        paths = [tuple(int(rank) for rank in part.split(".")) for part in parts]
        if max(max(path, default=0) for path in paths) >= MAX_LISTED_RANK:
            raise ValueError(f"a rank is below {MAX_LISTED_RANK}")
        if listed_name(paths) != name:  # one name per tree: the derived trees' cache holds no variants
            raise ValueError("paths are listed by depth, then ranks, in canonical form")
    except ValueError as error:
        raise SpecdecError(f"tree {name[:80]!r}: {error}") from None
    return paths


def recent(cache: OrderedDict, key, capacity: int):
    """`cache[key]`, marked most recently used; the least recently used beyond `capacity` go."""
    cache.move_to_end(key)
    while len(cache) > capacity:
        cache.popitem(last=False)
    return cache[key]


def split_depth(name: str) -> tuple[str, Optional[int]]:
    """ "NAME@D" -> (NAME, D); any other name -> (name, None)."""
    base, _, depth = name.rpartition("@")
    return (base, int(depth)) if base and depth.isdigit() and int(depth) >= 1 else (name, None)
