"""Suffix decoding (SuffixDecoding, Oliaro et al., NeurIPS 2025): drafts from suffix trees over the
request's own prompt and output and over earlier requests' outputs (suffix_cache.py), with no
draft model.

For each length p of the context's last tokens that occurs in a tree, the tokens that followed
its occurrences are counted; a continuation's probability is the share of occurrences that went
on that way. From the best match a proposal takes at most `max_spec_factor` * p +
`max_spec_offset` tokens, each at least `min_token_prob` likely: a chain along the likeliest
continuation (`suffix`), or the likeliest nodes of the tree of continuations (`suffix_tree`),
verified by the policies with a tree rule. Of every match length and both trees the proposal
with the most expected tokens (the sum of its tokens' probabilities) wins.

Adaptive (the default), the proposal keeps the tokens, or the tree's nodes, that pay for their
verify at those probabilities (block_length.best_length, tree_budget.py), as the other drafters
trim theirs: on a CPU a long guess of low probability costs more than it earns."""

from __future__ import annotations

from typing import ClassVar, Optional, Sequence

import torch
from pydantic import Field, model_validator

from ..loop.stage_types import DraftBlock
from ..trees.topologies import default_bank
from ..trees.tree import listed_name
from .block_length import AdaptiveLengthParams, best_length
from .drafter_base import Drafter, DrafterParams
from .suffix_cache import SuffixCache, SuffixRequest, no_suffix_cache, require_arctic
from .tree_budget import budget_tree


class SuffixLookupParams(DrafterParams):
    """How suffix decoding proposes, as a drafter and as mla's first level (vLLM's defaults)."""

    max_spec_factor: float = Field(
        1.0, ge=0.0, le=64.0, description="a match of p tokens proposes at most max_spec_factor * p + max_spec_offset"
    )
    max_spec_offset: float = Field(0.0, ge=-64.0, le=64.0)
    min_token_prob: float = Field(
        0.1, ge=0.0, le=1.0, description="propose only tokens whose estimated probability is at least this"
    )
    suffix_share: bool = Field(
        True,
        description="false: draft from this request's own tree alone; its text never enters the shared tree, "
        "and a seeded sampled request reproduces its tokens",
    )
    suffix_scope: str = Field(
        "", max_length=128, description="the shared tree read and fed: a namespace (not a secret) per tenant or run"
    )


class SuffixParams(SuffixLookupParams, AdaptiveLengthParams):
    @model_validator(mode="after")
    def _installed(self):
        require_arctic()  # a request for suffix decoding where it is missing: a 400 naming the install
        return self


class SuffixDrafter(Drafter):
    """`suffix`: a chain from the suffix trees."""

    name = "suffix"
    Params = SuffixParams
    reads_suffixes: ClassVar[bool] = True  # built over the process's SuffixCache (make_drafter)

    def __init__(self, params: Optional[SuffixParams] = None, suffixes: Optional[SuffixCache] = None):
        super().__init__(params)
        if suffixes is None:
            raise no_suffix_cache(self.name)
        self.suffixes = suffixes
        self.request: Optional[SuffixRequest] = None

    def reset(self, prompt_ids, sampling) -> None:
        super().reset(prompt_ids, sampling)
        if self.request is not None:
            self.request.close()
        self.request = self.suffixes.open(prompt_ids, self.params.suffix_share, self.params.suffix_scope)

    def guess(self, context: Sequence[int], max_tokens: int) -> list[int]:
        """The likeliest continuation of `context` (mla's first level: the draft model checks it)."""
        if max_tokens <= 0:
            return []
        return list(self.request.speculate(context, max_tokens, self.params).token_ids)

    def choose(self, max_tokens: int, batch_rows: int = 1) -> tuple[int, list[int], float]:
        """(0, proposal, value): the chain kept and its expected tokens per unit of cost (1 for
        none), as pld's `choose` gives its lookup's (mla's first level, under load)."""
        if max_tokens <= 0:
            return 0, [], 1.0
        draft = self.request.speculate(self.context, max_tokens, self.params)
        expected = [1.0]
        for prob in draft.probs:  # a chain's token is kept with its path probability
            expected.append(expected[-1] + prob)
        length, value = best_length(expected, self.params.verify_cost, batch_rows=batch_rows)
        return 0, list(draft.token_ids[: length if self.params.adaptive else None]), value

    def proposed(self, key: int, proposal: list[int]) -> DraftBlock:
        return DraftBlock(tokens=torch.tensor(proposal, dtype=torch.long), ids=list(proposal))

    def propose(self, max_tokens: int, batch_rows: int = 1) -> DraftBlock:
        return self.proposed(*self.choose(max_tokens, batch_rows)[:2])

    def commit(self, new_tokens: Sequence[int]) -> None:
        super().commit(new_tokens)
        self.request.extend(new_tokens)


class SuffixTreeDrafter(SuffixDrafter):
    """`suffix_tree`: a tree of the likeliest continuations, a node's rank the order of its
    count among its siblings (tree.py's paths)."""

    name = "suffix_tree"
    proposes_trees = True

    def propose(self, max_tokens: int, batch_rows: int = 1) -> DraftBlock:
        if max_tokens <= 0:
            return DraftBlock.empty()
        # at most max_tokens nodes, as a chain has tokens: the tree spends them on branches
        draft = self.request.speculate(self.context, max_tokens, self.params, tree=True)
        paths = node_paths(draft.parents)
        if not paths:
            return DraftBlock.empty()
        tree = default_bank().get(listed_name(paths))
        by_path = {path: node for node, path in enumerate(paths)}
        nodes = [by_path[path] for path in tree.paths]  # Arctic's node of each of the tree's nodes
        tokens = torch.tensor([draft.token_ids[node] for node in nodes], dtype=torch.long)
        if not self.params.adaptive:
            return DraftBlock(tokens=tokens, tree=tree)
        path_probs = [draft.probs[node] for node in nodes]
        parent_probs = [1.0 if draft.parents[node] < 0 else draft.probs[draft.parents[node]] for node in nodes]
        node_probs = torch.tensor([prob / parent for prob, parent in zip(path_probs, parent_probs)])
        return budget_tree(tree, tokens, node_probs, self.params.verify_cost, batch_rows)


def node_paths(parents: Sequence[int]) -> list[tuple[int, ...]]:
    """The rank path (tree.py) of each of a draft's nodes, whose parents (-1: the root) come
    before them. Arctic adds nodes best first, so a node's rank is its place among its parent's
    children."""
    paths: list[tuple[int, ...]] = []
    path_of: dict[int, tuple[int, ...]] = {-1: ()}
    children: dict[int, int] = {}
    for node, parent in enumerate(parents):
        rank = children.get(parent, 0)
        children[parent] = rank + 1
        path_of[node] = (*path_of[parent], rank)
        paths.append(path_of[node])
    return paths
