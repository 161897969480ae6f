"""EntMTP's offline tree search (its Section 3), for heads trees at temperature 0.

Greedy decoding emits the target's greedy tokens whatever the tree, so one forward over each
prompt and its greedy output gives everything a tree's acceptance depends on: at every position
p, the rank of each later true token among each head's guesses there (`rank_table`). A step that
starts at p (its root the token after p) accepts the node (r_1, .., r_d) iff head i's guess of
rank r_i is the true token for every i <= d; the step then moves p by its accepted length + 1.
So a tree's own rollout (`own_acceptance`) is a replay over the table, exact and without a
forward; at T > 0 this replay of greedy trajectories is an estimate.

`acceptance_frontier` is the paper's Algorithm 1: from the one-node tree, score every one-node
extension with a single rollout advanced by the current tree (the "what-if" probe: an
extension is credited at the positions the current tree visits, which its own rollout would not
all visit: the bias `own_acceptance` measures), add the best (ties: smaller rank sum, then
shallower), and repeat up to the node budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ...heads.medusa import MedusaHeads
from ...runtime.batching import forward_ragged
from ...runtime.kv_pool import PagedKV

Path = tuple[int, ...]


@torch.inference_mode()
def rank_table(
    model: torch.nn.Module, heads: MedusaHeads, prompt_ids: Sequence[int], output_ids: Sequence[int], width: int
) -> torch.Tensor:
    """`[n_starts, num_heads]` int: for the step whose root is the prompt's last token, then each
    output token in turn, the rank of the true token at depth d among head d-1's top-`width`
    guesses (-1 where it is not among them, or where the loop would not draft it: past the
    output's second-to-last token), so no node, whatever its rank, is accepted there."""
    sequence = list(prompt_ids) + list(output_ids)
    if len(prompt_ids) < 2:
        raise ValueError("a prompt needs 2 tokens: a step's guesses come from the position before its root")
    hidden, _ = forward_ragged(model, [PagedKV(len(sequence))], [sequence])
    lm_head = model.get_output_embeddings()
    start = len(prompt_ids) - 2  # the position whose state predicted the first root
    states = hidden[0, start : len(sequence) - 1]  # one per step start: the root is the next token
    guesses = heads(states[None], lm_head)[:, 0].topk(width, dim=-1).indices  # [num_heads, n_starts, width]
    # a step drafts at most up to the output's second-to-last token (the loop keeps one for the target)
    tokens = torch.tensor(sequence[:-1] + [-1] * (heads.num_heads + 2))
    # head d-1 at position p guesses token p + 1 + d: row r (p = start + r), head h -> start + r + 2 + h
    targets = tokens[start + 2 + torch.arange(states.shape[0])[:, None] + torch.arange(heads.num_heads)]
    hits = guesses.permute(1, 0, 2) == targets[..., None].to(guesses.device)  # [n_starts, num_heads, width]
    return torch.where(hits.any(-1), hits.int().argmax(-1), -1).cpu()


def node_acceptance(table: torch.Tensor, paths: Sequence[Path]) -> torch.Tensor:
    """`[n_starts, len(paths)]` bool: whether each node (a path listed after its parent) is
    accepted at a step starting there."""
    accepted: dict[Path, torch.Tensor] = {(): torch.ones(table.shape[0], dtype=torch.bool)}
    for path in paths:
        accepted[path] = accepted[path[:-1]] & (table[:, len(path) - 1] == path[-1])
    return torch.stack([accepted[path] for path in paths], dim=1)


def accept_lengths(table: torch.Tensor, paths: Sequence[Path]) -> torch.Tensor:
    """`[n_starts]`: the tree's accepted length at a step starting at each position."""
    if not paths:
        return torch.zeros(table.shape[0], dtype=torch.long)
    depths = torch.tensor([len(path) for path in paths])
    return (node_acceptance(table, paths) * depths).amax(dim=1)


def visited_starts(lengths: torch.Tensor) -> list[int]:
    """The step starts of a rollout whose step at start p accepts `lengths[p]` tokens."""
    starts, start = [], 0
    while start < len(lengths) - 1:  # the last start's root is the output's last token: no step
        starts.append(start)
        start += int(lengths[start]) + 1
    return starts


def own_acceptance(tables: Sequence[torch.Tensor], paths: Sequence[Path]) -> float:
    """Mean accepted drafts per step of the tree's own rollout over every table."""
    total, steps = 0, 0
    for table in tables:
        lengths = accept_lengths(table, paths)
        starts = visited_starts(lengths)
        total += int(lengths[starts].sum())
        steps += len(starts)
    return total / max(steps, 1)


def next_children(paths: Sequence[Path], max_depth: int) -> list[Path]:
    """Per node of the tree (and the root), its next child: the rank after its last child's."""
    children: dict[Path, int] = {(): 0}
    for path in paths:
        children[path[:-1]] = children.get(path[:-1], 0) + 1
        children.setdefault(path, 0)
    return [parent + (count,) for parent, count in children.items() if len(parent) < max_depth]


@dataclass
class FrontierPoint:
    paths: tuple[Path, ...]
    estimate: float  # Algorithm 1's what-if mean accepted drafts per step
    own: float = 0.0  # the tree's own rollout

    @property
    def num_nodes(self) -> int:
        return len(self.paths)


def acceptance_frontier(tables: Sequence[torch.Tensor], max_depth: int, budget: int) -> list[FrontierPoint]:
    """Algorithm 1 over the replay tables: the greedily grown trees of 1 .. `budget` nodes."""
    paths: list[Path] = [(0,)]
    frontier = [FrontierPoint(tuple(paths), own_acceptance(tables, paths))]
    while len(paths) < budget:
        candidates = next_children(paths, max_depth)
        if not candidates:
            break
        credit, steps = torch.zeros(len(candidates)), 0
        for table in tables:
            current = accept_lengths(table, paths)
            starts = visited_starts(current)  # advanced by the current tree
            joint = node_acceptance(table, [*paths, *candidates])[starts, len(paths) :]
            depths = torch.tensor([len(candidate) for candidate in candidates])
            credit += torch.maximum(current[starts, None], joint * depths).sum(0).float()
            steps += len(starts)
        scores = (credit / max(steps, 1)).tolist()
        best = max(range(len(candidates)), key=lambda i: (scores[i], -sum(candidates[i]), -len(candidates[i])))
        paths.append(candidates[best])
        frontier.append(FrontierPoint(tuple(paths), scores[best]))
    for point in frontier:
        point.own = own_acceptance(tables, point.paths)
    return frontier
