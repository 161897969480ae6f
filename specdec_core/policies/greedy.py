"""Exact match: accept while the draft token equals the target argmax (needs temperature 0). In
a tree, a node passes when its token is the target's argmax at its parent."""

from __future__ import annotations

import torch

from ..api.sampling import argmax
from ..drafters.drafter_base import common_prefix_length
from ..loop.stage_types import Verdict
from ..trees.tree_verify import best_path, kept_chain
from .policy_base import AcceptancePolicy, accepted_prefix, base_decision, first_false


class GreedyPolicy(AcceptancePolicy):
    name = "greedy"
    lossless = True
    supports_sampling = False
    supports_trees = True

    def decided_by_target_rows(self, sampling) -> bool:
        return sampling.greedy

    def verify(self, draft, target, sampling, generator) -> Verdict:
        if target.argmax_ids is not None:  # the step read every row's argmax back at once: all on the host
            drafted = draft.token_ids
            num_accepted = common_prefix_length(drafted, target.argmax_ids, len(drafted))
            accepted = torch.arange(len(drafted)) < num_accepted  # [K]
            return Verdict(num_accepted, target.argmax_ids[num_accepted], {"accepted": accepted})
        decision = base_decision(draft, target, sampling, generator)
        num_accepted = first_false(decision.accepted)
        return Verdict(
            num_accepted,
            int(decision.target_argmax[num_accepted]),
            {"accepted": accepted_prefix(decision.accepted, num_accepted)},
        )

    def verify_tree(self, draft, target, sampling, generator) -> Verdict:
        if target.argmax_ids is not None:  # the step read every row's argmax back at once: all on the host
            parent_ids, argmax_ids = draft.tree.parents.tolist(), target.argmax_ids
            passing = [token == argmax_ids[parent_ids[node]] for node, token in enumerate(draft.token_ids, 1)]
            path = kept_chain(parent_ids, passing)
            if path is not None:
                return Verdict.of_path(path, argmax_ids[path[-1]])
        parents = draft.tree.parents[1:].to(target.logits.device)
        predicted = argmax(target.logits)
        node_accepted = draft.tokens == predicted[parents]
        node_log_probs = target.logits.log_softmax(-1)[parents, draft.tokens]
        return Verdict.of_path(*best_path(draft.tree, node_accepted, node_log_probs, predicted.__getitem__))
