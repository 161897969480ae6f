"""Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023); greedy at T = 0. A
tree's nodes are verified by the point-mass rule of tree_verify.sample_path (SpecInfer's, as
EAGLE's trees are), lossless for any tree."""

from __future__ import annotations

from ..loop.stage_types import Verdict
from ..trees.tree_verify import sample_path
from .greedy import GreedyPolicy, tree_verdict
from .policy_base import AcceptancePolicy, accepted_prefix, base_decision, first_false, recover_token


class RejectionPolicy(AcceptancePolicy):
    name = "rejection"
    lossless = True
    supports_trees = True

    def decided_by_target_rows(self, sampling) -> bool:
        return sampling.greedy  # the base rule at T = 0: the target's argmax

    def verify(self, draft, target, sampling, generator) -> Verdict:
        decision = base_decision(draft, target, sampling, generator)
        num_accepted = first_false(decision.accepted)
        next_token = recover_token(num_accepted, draft, decision, sampling, generator)
        return Verdict(num_accepted, next_token, {"accepted": accepted_prefix(decision.accepted, num_accepted)})

    def verify_tree(self, draft, target, sampling, generator) -> Verdict:
        if sampling.greedy:
            return GreedyPolicy().verify_tree(draft, target, sampling, generator)
        path, next_token = sample_path(draft.tree, draft.tokens, target.logits, sampling, generator)
        return tree_verdict(path, next_token)
