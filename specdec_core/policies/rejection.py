"""Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023); greedy at T = 0. A
sampled chain accepts c_i with probability min(1, p_t(c_i)/p_d(c_i)) and after its first rejection
samples from norm(max(0, p_t - p_d)) (the bonus from p_t), many requests' chains at once
(sampled_chains.py). A tree's nodes are verified by the point-mass rule of
tree_verify.sample_path (SpecInfer's, as EAGLE's trees are), lossless for any tree."""

from __future__ import annotations

import torch

from ..loop.stage_types import Verdict
from ..trees.tree_verify import sample_path
from .greedy import GreedyPolicy, tree_verdict
from .policy_base import AcceptancePolicy
from .sampled_chains import Check, decide_chains


class RejectionPolicy(AcceptancePolicy):
    name = "rejection"
    lossless = True
    supports_trees = True
    decides_chains = True
    draws_per_draft = True

    def decided_by_target_rows(self, sampling) -> bool:
        return sampling.greedy  # the base rule at T = 0: the target's argmax

    def verify(self, draft, target, sampling, generator) -> Verdict:
        if sampling.greedy:
            return GreedyPolicy().verify(draft, target, sampling, generator)
        return decide_chains([Check(self, draft, target, sampling, generator)])[0]

    @classmethod
    def chain_accepts(cls, chains) -> torch.Tensor:
        # a one-hot (unsampled) draft proposed its token with probability 1
        device = chains.uniform.device
        draft_token_probs = torch.cat(
            [
                check.draft.token_probs if check.draft.sampled else torch.ones(check.draft.num_tokens, device=device)
                for check in chains.checks
            ]
        )  # [D]
        ratio = chains.token_target_probs / draft_token_probs.clamp_min(1e-10)
        return chains.uniform <= ratio

    @classmethod
    def chain_next_weights(cls, chains, num_accepted) -> torch.Tensor:
        target_rows = chains.target_probs[chains.starts + num_accepted]  # [B, V]
        residual = (target_rows - chains.draft_probs_at(num_accepted)).clamp_min(0)  # the bonus's: p_t
        # p_t == p_d leaves no residual mass; p_t itself is then the right law
        return torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_rows)

    def verify_tree(self, draft, target, sampling, generator) -> Verdict:
        if sampling.greedy:
            return GreedyPolicy().verify_tree(draft, target, sampling, generator)
        path, next_token = sample_path(draft.tree, draft.tokens, target.logits, sampling, generator)
        return tree_verdict(path, next_token)
