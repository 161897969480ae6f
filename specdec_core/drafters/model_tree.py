"""Candidate trees from a draft model's top-k, without training (EntMTP item 3b): a node of path
(r_1, .., r_d) holds the r_d-th most likely draft token after its parent. Depth by depth, one
draft forward over the tree so far (tree attention, batching.py) gives the logits at the next
depth's parents, so a tree of depth D costs D draft forwards."""

from __future__ import annotations

from typing import Sequence

import torch
from pydantic import Field, field_validator

from ..batching import SequenceKV, forward_ragged
from ..topologies import DEFAULT_DRAFT_TREE, default_bank
from ..tree import Topology
from ..types import DraftBlock
from .base import Drafter, DrafterParams


@torch.inference_mode()
def draft_tree(model: torch.nn.Module, cache: SequenceKV, context: Sequence[int], tree: Topology) -> list[int]:
    """The node tokens of `tree` (a named tree of the default bank, in its order) after `context`,
    whose last token is the root. `cache` holds a prefix of the context; it comes back holding
    all of it but the root."""
    cache.crop(len(context) - 1)
    if cache.length < len(context) - 1:
        forward_ragged(model, [cache], [list(context[cache.length : -1])])
    history = cache.length
    tokens = torch.zeros(tree.num_nodes + 1, dtype=torch.long)
    tokens[0] = context[-1]
    for depth, (nodes, parents, ranks) in enumerate(tree.levels, start=1):
        cache.crop(history)
        above = default_bank().limited(tree.name, depth - 1) if depth > 1 else None  # the nodes drafted so far
        row = tokens[: above.num_nodes + 1 if above else 1].tolist()
        hidden, _ = forward_ragged(model, [cache], [row], [above])
        top = model.lm_head(hidden[0]).topk(int(ranks.max()) + 1, dim=-1).indices.cpu()
        tokens[nodes] = top[parents, ranks]
    cache.crop(history)
    return tokens[1:].tolist()


class ModelTreeParams(DrafterParams):
    tree: str = Field(DEFAULT_DRAFT_TREE, description="a named tree (specdec_core/topologies.py)")

    @field_validator("tree")
    @classmethod
    def _known(cls, name: str) -> str:
        return default_bank().require_named(name)


class ModelTreeDrafter(Drafter):
    """`model_tree`: a candidate tree per step from the draft model's top-k (`draft_tree`),
    verified in one target forward by a policy with a tree rule (greedy, typical). Near
    `max_tokens` it proposes the tree's part that fits."""

    name = "model_tree"
    Params = ModelTreeParams
    needs_model = True
    proposes_trees = True

    def __init__(self, model: torch.nn.Module, params: ModelTreeParams | None = None):
        super().__init__(params)
        self.model = model

    def reset(self, prompt_ids, sampling) -> None:
        super().reset(prompt_ids, sampling)
        self.cache = SequenceKV(len(prompt_ids) + sampling.max_tokens + 1)

    def propose(self, max_tokens: int, batch_rows: int = 1) -> DraftBlock:
        if max_tokens <= 0:
            return DraftBlock.empty()
        tree = default_bank().limited(self.params.tree, max_tokens)
        tokens = draft_tree(self.model, self.cache, self.context, tree)
        return DraftBlock(tokens=torch.tensor(tokens, dtype=torch.long), tree=tree)
