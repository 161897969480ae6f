"""`eagle3`: chains or trees from the target's EAGLE-3 layer (heads/eagle3_layer.py), which drafts token by
token from the target's own hidden states at three depths. It is the heads drafter (head_trees.py:
the same guess call to the target session, the same tree schedules) over a target whose heads
are an EAGLE-3 layer, with a chain for its default: of the length that the cost model
(block_length.py) picks from this request's acceptance so far, the verify-cost curve and the
layer's cost per drafted token, at most the step's draft length (`num_draft_tokens`) and 8. A
tree (`tree`, or a schedule's trees) is drafted a depth at a time, each node's children after
its own token; `dynamic` grows EAGLE-2's tree each step (dynamic_tree.py: `top_k`, `depth`,
`nodes`; defaults as EAGLE-2's reference: 10, 8 and 59, a 60-token verify), as deep as the cost
model prices a chain for this request and the step's draft length allow, and cut to the nodes
that pay for their verify (tree_budget.py), as a fixed tree is."""

from __future__ import annotations

from typing import Sequence

from pydantic import Field, model_validator

from ..api.sampling import SamplingParams
from ..heads.eagle3_layer import MAX_DRAFT_DEPTH
from ..loop.stage_types import DraftBlock
from ..trees.dynamic_tree import DynamicTree
from ..trees.topologies import default_bank
from .block_length import AcceptanceEstimate, learning_block, least_drafts
from .drafter_base import assumed_tokens
from .head_trees import HeadsDrafter, HeadsParams

DEFAULT_EAGLE3_TREE = "chain_8"


class Eagle3Params(HeadsParams):
    tree: str = Field(DEFAULT_EAGLE3_TREE, description="static: the tree (chain_N: a chain, its length adaptive)")
    # one layer and a draft-vocabulary LM head against the whole target: a rough share, for the
    # cost model (a 32-layer target with a 32k-token draft head: about 0.05)
    draft_cost: float = Field(0.1, ge=0.0, le=100.0, description="one draft step, in 1-token target steps")
    dynamic: bool = Field(False, description="EAGLE-2's dynamic tree instead of `tree` or a schedule")
    top_k: int = Field(10, ge=1, le=16, description="dynamic: children of each expanded node")
    depth: int = Field(MAX_DRAFT_DEPTH, ge=1, le=MAX_DRAFT_DEPTH, description="dynamic: the longest path")
    nodes: int = Field(59, ge=1, le=128, description="dynamic: the nodes kept (the verify is one more)")

    @model_validator(mode="after")
    def _dynamic_alone(self):
        if self.dynamic and (self.scheduler != "static" or self.tree != DEFAULT_EAGLE3_TREE):
            raise ValueError("`dynamic` grows its own tree: it takes no `tree` or `scheduler`")
        return self


class Eagle3Drafter(HeadsDrafter):
    name = "eagle3"
    Params = Eagle3Params
    heads_kind = "eagle3"

    async def reset(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        await super().reset(prompt_ids, sampling)
        # optimistic, as the draft model's (model.py): drafting starts priced as paying
        self.estimate = AcceptanceEstimate(prior_accepted=1.8, prior_rejected=0.2)
        self.last_path: list[int] = []  # the last chain or dynamic tree's top-1 path

    def drafts_chains(self) -> bool:
        """Whether its blocks are one fixed chain, whose length is then the cost model's."""
        tree = default_bank().get(self.params.tree)
        return not self.params.dynamic and self.params.scheduler == "static" and tree.num_nodes == tree.max_depth

    async def propose(self, max_tokens: int, batch_rows: int = 1) -> DraftBlock:
        chains = self.drafts_chains()
        if not chains and not self.params.dynamic:  # a fixed tree or a schedule's: the heads drafter's
            return await super().propose(max_tokens, batch_rows)
        if self.params.dynamic:
            max_tokens = min(self.params.depth, max_tokens)
        if self.params.adaptive and max_tokens > 1:  # a chain's length, a dynamic tree's depth
            curve, cost = self.params.verify_cost, self.params.draft_cost
            max_tokens = learning_block(self.estimate.rate, max_tokens, curve, cost, batch_rows).length
        if max_tokens <= 0:
            return DraftBlock.empty()
        # the layer drafts only what the step verifies: a chain that long, a tree that deep
        if chains:
            tree = default_bank().limited(self.params.tree, max_tokens).name
        else:
            tree = DynamicTree(self.params.top_k, max_tokens, self.params.nodes).name
        guesses = await self.source.guess(self.root, tree)
        if guesses is None:  # nothing committed yet (a one-token prompt): a plain step
            return DraftBlock.empty()
        if chains:
            block = DraftBlock(tokens=guesses.tokens, tree=guesses.tree)
        else:
            block = self.block(guesses.tree, guesses.tokens, guesses.node_probs, batch_rows, least_drafts(batch_rows))
        self.last_path = assumed_tokens(block)  # the verified top-1 path, learned from at its commit
        return block

    def commit(self, new_tokens: Sequence[int]) -> None:
        super().commit(new_tokens)
        if self.last_path:
            self.estimate.update(self.last_path, new_tokens)
            self.last_path = []
