"""What every kind of the target's heads (Medusa's, Hydra's, EAGLE-3's) offers the loop: a
session per request that, fed the positions the target commits, guesses the next candidate tree
(`HeadGuesses`). The scorer (target/scorer.py) and the drafters read heads through this contract
only; loading.py picks the kind a directory holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Protocol

import torch
from torch import nn

from ..trees.tree import Topology

# the kind a drafter of any heads (`heads`) reads, first held first; `eagle3` reads its own
KINDS_IN_ORDER = ("medusa", "hydra", "eagle3")


def heads_kind_for(held: Iterable[str], needed: Optional[str]) -> Optional[str]:
    """The kind of the target's heads (`held`) a drafter reads: the kind it `needed` (`eagle3`),
    or for any kind (`heads`) the first of KINDS_IN_ORDER held; None where it holds none such."""
    return next((kind for kind in ([needed] if needed else KINDS_IN_ORDER) if kind in held), None)


@dataclass
class HeadGuesses:
    """What the heads guess after one committed position: the node tokens of a candidate tree
    (the tree asked for, cut to the heads' depth) with each one's probability under its head,
    the heads' top-1 probabilities along the top-1 path, and the target's probability of the
    token it committed there (the root of the next tree): the features the tree scheduler and
    the node budget (drafters/tree_budget.py) read."""

    tree: Topology
    tokens: torch.Tensor  # [tree.num_nodes] int64, in the tree's order
    node_probs: torch.Tensor  # [tree.num_nodes] float32: each node's probability after its parent
    top_probs: torch.Tensor  # [<= num_heads] float32, from the first head on
    root_prob: float


def root_probability(model: nn.Module, last_hidden: torch.Tensor, root_token: int) -> float:
    """The target's probability of the root token at the last committed position (final state
    `[H]`): the scheduler's p0."""
    root_logits = model.lm_head(last_hidden.reshape(1, 1, -1))[0, 0]
    return float(root_logits.float().softmax(-1)[root_token])


class HeadsSession(Protocol):
    """One request's heads on its target session (TargetScorer): fed the positions it commits,
    in order, it guesses the tree after the last of them."""

    def advance(self, hidden: torch.Tensor, tokens: torch.Tensor, features: Optional[torch.Tensor]) -> None:
        """The next n committed positions: their final hidden states `[n, H]`, tokens `[n]` and
        the target's kept states `[n, A * H]` (aux_states.py; None unless the heads read them)."""

    def guess(self, root_token: int, tree: str) -> Optional[HeadGuesses]:
        """The node tokens of tree `tree` after `root_token` (None before a position is committed)."""


class Heads(Protocol):
    """A target's heads of one kind (MedusaHeads, HydraHeads, Eagle3Draft), loaded on its device."""

    kind: str

    @property
    def num_heads(self) -> int:
        """The deepest tree they guess."""

    def session(self, model: nn.Module) -> HeadsSession:
        """One request's session on the target `model`."""
