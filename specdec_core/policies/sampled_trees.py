"""Sampled trees decided together: many requests' trees under a rule that has a tree rule for
them (rejection sampling's walk, typical acceptance's best kept path) in a fixed number of tensor
operations and one read back, as sampled_chains.py decides chains. `SampledTrees` lays out one
rule's trees of one warp setting; the rule (`AcceptancePolicy.tree_paths`) says which nodes are on
each accepted path and samples each next token. A request's draws come from its own generator on
the host, before any device work, in its rule's order (a uniform per node where the rule draws
them, then one for the next token), so a tree is decided alike in a batch or alone.

Vocabulary: B trees, N the most nodes of one (trees padded to it), R the target rows holding them
(each tree's root row, then its nodes'), I the rows of nodes that have children (roots included),
V the vocabulary."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from ..api.sampling import SamplingParams, warp_logits
from ..loop.stage_types import Verdict
from ..trees.tree import Topology
from .sampled_chains import Check, Decided, draw, joined, read_back, warp_groups


@dataclass
class SampledTrees:
    """B trees of one rule and one warp setting, padded to N nodes, on the target's device."""

    checks: list[Check]
    rows: torch.Tensor  # [R, V] the target's rows of every tree
    root_rows: list[int]  # each tree's root row among the R
    roots: torch.Tensor  # [B] the same on the device
    parents: torch.Tensor  # [B, N] each node's parent (0: the root; padding: -1, no node's parent)
    tokens: torch.Tensor  # [B, N] each node's token (padding: 0)
    uniform: Optional[torch.Tensor]  # [B, N] float64, a draw per node (rules that draw them)
    next_uniform: torch.Tensor  # [B, 1] float64, each tree's draw for its next token

    @property
    def trees(self) -> list[Topology]:
        return [check.draft.tree for check in self.checks]

    @property
    def sampling(self) -> SamplingParams:
        return self.checks[0].sampling

    @property
    def real(self) -> torch.Tensor:
        """`[B, N]` bool: a tree's nodes, not padding."""
        return self.parents >= 0

    def on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.parents.device, non_blocking=True)

    def padded(self, per_tree: list[torch.Tensor]) -> torch.Tensor:
        """`[B, N]` on the device of each tree's `[N_b]` (zero past it)."""
        return self.on_device(pad_sequence(per_tree, batch_first=True))

    def per_tree(self, values: Sequence[float]) -> torch.Tensor:
        """A per-tree setting (a policy's parameter) `[B, 1]` float32 on the device."""
        return self.on_device(torch.tensor(values, dtype=torch.float32)[:, None])

    def square(self, matrices: list[torch.Tensor]) -> torch.Tensor:
        """`[B, N, N]` on the device of each tree's `[N_b, N_b]` matrix, zero (False) past it; one
        matrix expanded where every tree is the same."""
        width = self.parents.shape[1]
        if all(matrix is matrices[0] for matrix in matrices) and len(matrices[0]) == width:
            return self.on_device(matrices[0]).expand(len(matrices), width, width)
        padded = torch.zeros(len(matrices), width, width, dtype=matrices[0].dtype)
        for index, matrix in enumerate(matrices):
            padded[index, : len(matrix), : len(matrix)] = matrix
        return self.on_device(padded)

    def warped_probs(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The warped logits and distributions `[.., V]` at `rows` (indices among the R)."""
        warped = warp_logits(self.rows[rows], self.sampling)
        return warped, warped.softmax(-1)

    def inner_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of the nodes that have children `[I]` (among the R), and where each node's
        parent lies among them `[B, N]` (padding: 0): a rule that reads p at every node's parent
        warps these I rows, not all R."""
        inner, slots, first = [], [], 0
        for root, tree in zip(self.root_rows, self.trees):
            inner.append(root + tree.inner)
            slots.append(first + tree.parent_inner)
            first += len(tree.inner)
        return self.on_device(torch.cat(inner)), self.on_device(pad_sequence(slots, True, 0))


def lay_out(checks: list[Check], draws: list[tuple]) -> SampledTrees:
    """One rule's trees of one warp, their layout built on the host and copied to the device
    without waiting for it."""
    device = checks[0].target.logits.device

    def moved(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device, non_blocking=True)

    trees = [check.draft.tree for check in checks]
    rows, roots = stacked_rows([check.target.logits for check in checks])  # [R, V], [B]
    parents = pad_sequence([tree.parents[1:] for tree in trees], True, -1)  # [B, N]
    width = parents.shape[1]
    # the tokens lie on the device: padded by one copy into place, not one a tree
    slots = [row * width + node for row, tree in enumerate(trees) for node in range(tree.num_nodes)]  # [sum of N_b]
    slots = moved(torch.tensor(slots))
    tokens = moved(joined([check.draft.tokens for check in checks]))  # [sum of N_b]
    tokens = tokens.new_zeros(len(trees) * width).index_copy_(0, slots, tokens).view(len(trees), width)  # [B, N]
    uniform = pad_sequence([per_node for per_node, _ in draws], True) if draws[0][0] is not None else None
    return SampledTrees(
        checks,
        rows,
        roots,
        moved(torch.tensor(roots)),
        moved(parents),
        tokens,
        None if uniform is None else moved(uniform),
        joined([next_draw for _, next_draw in draws]),
    )


def decide_trees(checks: Sequence[Check]) -> list[Verdict]:
    """The verdicts of sampled trees (`Check.decided_together`), each as it would be alone, with
    one read back."""
    return read_back([trees_decided(checks)])[0]


def trees_decided(checks: Sequence[Check]) -> Decided:
    """Sampled trees decided on the device: per warp group, every node's flag (on the path or not)
    `[B * N]`, then every next token `[B]`, to read."""
    # on the host, before any device work; float64, as the masses the node draws are weighed against
    draws = [draw(check, torch.float64) for check in checks]
    groups = warp_groups(checks)
    decided = []
    for indices in groups:
        rule = type(checks[indices[0]].policy)
        decided.append(rule.tree_paths(lay_out([checks[i] for i in indices], [draws[i] for i in indices])))

    def verdicts(values: list[int]) -> list[Verdict]:
        made: list[Optional[Verdict]] = [None] * len(checks)
        offset = 0
        for indices, (on_path, _) in zip(groups, decided):
            width = on_path.shape[1]
            for row, index in enumerate(indices):
                flags = values[offset + row * width : offset + row * width + checks[index].draft.num_tokens]
                path = [0, *(node for node, taken in enumerate(flags, 1) if taken)]
                made[index] = Verdict.of_path(path, values[offset + len(indices) * width + row])
            offset += len(indices) * (width + 1)
        return made

    parts = [part for on_path, next_tokens in decided for part in (on_path.flatten().long(), next_tokens)]
    return Decided(torch.cat(parts), verdicts)


def stacked_rows(blocks: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The rows of `blocks` (`[T_b, V]` each) as one `[R, V]` tensor, and where each block's first
    row lies in it. Where every block is rows of one contiguous tensor (a step's LM head output,
    split per request) that tensor's rows are viewed in place, not copied; otherwise the blocks
    are concatenated."""
    first, width = blocks[0], blocks[0].shape[-1]
    storage = first.untyped_storage().data_ptr()
    offsets = [block.storage_offset() for block in blocks]
    low = min(offsets)
    if all(
        block.is_contiguous()
        and block.untyped_storage().data_ptr() == storage
        and block.dtype == first.dtype
        and block.shape[-1] == width
        and (offset - low) % width == 0
        for block, offset in zip(blocks, offsets)
    ):
        high = max(offset + block.numel() for block, offset in zip(blocks, offsets))
        return first.as_strided(((high - low) // width, width), (width, 1), low), [(o - low) // width for o in offsets]
    return torch.cat(blocks), [0, *itertools.accumulate(len(block) for block in blocks[:-1])]
