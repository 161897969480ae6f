"""`heads`: candidate trees from the target's own multi-token heads (heads/: Medusa's,
hydra.py: Hydra's), self-speculation. The heads run beside the target, on the final hidden
states of the committed positions, so this drafter asks its target session for the node tokens
(`TargetScorer.guess`, or the target worker's Heads call) of every tree its schedule may pick,
in one call, and takes the step's tree from them: with Medusa's heads the node of path
(r_1, .., r_d) is head d's r_d-th most likely token whatever its parent, with Hydra's the r_d-th
given the path's tokens.

Which tree, per step, is EntMTP's scheduler's choice (scheduler.py): `static`, `binary_tau`
between a conservative and an aggressive tree, or a `ladder` over several, on a score of the
decode state: `top1`, the paper's `max(p0, g_1..g_D)` (which equals p0, the target's
probability of the root), or `path_value`, g_D = p0 * p_1 * .. * p_D over the heads' top-1
probabilities (EAGLE-2's value of the top-1 path)."""

from __future__ import annotations

from typing import Literal, Optional, Protocol, Sequence

from pydantic import Field, model_validator

from ..api.sampling import SamplingParams
from ..heads.contract import HeadGuesses
from ..loop.stage_types import DraftBlock
from ..trees.scheduler import BinaryTauParams, LadderParams, SchedulerParams, StaticParams, TreeScheduler, path_score
from ..trees.topologies import DEFAULT_TREE, default_bank
from ..trees.tree import Topology
from .block_length import AdaptiveLengthParams
from .drafter_base import DraftSource
from .tree_budget import budget_tree


class HeadsSource(Protocol):
    async def guess(self, root_token: int, tree: str) -> Optional[HeadGuesses]:
        """The heads' node tokens of tree `tree` after the last committed position (None before
        there is one)."""


class HeadsParams(AdaptiveLengthParams):
    scheduler: Literal["static", "binary_tau", "ladder"] = "static"
    tree: str = Field(DEFAULT_TREE, description="static: the tree; binary_tau: the conservative tree")
    aggressive: Optional[str] = Field(None, description="binary_tau: the tree while the score is high")
    tau_on: Optional[float] = Field(None, ge=0.0, le=1.0, description="binary_tau: switch up when score > tau_on")
    tau_off: Optional[float] = Field(None, ge=0.0, le=1.0, description="binary_tau: back when score <= tau_off")
    trees: tuple[str, ...] = Field((), description="ladder: from the smallest tree to the largest")
    thresholds: tuple[float, ...] = Field((), description="ladder: len(trees) - 1 rising scores")
    score: Literal["top1", "path_value"] = "top1"

    @model_validator(mode="after")
    def _a_schedule_of_known_trees(self):
        self.schedule()  # the scheduler's own checks
        for name in self.tree_names():
            default_bank().get(name, named_only=True)
        return self

    def schedule(self) -> SchedulerParams:
        if self.scheduler == "static":
            return StaticParams(tree=self.tree)
        if self.scheduler == "ladder":
            return LadderParams(trees=self.trees, thresholds=self.thresholds)
        if self.aggressive is None or self.tau_on is None:
            raise ValueError("binary_tau needs `aggressive` (a tree) and `tau_on`")
        return BinaryTauParams(
            conservative=self.tree, aggressive=self.aggressive, tau_on=self.tau_on, tau_off=self.tau_off
        )

    def tree_names(self) -> list[str]:
        schedule = self.schedule()
        if isinstance(schedule, StaticParams):
            return [schedule.tree]
        if isinstance(schedule, BinaryTauParams):
            return [schedule.conservative, schedule.aggressive]
        return list(schedule.trees)


class HeadsDrafter:
    """A `DraftSession` over a target session with heads (`HeadsSource`)."""

    name = "heads"
    Params = HeadsParams
    drafts_from = DraftSource.TARGET_HEADS
    proposes_trees = True
    heads_kind: Optional[str] = None  # the target heads it drafts from: any kind

    def __init__(self, source: HeadsSource, params: Optional[HeadsParams] = None):
        self.source = source
        self.params = params if params is not None else self.Params()
        # every tree the schedule may pick, guessed in one call (with Hydra's heads a node's children
        # depend on its token, so the tree must be known before the guess; the score comes after)
        self.guessed_tree = "+".join(dict.fromkeys(self.params.tree_names()))
        self.last_score: Optional[float] = None  # the scheduler's input at the last proposal

    async def reset(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        self.root = prompt_ids[-1]
        self.scheduler = TreeScheduler(self.params.schedule())

    async def propose(self, max_tokens: int, batch_rows: int = 1) -> DraftBlock:
        if max_tokens <= 0:
            return DraftBlock.empty()
        guesses = await self.source.guess(self.root, self.guessed_tree)
        if guesses is None:  # nothing committed yet (a one-token prompt): a plain step
            return DraftBlock.empty()
        if self.params.score == "top1":
            score = path_score([guesses.root_prob, *guesses.top_probs.tolist()])
        else:
            score = guesses.root_prob * float(guesses.top_probs.prod())
        self.last_score = score
        tree = default_bank().limited(self.scheduler.choose(score), min(max_tokens, guesses.tree.max_depth))
        nodes = default_bank().node_index(tree.name, guesses.tree.name).to(guesses.tokens.device)
        return self.block(tree, guesses.tokens[nodes], guesses.node_probs[nodes], batch_rows)

    def block(self, tree: Topology, tokens, node_probs, batch_rows: int, min_nodes: int = 0) -> DraftBlock:
        """The step's block: `tree`'s nodes within the node budget (tree_budget.py), at least
        `min_nodes`, or all of them where `adaptive` is off."""
        if not self.params.adaptive:
            return DraftBlock(tokens=tokens, tree=tree)
        return budget_tree(tree, tokens, node_probs, self.params.verify_cost, batch_rows, min_nodes=min_nodes)

    def commit(self, new_tokens: Sequence[int]) -> None:
        self.root = new_tokens[-1]
