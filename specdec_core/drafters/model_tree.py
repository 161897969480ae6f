"""Candidate trees from a draft model's top-k, without training (EntMTP item 3b): a node of path
(r_1, .., r_d) holds the r_d-th most likely draft token after its parent. Depth by depth, one
draft forward over the tree so far (tree attention, batching.py) gives the logits at the next
depth's parents, so a tree of depth D costs D draft forwards.

`mla_tree` adds FLy's multi-level acceleration: it drafts the tree's top-1 path as `mla` drafts a
chain (each forward feeds the path so far and prompt lookup's guess of how it goes on, and keeps
the path up to the first wrong guess), and the draft's top-k along the path fills every node
hanging off it. A tree whose nodes all hang off its top-1 path (a spine) then costs what mla's
chain of its depth costs, one forward when the lookup guessed the whole path; the nodes under
other parents are filled depth by depth as above. The tree's tokens are the same either way."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from pydantic import Field, field_validator

from ..batching import forward_ragged
from ..kv_pool import PagedKV
from ..topologies import DEFAULT_DRAFT_TREE, DEFAULT_MLA_TREE, default_bank
from ..tree import Topology
from ..types import DraftBlock
from .base import Drafter, DrafterParams, DraftSource, common_prefix_length, sync_cache
from .pld import PromptLookupParams, lookup_continuation

# how a sequence goes on, at most n tokens (prompt lookup's guess)
Lookup = Callable[[list[int], int], list[int]]


@torch.inference_mode()
def draft_tree(
    model: torch.nn.Module,
    cache: PagedKV,
    cached: list[int],
    context: Sequence[int],
    tree: Topology,
    lookup: Optional[Lookup] = None,
) -> list[int]:
    """The node tokens of `tree` (a named tree of the default bank, in its order) after `context`,
    whose last token is the root. `cached`: the tokens `cache` holds, kept in step with it (a
    prefix shared with the context is reused). `lookup`: with one, the top-1 path is drafted as
    a chain checking its guesses first."""
    context = list(context)
    node_top = torch.zeros(tree.num_nodes + 1, tree.top_k, dtype=torch.long)  # each node's draft top-k
    known = torch.zeros(tree.num_nodes + 1, dtype=torch.bool)

    def top_k(row: list[int], keep: int, above: Optional[Topology] = None) -> torch.Tensor:
        """The draft's top-k tokens `[keep, k]` at the last `keep` tokens of `row` (the tree `above`'s)."""
        hidden, _ = forward_ragged(model, [cache], [row], [above])
        return model.lm_head(hidden[0, -keep:]).topk(tree.top_k, dim=-1).indices.cpu()

    path = torch.tensor(tree.top1_path)
    path_parents = path[torch.isin(path, tree.parents)]
    path_tokens: list[int] = []  # the top-1 path after the root, as drafted so far
    while lookup is not None and not known[path_parents].all():
        sequence = context + path_tokens
        sync_cache(cache, cached, sequence)
        pending, guess = sequence[len(cached) :], lookup(sequence, len(path) - 1 - len(path_tokens))
        top = top_k(pending + guess, len(guess) + 1)
        cached.extend(pending + guess)
        checked = common_prefix_length(guess, top[:, 0].tolist(), len(guess)) + 1  # rows on the path
        nodes = path[len(path_tokens) : len(path_tokens) + checked]
        node_top[nodes], known[nodes] = top[: len(nodes)], True
        path_tokens += top[:checked, 0].tolist()

    tokens = torch.zeros(tree.num_nodes + 1, dtype=torch.long)
    tokens[0] = context[-1]
    for depth, (nodes, parents, ranks) in enumerate(tree.levels, start=1):
        if not known[parents].all():  # one forward over the tree so far gives every node's top-k above
            sync_cache(cache, cached, context)
            if len(cached) < len(context) - 1:
                forward_ragged(model, [cache], [context[len(cached) : -1]])
                cached[:] = context[:-1]
            above = default_bank().limited(tree.name, depth - 1) if depth > 1 else None
            count = above.num_nodes + 1 if above else 1
            node_top[:count], known[:count] = top_k(tokens[:count].tolist(), count, above), True
            cache.crop(len(cached))  # tree rows never stay
        tokens[nodes] = node_top[parents, ranks]
    return tokens[1:].tolist()


@torch.inference_mode()
def draft_next(model: torch.nn.Module, cache: PagedKV, cached: list[int], context: Sequence[int]) -> int:
    """The draft's likeliest token after `context` (`cached` as in `draft_tree`)."""
    sync_cache(cache, cached, context)
    pending = list(context[len(cached) :])
    hidden, _ = forward_ragged(model, [cache], [pending])
    cached.extend(pending)
    return int(model.lm_head(hidden[0, -1]).argmax())


class ModelTreeParams(DrafterParams):
    tree: str = Field(DEFAULT_DRAFT_TREE, description="a named tree (specdec_core/topologies.py)")

    @field_validator("tree")
    @classmethod
    def _known(cls, name: str) -> str:
        return default_bank().get(name, named_only=True).name


class MultiLevelTreeParams(ModelTreeParams, PromptLookupParams):
    tree: str = Field(DEFAULT_MLA_TREE, description="a named tree; a spine's nodes all hang off its top-1 path")


class ModelTreeDrafter(Drafter):
    """`model_tree`: a candidate tree per step from the draft model's top-k (`draft_tree`),
    verified in one target forward by a policy with a tree rule (greedy, typical). Near
    `max_tokens` it proposes the tree's part that fits."""

    name = "model_tree"
    Params = ModelTreeParams
    drafts_from = DraftSource.DRAFT_MODEL
    proposes_trees = True
    drafts_ahead = True

    def __init__(self, model: torch.nn.Module, params: ModelTreeParams | None = None):
        super().__init__(params)
        self.model = model

    def path_lookup(self) -> Optional[Lookup]:
        """mla_tree's guess of how the top-1 path goes on; model_tree drafts without one."""
        return None

    def reset(self, prompt_ids, sampling) -> None:
        super().reset(prompt_ids, sampling)
        self.cache = PagedKV.for_request(len(prompt_ids), sampling.max_tokens)
        self.cached: list[int] = []

    def propose(self, max_tokens: int, batch_rows: int = 1, after: Sequence[int] = ()) -> DraftBlock:
        """`after` (run_ahead.py: the top-1 path the target verifies now): the draft's guess of the
        target's next token after it, then the tree after that guess (tokens `[1 + nodes]`)."""
        if max_tokens <= 0:
            return DraftBlock.empty()
        tree = default_bank().limited(self.params.tree, max_tokens)
        context, guess = [*self.context, *after], []
        if after:
            guess = [draft_next(self.model, self.cache, self.cached, context)]
        tokens = draft_tree(self.model, self.cache, self.cached, context + guess, tree, self.path_lookup())
        return DraftBlock(tokens=torch.tensor(guess + tokens, dtype=torch.long), tree=tree)


class MultiLevelTreeDrafter(ModelTreeDrafter):
    """`mla_tree`: `model_tree` with its top-1 path drafted as mla drafts a chain (FLy's MLA)."""

    name = "mla_tree"
    Params = MultiLevelTreeParams

    def path_lookup(self) -> Optional[Lookup]:
        return lambda sequence, max_tokens: lookup_continuation(sequence, self.params, max_tokens)[1]
