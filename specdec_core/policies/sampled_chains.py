"""Sampled chains decided together: the verdicts of many requests' T > 0 chains under one rule
(rejection sampling, typical acceptance) in a few tensor operations over all of them and one read
back, so a step's acceptance launches as many operations at 64 sessions as at one. A lone
request's `verify` is this code over one chain, so a request is decided alike in a batch or alone:
every draw comes from its own generator, in the rule's order (a uniform per draft where the rule
draws them, then one for the next token), taken on the host before any device work.

Vocabulary: B chains, K_b the drafts of chain b, D = sum K_b, M = D + B target rows, V the vocabulary."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..api.sampling import SamplingParams, sample_draws, sample_with, sampling_probs, warp_logits
from ..loop.stage_types import DraftBlock, TargetBlock, Verdict


@dataclass
class Check:
    """One request's verify call: what `AcceptancePolicy.verify` takes."""

    policy: "AcceptancePolicy"  # noqa: F821 - policy_base's; typed loosely to keep imports one-way
    draft: DraftBlock
    target: TargetBlock
    sampling: SamplingParams
    generator: torch.Generator

    def verdict(self) -> Verdict:
        """Its verdict by its own policy call (a tree's by the policy's tree rule)."""
        verify = self.policy.verify if self.draft.tree is None else self.policy.verify_tree
        return verify(self.draft, self.target, self.sampling, self.generator)

    @property
    def decided_together(self) -> bool:
        """Whether a step decides its verdict with the others' (step_verdicts.py): a sampled chain
        or tree under a rule that has one for it."""
        if self.sampling.greedy:
            return False
        return self.policy.decides_trees if self.draft.tree is not None else self.policy.decides_chains


@dataclass
class SampledChains:
    """B chains of one rule and one warp setting, laid out flat on the target's device."""

    checks: list[Check]
    warped_logits: torch.Tensor  # [M, V] the target's rows, warped (temperature, top-k/p, min-p)
    target_probs: torch.Tensor  # [M, V] their softmax: what the chains sample from
    num_drafts: torch.Tensor  # [B] K_b
    starts: torch.Tensor  # [B] chain b's first row among the M
    draft_rows: torch.Tensor  # [D] the row scoring each draft: chain b's i-th at starts[b] + i
    draft_tokens: torch.Tensor  # [D]
    draft_chain: torch.Tensor  # [D] b of each draft
    draft_position: torch.Tensor  # [D] i of each draft
    uniform: Optional[torch.Tensor]  # [D] float32, a draw per draft (rules that draw them)
    sample_uniform: torch.Tensor  # [B, 1] float64, each chain's draw for its next token

    @property
    def token_target_probs(self) -> torch.Tensor:
        """p_t(c) of each draft token `[D]`."""
        return self.target_probs[self.draft_rows, self.draft_tokens]

    def per_draft(self, values: Sequence[float]) -> torch.Tensor:
        """A per-chain setting (a policy's parameter) at each draft `[D]`, float32."""
        per_chain = torch.tensor(values, dtype=torch.float32).to(self.draft_chain.device, non_blocking=True)
        return per_chain[self.draft_chain]

    def first_rejections(self, accepted: torch.Tensor) -> torch.Tensor:
        """Each chain's accepted prefix length `[B]` from its drafts' flags `accepted [D]`."""
        batch, width = len(self.checks), max(check.draft.num_tokens for check in self.checks) + 1
        flags = torch.zeros(batch, width, dtype=torch.long, device=accepted.device)  # a False after each chain
        flags[self.draft_chain, self.draft_position] = accepted.long()
        return flags.cumprod(1).sum(1)

    def draft_probs_at(self, num_accepted: torch.Tensor) -> torch.Tensor:
        """`[B, V]` the distribution each chain's first rejected draft was proposed from (a draft
        model's row, or a point mass where the tokens were not sampled); zero after all K_b (the bonus)."""
        drafted = [check.draft for check in self.checks if check.draft.num_tokens]
        vocab_size = self.target_probs.shape[-1]
        if not drafted:
            return torch.zeros_like(self.target_probs[: len(self.checks)])
        ends = self.num_drafts.cumsum(0)
        # each chain's first rejected draft among the D (a chain of none points anywhere, masked below)
        at = (ends - self.num_drafts + num_accepted).clamp(max=ends - 1).clamp(min=0)  # [B]
        if not any(draft.sampled for draft in drafted):
            rows = torch.nn.functional.one_hot(self.draft_tokens[at], vocab_size).float()
        else:  # a point mass's logits (0 at its token, -inf elsewhere) warp to the point mass
            logits = [draft.logits if draft.sampled else point_mass(draft.tokens, vocab_size) for draft in drafted]
            rows = sampling_probs(joined(logits)[at], self.checks[0].sampling)
        return rows * (num_accepted < self.num_drafts)[:, None]


def point_mass(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[K, V]` logits whose distribution is all on `tokens [K]`, one a row."""
    logits = torch.full((len(tokens), vocab_size), float("-inf"), device=tokens.device)
    return logits.scatter_(1, tokens[:, None], 0.0)


@dataclass
class Decided:
    """Verdicts decided on the device, waiting for the read back they share with the step's others."""

    read: torch.Tensor  # [X] int64 on the device: what the verdicts need on the host
    verdicts: Callable[[list[int]], list[Verdict]]  # the verdicts, from `read`'s values


def read_back(decided: Sequence[Decided]) -> list[list[Verdict]]:
    """Each decision's verdicts, from one read back of all of their tensors."""
    values = torch.cat([each.read for each in decided]).tolist()  # the one read back
    starts = [0, *itertools.accumulate(len(each.read) for each in decided)]
    return [each.verdicts(values[start:end]) for each, start, end in zip(decided, starts, starts[1:])]


def decide_chains(checks: Sequence[Check]) -> list[Verdict]:
    """The verdicts of sampled chains (`Check.decided_together`), each as it would be alone, with
    one read back."""
    return read_back([chains_decided(checks)])[0]


def chains_decided(checks: Sequence[Check]) -> Decided:
    """Sampled chains decided on the device: their accepted counts `[B]`, then next tokens `[B]`, to read."""
    draws = [draw(check) for check in checks]  # on the host, before any device work
    order, counts, tokens = [], [], []
    for indices in warp_groups(checks):
        rule = type(checks[indices[0]].policy)
        chains = lay_out([checks[index] for index in indices], [draws[index] for index in indices])
        num_accepted = chains.first_rejections(rule.chain_accepts(chains))  # [B]
        tokens.append(sample_with(rule.chain_next_weights(chains, num_accepted), chains.sample_uniform))
        counts.append(num_accepted)
        order += indices

    def verdicts(values: list[int]) -> list[Verdict]:
        made: list[Optional[Verdict]] = [None] * len(checks)
        for index, num_accepted, next_token in zip(order, values[: len(checks)], values[len(checks) :]):
            flags = torch.arange(checks[index].draft.num_tokens) < num_accepted  # [K] the accepted prefix
            made[index] = Verdict(num_accepted, next_token, {"accepted": flags})
        return made

    return Decided(torch.cat([*counts, *tokens]), verdicts)


def warp_groups(checks: Sequence[Check]) -> list[list[int]]:
    """The checks' indices by rule and warp setting: each group's rows are warped and decided together."""
    groups: dict[tuple, list[int]] = {}
    for index, check in enumerate(checks):
        sampling = check.sampling
        key = (type(check.policy), sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def draw(check: Check, dtype: torch.dtype = torch.float32) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """A check's uniforms in its rule's order: one per draft (a tree's node) where the rule draws
    them `[K]` (`dtype`), then the next token's `[1, 1]`."""
    per_draft = None
    if check.policy.draws_per_draft:
        per_draft = torch.rand(check.draft.num_tokens, generator=check.generator, dtype=dtype)
    return per_draft, sample_draws(check.generator)


def lay_out(checks: list[Check], draws: list[tuple]) -> SampledChains:
    """Chains of one rule and warp, their index tensors built on the host and moved once."""
    device = checks[0].target.logits.device
    sizes = [check.draft.num_tokens for check in checks]  # K_b
    starts = [0, *itertools.accumulate(size + 1 for size in sizes[:-1])]  # each chain's first row
    draft_chain = [chain for chain, size in enumerate(sizes) for _ in range(size)]  # [D]
    draft_position = [position for size in sizes for position in range(size)]  # [D]
    draft_rows = [starts[chain] + position for chain, position in zip(draft_chain, draft_position)]
    warped = warp_logits(joined([check.target.logits for check in checks]), checks[0].sampling)  # [M, V]
    uniform = joined([per_draft for per_draft, _ in draws]) if draws[0][0] is not None else None

    def moved(values):
        if values is None:
            return None
        values = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
        return values.to(device, non_blocking=True)

    return SampledChains(
        checks,
        warped,
        warped.softmax(-1),
        *map(moved, (sizes, starts, draft_rows, joined([check.draft.tokens for check in checks]))),
        *map(moved, (draft_chain, draft_position, uniform, joined([sample for _, sample in draws]))),
    )


def joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(tensors)`, without a copy of a lone one (a request decided alone)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
