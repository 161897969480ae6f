"""Candidate trees from a draft model's top-k, without training (EntMTP item 3b): a node of path
(r_1, .., r_d) holds the r_d-th most likely draft token after its parent.

A tree's top-1 path is drafted as a chain, a forward per token, each kept in the draft's cache,
and the draft's top-k along the path fills every node hanging off it; the nodes under other
parents are filled depth by depth, a draft forward over the tree so far (tree attention,
batching.py) for each depth that has them. A tree whose nodes all hang off its top-1 path (a
spine) costs what a chain of its depth costs.

`mla_tree` adds FLy's multi-level acceleration: each forward on the path feeds the path so far
and prompt lookup's guess of how it goes on, and keeps the path up to the first wrong guess (as
`mla` drafts a chain), so a spine costs one forward where the lookup guessed the whole path. The
tree's tokens are the same either way. A step verifies the drafted tree's nodes that pay for
their verify on the target's device (tree_budget.py)."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Generator, NamedTuple, Optional, Sequence

import torch
from pydantic import Field, field_validator

from ..loop.stage_types import DraftBlock
from ..models.kernels.chunked import kernels_by_chunk
from ..runtime.batching import forward_ragged
from ..runtime.kv_pool import PagedKV
from ..trees.topologies import DEFAULT_DRAFT_TREE, default_bank
from ..trees.tree import Topology
from .block_length import AcceptanceEstimate, DraftCostParams, cost_per_draft, learning_block, least_drafts
from .drafter_base import Drafter, DraftSource, InLockstep, assumed_tokens, common_prefix_length, sync_cache
from .first_level import FirstLevelParams, first_level
from .suffix_cache import SuffixCache
from .tree_budget import budget_tree

# how a sequence goes on, at most n tokens (prompt lookup's guess)
Lookup = Callable[[list[int], int], list[int]]


def no_guess(sequence: list[int], max_tokens: int) -> list[int]:
    """model_tree's lookup: no guess, so its top-1 path is drafted a token per forward."""
    return []


class DraftedTree(NamedTuple):
    tokens: list[int]  # [N] the nodes' tokens, in the tree's order
    probs: torch.Tensor  # [N] float32: each node's draft probability after its parent
    forwards: int  # draft forwards it took


class TreeForward(NamedTuple):
    """A forward a tree's drafting asks for: `row` after what `cache` holds (`above`'s nodes
    where it is a tree), and the draft's `top_k` at its last `keep` tokens."""

    cache: PagedKV
    row: list[int]
    above: Optional[Topology]
    keep: int
    top_k: int


TopK = tuple[torch.Tensor, torch.Tensor]  # [keep, top_k] the draft's likeliest tokens, their probabilities (host)
TreeDrafting = Generator[TreeForward, TopK, Any]  # its forwards, answered; returns what it drafted


def tree_drafting(
    cache: PagedKV, cached: list[int], context: Sequence[int], tree: Topology, lookup: Lookup = no_guess
) -> Generator[TreeForward, TopK, DraftedTree]:
    """The nodes of `tree` (a named tree of the default bank) after `context`, whose last token
    is the root, asking for each forward (`draft_together` runs them). `cached`: the tokens
    `cache` holds, kept in step with it (a prefix shared with the context is reused). `lookup`:
    its guesses of the top-1 path, checked by each of the path's forwards."""
    context = list(context)
    node_top = torch.zeros(tree.num_nodes + 1, tree.top_k, dtype=torch.long)  # each node's draft top-k
    node_top_probs = torch.zeros(tree.num_nodes + 1, tree.top_k)  # and their probabilities
    known = torch.zeros(tree.num_nodes + 1, dtype=torch.bool)
    forwards = 0

    path = torch.tensor(tree.top1_path)
    path_parents = path[torch.isin(path, tree.parents)]
    path_tokens: list[int] = []  # the top-1 path after the root, as drafted so far
    while not known[path_parents].all():
        sequence = context + path_tokens
        sync_cache(cache, cached, sequence)
        pending, guess = sequence[len(cached) :], lookup(sequence, len(path) - 1 - len(path_tokens))
        top, top_probs = yield TreeForward(cache, pending + guess, None, len(guess) + 1, tree.top_k)
        forwards += 1
        cached.extend(pending + guess)
        checked = common_prefix_length(guess, top[:, 0].tolist(), len(guess)) + 1  # rows on the path
        nodes = path[len(path_tokens) : len(path_tokens) + checked]
        node_top[nodes], node_top_probs[nodes], known[nodes] = top[: len(nodes)], top_probs[: len(nodes)], True
        path_tokens += top[:checked, 0].tolist()

    tokens = torch.zeros(tree.num_nodes + 1, dtype=torch.long)
    probs = torch.zeros(tree.num_nodes + 1)
    tokens[0] = context[-1]
    for depth, (nodes, parents, ranks) in enumerate(tree.levels, start=1):
        if not known[parents].all():  # one forward over the tree so far gives every node's top-k above
            sync_cache(cache, cached, context)  # the path's forwards cached the context: its last token is the root
            above = default_bank().limited(tree.name, depth - 1) if depth > 1 else None
            count = above.num_nodes + 1 if above else 1
            node_top[:count], node_top_probs[:count] = yield TreeForward(
                cache, tokens[:count].tolist(), above, count, tree.top_k
            )
            forwards += 1
            known[:count] = True
            cache.crop(len(cached))  # tree rows never stay
        tokens[nodes], probs[nodes] = node_top[parents, ranks], node_top_probs[parents, ranks]
    return DraftedTree(tokens[1:].tolist(), probs[1:], forwards)


@torch.inference_mode()
def draft_together(model: torch.nn.Module, draftings: Sequence[TreeDrafting]) -> list[Any]:
    """Run tree draftings (sessions of `model`) in lockstep: each round is one ragged forward over
    the next forward of every drafting still drafting, one LM head call over the rows they keep and
    one read back of their top-k. Returns what each drafted."""
    rounds = InLockstep(draftings)
    while rounds.asked:
        indices, calls = list(rounds.asked), list(rounds.asked.values())
        hidden, _ = forward_ragged(
            model, [call.cache for call in calls], [call.row for call in calls], [call.above for call in calls]
        )
        parts = hidden[0].split([len(call.row) for call in calls])  # [T_i, H] each
        kept = torch.cat([part[-call.keep :] for part, call in zip(parts, calls)])  # [sum of keep, H]
        with kernels_by_chunk([call.keep for call in calls]):  # each drafting's rows on its own kernel
            logits = model.lm_head(kept).float()  # [sum of keep, V]
        # the top-k of the widest tree holds each narrower one's first (topk sorts them)
        top = logits.softmax(-1).topk(max(call.top_k for call in calls), dim=-1)
        top_ids, top_probs = top.indices.cpu(), top.values.cpu()  # the one read back
        sizes = [call.keep for call in calls]
        for index, call, ids, probs in zip(indices, calls, top_ids.split(sizes), top_probs.split(sizes)):
            rounds.answer(index, (ids[:, : call.top_k], probs[:, : call.top_k]))
    return rounds.results


@torch.inference_mode()
def draft_next(model: torch.nn.Module, cache: PagedKV, cached: list[int], context: Sequence[int]) -> int:
    """The draft's likeliest token after `context` (`cached` as in `tree_drafting`)."""
    sync_cache(cache, cached, context)
    pending = list(context[len(cached) :])
    hidden, _ = forward_ragged(model, [cache], [pending])
    cached.extend(pending)
    return int(model.lm_head(hidden[0, -1]).argmax())


class ModelTreeParams(DraftCostParams):
    tree: str = Field(
        DEFAULT_DRAFT_TREE,
        description="a named tree (specdec_core/trees/topologies.py); a spine's nodes all hang off its top-1 path",
    )

    @field_validator("tree")
    @classmethod
    def _known(cls, name: str) -> str:
        return default_bank().get(name, named_only=True).name


class MultiLevelTreeParams(ModelTreeParams, FirstLevelParams):
    pass


class ModelTreeDrafter(Drafter):
    """`model_tree`: a candidate tree per step from the draft model's top-k (`tree_drafting`),
    verified in one target forward by a policy with a tree rule (greedy, rejection, typical).
    Adaptive, its depth is the length the cost model (block_length.py) gives a chain for the rate
    at which the target keeps the tree's top-1 path and the draft's forwards per depth so far;
    near `max_tokens` it proposes the tree's part that fits."""

    name = "model_tree"
    Params = ModelTreeParams
    drafts_from = DraftSource.DRAFT_MODEL
    proposes_trees = True
    drafts_ahead = True

    def __init__(self, model: torch.nn.Module, params: ModelTreeParams | None = None):
        super().__init__(params)
        self.model = model

    def path_lookup(self) -> Lookup:
        """How the top-1 path goes on, as guessed before the draft checks it."""
        return no_guess

    def reset(self, prompt_ids, sampling) -> None:
        super().reset(prompt_ids, sampling)
        self.cache = PagedKV.for_request(len(prompt_ids), sampling.max_tokens)
        self.cached: list[int] = []
        # optimistic, as the model drafter's (model.py): drafting starts priced as paying
        self.estimate = AcceptanceEstimate(prior_accepted=1.8, prior_rejected=0.2)
        self.forwards = self.depths = 0  # draft forwards and tree depths drafted in this request
        self.path: list[int] = []  # the last block's top-1 path, learned from at its commit
        self.ahead: tuple[list[int], list[int]] = ([], [])  # an ahead proposal's outcome and top-1 path

    def depth(self, max_depth: int, batch_rows: int) -> int:
        """How deep a tree to draft: alone at least 1, so the estimate keeps learning."""
        if not self.params.adaptive or max_depth <= 1:
            return max_depth
        cost = cost_per_draft(self.params.draft_cost, self.forwards, self.depths)
        return learning_block(self.estimate.rate, max_depth, self.params.verify_cost, cost, batch_rows).length

    def propose(self, max_tokens: int, batch_rows: int = 1, after: Sequence[int] = ()) -> DraftBlock:
        return draft_together(self.model, [self.drafting_after(after, max_tokens, batch_rows)])[0]

    def drafting_after(
        self, after: Sequence[int], max_tokens: int, batch_rows: int = 1
    ) -> Generator[TreeForward, TopK, DraftBlock]:
        """`propose`, asking for each forward (a draft step runs many sessions' together,
        `draft_together`). `after` (run_ahead.py: the top-1 path the target verifies now): the
        draft's guess of the target's next token after it, then the tree after that guess (tokens
        `[1 + nodes]`)."""
        context, guess = [*self.context, *after], []
        if after:
            guess = [draft_next(self.model, self.cache, self.cached, context)]
        block = yield from self.drafted_block(context, guess, max_tokens, batch_rows)
        # what the estimate learns from at the commit that shows whether this block was verified
        path = [] if block.num_tokens <= len(guess) else assumed_tokens(block, len(guess))
        if after:
            self.ahead = ([*after, *guess], path)
        else:
            self.path = path
        return block

    def drafted_block(
        self, context: list[int], guess: list[int], max_tokens: int, batch_rows: int
    ) -> Generator[TreeForward, TopK, DraftBlock]:
        depth = self.depth(min(max_tokens, default_bank().get(self.params.tree).max_depth), batch_rows)
        if depth <= 0:
            return DraftBlock(tokens=torch.tensor(guess, dtype=torch.long), tree=None)
        tree = default_bank().limited(self.params.tree, depth)
        drafted = yield from tree_drafting(self.cache, self.cached, context + guess, tree, self.path_lookup())
        self.forwards, self.depths = self.forwards + drafted.forwards, self.depths + tree.max_depth
        block = torch.tensor(guess + drafted.tokens, dtype=torch.long)
        if not self.params.adaptive:
            return DraftBlock(tokens=block, tree=tree)
        # the target keeps the draft's top-1 at the rate this request has seen, which a draft that
        # agrees with its target well exceeds its own probability (and which is at least its
        # siblings', so the top-1 is kept first); a runner-up is worth its probability
        probs, path_nodes = drafted.probs.clone(), [node - 1 for node in tree.top1_path[1:]]
        probs[path_nodes] = probs[path_nodes].clamp(min=self.estimate.rate)
        least = least_drafts(batch_rows)
        return budget_tree(tree, block, probs, self.params.verify_cost, batch_rows, len(guess), least)

    def commit(self, new_tokens: Sequence[int]) -> None:
        if self.path:
            self.estimate.update(self.path, new_tokens)
        # a used ahead proposal (the verdict is the outcome it assumed) is the block verified next
        (outcome, path), self.ahead = self.ahead, ([], [])
        self.path = path if outcome and list(new_tokens) == outcome else []
        super().commit(new_tokens)


class MultiLevelTreeDrafter(ModelTreeDrafter):
    """`mla_tree`: `model_tree` with its top-1 path drafted as mla drafts a chain (FLy's MLA),
    guessed by its first level (first_level.py)."""

    name = "mla_tree"
    Params = MultiLevelTreeParams
    reads_suffixes: ClassVar[bool] = True

    def __init__(
        self,
        model: torch.nn.Module,
        params: Optional[MultiLevelTreeParams] = None,
        suffixes: Optional[SuffixCache] = None,
    ):
        super().__init__(model, params)
        self.suffixes = suffixes

    def reset(self, prompt_ids, sampling) -> None:
        super().reset(prompt_ids, sampling)
        self.lookups = first_level(self.params, self.suffixes)
        self.lookups.reset(prompt_ids, sampling)

    def path_lookup(self) -> Lookup:
        return self.lookups.guess

    def commit(self, new_tokens: Sequence[int]) -> None:
        self.lookups.commit(new_tokens)
        super().commit(new_tokens)
