"""The acceptance-policy interface and the lossless base rule every policy builds on.

Base rule: at T = 0 accept while the draft token equals the target argmax and emit the target
argmax at the first mismatch (bonus argmax after all K); at T > 0 standard speculative
sampling (accept with prob min(1, p_t/p_d), resample from norm(max(0, p_t - p_d)), bonus from
p_t). The random draws happen in a fixed order (one U per position, then one multinomial), so
policies that reduce to the base rule at a neutral setting produce identical tokens under the
same seed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

import torch
from pydantic import BaseModel, ConfigDict

from ..api.sampling import SamplingParams, argmax, sample, sampling_probs
from ..calibration.profile_types import TargetProfile
from ..loop.stage_types import DraftBlock, TargetBlock, Verdict

if TYPE_CHECKING:
    from .sampled_chains import SampledChains
    from .sampled_trees import SampledTrees


class PolicyParams(BaseModel):
    # JSON has no infinity (tau_h = inf disables EASD): it is written "Infinity", which parses back
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")


@dataclass
class BaseDecision:
    """Per-position quantities of the base rule, computed once and shared by policies."""

    accepted: torch.Tensor  # [K] bool, base-rule accept flags
    target_probs: Optional[torch.Tensor]  # [K+1, V] sampling distribution (None at T=0)
    target_argmax: Optional[torch.Tensor]  # [K+1] (None at T>0, where nothing reads it)
    ratio: Optional[torch.Tensor] = None  # [K] p_t(c)/p_d(c) at T > 0
    uniform: Optional[torch.Tensor] = None  # [K] the U draws at T > 0


class AcceptancePolicy(ABC):
    """One acceptance rule. Subclasses set `name`, `Params` and implement `verify`."""

    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    needs_hidden: ClassVar[bool] = False  # the target must return final hidden states + LM head
    lossless: ClassVar[bool] = False  # emits exactly the target's distribution (greedy: its argmax)
    counters: ClassVar[tuple[str, ...]] = ()  # trace flags the metrics count (penalized, loose, ...)
    supports_sampling: ClassVar[bool] = True  # False: temperature must be 0
    supports_trees: ClassVar[bool] = False  # True: `verify_tree` has a per-path rule
    # True: a sampled chain's verdict follows from `chain_accepts` and `chain_next_weights`, and
    # a step decides many requests' at once (sampled_chains.py)
    decides_chains: ClassVar[bool] = False
    draws_per_draft: ClassVar[bool] = False  # its chain (tree) rule draws a uniform per draft (node)
    # its sampled chain rule reads what a sampled draft was proposed by: p_d of its tokens, its rows
    reads_draft_probs: ClassVar[bool] = False
    # True: a sampled tree's verdict follows from `tree_paths`, and a step decides many requests' at
    # once (sampled_trees.py)
    decides_trees: ClassVar[bool] = False

    def __init__(self, params: Optional[PolicyParams] = None):
        self.params = params if params is not None else self.Params()

    @property
    def needs_profile(self) -> bool:
        """Whether a default of this policy comes from the target's profile (calibration/target_profile.py)."""
        return False

    def for_target(self, profile: Optional["TargetProfile"]) -> "AcceptancePolicy":
        """This policy with its target-derived defaults taken from `profile`."""
        return self

    def target_features(
        self, target: TargetBlock, draft_tokens: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """Extra tensors computed where the target lives (next to its hidden states and LM
        head) for the draft tokens `[K]`, stored in `TargetBlock.features` before `verify`."""
        return {}

    def needs_draft_logits(self) -> bool:
        """Whether verify reads the draft's logits beyond p_d of sampled drafts (EASD's draft
        entropy, DropMatch's JS criterion); otherwise only draft tokens need to travel."""
        return False

    def wire_top_k(self, sampling: SamplingParams) -> Optional[int]:
        """How many top log-probs per target row this policy reads (see compact.py); None
        means it needs the full rows. The base rule at T = 0 reads only the argmax."""
        return 1 if sampling.greedy else None

    def decided_by_target_rows(self, sampling: SamplingParams) -> bool:
        """Whether a verdict follows from the target's rows and the draft's tokens alone (no draft
        rows, no random draws), so that the target worker can decide it as the server will
        (run-ahead's forwarded blocks, run_ahead.py)."""
        return False

    @abstractmethod
    def verify(
        self,
        draft: DraftBlock,
        target: TargetBlock,
        sampling: SamplingParams,
        generator: torch.Generator,
    ) -> Verdict: ...

    def verify_tree(
        self, draft: DraftBlock, target: TargetBlock, sampling: SamplingParams, generator: torch.Generator
    ) -> Verdict:
        """Verify a candidate tree (`draft.tree`; `target` holds the root's row and every node's):
        the Verdict's `path` is the accepted one (tree_verify.py)."""
        raise NotImplementedError(f"policy {self.name!r} has no tree rule")

    @classmethod
    def chain_accepts(cls, chains: "SampledChains") -> torch.Tensor:
        """With `decides_chains`: whether each draft of `chains` passes on its own `[D]` bool."""
        raise NotImplementedError

    @classmethod
    def chain_next_weights(cls, chains: "SampledChains", num_accepted: torch.Tensor) -> torch.Tensor:
        """With `decides_chains`: the weights `[B, V]` each chain's next token is sampled from,
        after its first `num_accepted [B]` drafts."""
        raise NotImplementedError

    @classmethod
    def tree_paths(cls, trees: "SampledTrees") -> tuple[torch.Tensor, torch.Tensor]:
        """With `decides_trees`: which nodes are on each tree's accepted path `[B, N]` bool, and
        each tree's next token `[B]`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{self.name}({self.params.model_dump()})"


def first_false(flags: torch.Tensor) -> int:
    """Index of the first False in `flags [K]` (K when all are True)."""
    return int(flags.to(torch.int64).cumprod(0).sum())


def base_decision(
    draft: DraftBlock, target: TargetBlock, sampling: SamplingParams, generator: torch.Generator
) -> BaseDecision:
    """Base-rule accept flags for every draft position (vectorized over K). At T > 0 the target
    rows are one softmax pass; p_d(c_i) comes with a sampled draft (one-hot drafts have 1)."""
    num_draft, device = draft.num_tokens, target.logits.device
    if sampling.greedy:
        target_argmax = argmax(target.logits)
        return BaseDecision(draft.tokens == target_argmax[:num_draft], None, target_argmax)
    target_probs = sampling_probs(target.logits, sampling)
    draft_token_probs = draft.token_probs if draft.sampled else torch.ones(num_draft, device=device)
    target_token_probs = target_probs[:num_draft].gather(-1, draft.tokens[:, None]).squeeze(-1)
    ratio = target_token_probs / draft_token_probs.clamp_min(1e-10)
    uniform = torch.rand(num_draft, generator=generator).to(device)
    return BaseDecision(uniform <= ratio, target_probs, None, ratio, uniform)


def recover_token(
    position: int,
    draft: DraftBlock,
    decision: BaseDecision,
    sampling: SamplingParams,
    generator: torch.Generator,
) -> int:
    """The token emitted at `position`: the bonus when position == K, else the correction after
    a rejection there (target argmax at T = 0, a residual sample at T > 0)."""
    if decision.target_probs is None:
        return int(decision.target_argmax[position])
    target_row = decision.target_probs[position]
    if position < draft.num_tokens:
        draft_row = draft.probs(sampling, target_row.shape[-1], rows=position)
        residual_row = (target_row - draft_row).clamp_min(0)
        # p_t == p_d leaves no residual mass; p_t itself is then the right law
        if float(residual_row.sum()) > 0:
            target_row = residual_row
    return int(sample(target_row[None], generator)[0])


def accepted_prefix(flags: torch.Tensor, num_accepted: int) -> torch.Tensor:
    prefix = torch.zeros_like(flags, dtype=torch.bool)
    prefix[:num_accepted] = True
    return prefix
