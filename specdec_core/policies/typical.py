"""Typical acceptance (Medusa / Hydra): accept c_i iff p_t(c_i) > min(eps, alpha * exp(-H(p_t))).

p_t is the temperature-warped target distribution; at T = 0 the rule is exact match. After the
accepted prefix the next token is sampled from p_t at that position (the bonus likewise). In a
tree (Medusa's own use of the rule) a node passes when its token clears the threshold of p_t at
its parent; after the best path the next token is sampled from p_t at its last node."""

from __future__ import annotations

import torch
from pydantic import Field

from ..api.sampling import entropy_of_probs, sample, warp_logits
from ..loop.stage_types import Verdict
from ..trees.tree_verify import best_path
from .greedy import GreedyPolicy, tree_verdict
from .policy_base import AcceptancePolicy, PolicyParams, accepted_prefix, first_false


class TypicalParams(PolicyParams):
    epsilon: float = Field(0.09, ge=0.0, le=1.0, description="hard probability threshold")
    alpha: float = Field(0.3, ge=0.0, le=1.0, description="entropy-scaled threshold factor")


class TypicalPolicy(AcceptancePolicy):
    name = "typical"
    Params = TypicalParams
    supports_trees = True

    def passes(self, token_probs: torch.Tensor, target_probs, warped_logits) -> torch.Tensor:
        """p_t(c) > min(eps, alpha exp(-H(p_t))) per row; H only where eps alone does not pass."""
        accepted = token_probs > self.params.epsilon
        rows = (~accepted).nonzero().flatten()
        row_entropy = entropy_of_probs(target_probs[rows], warped_logits[rows])
        accepted[rows] = token_probs[rows] > self.params.alpha * torch.exp(-row_entropy)
        return accepted

    def verify(self, draft, target, sampling, generator) -> Verdict:
        if sampling.greedy:
            return GreedyPolicy().verify(draft, target, sampling, generator)
        warped_logits = warp_logits(target.logits, sampling)
        target_probs = warped_logits.softmax(-1)
        num_draft = draft.num_tokens
        draft_token_target_probs = target_probs[:num_draft].gather(-1, draft.tokens[:, None]).squeeze(-1)
        accepted = self.passes(draft_token_target_probs, target_probs[:num_draft], warped_logits[:num_draft])
        num_accepted = first_false(accepted)
        next_token = int(sample(target_probs[num_accepted][None], generator)[0])
        return Verdict(num_accepted, next_token, {"accepted": accepted_prefix(accepted, num_accepted)})

    def verify_tree(self, draft, target, sampling, generator) -> Verdict:
        if sampling.greedy:
            return GreedyPolicy().verify_tree(draft, target, sampling, generator)
        parents = draft.tree.parents[1:].to(target.logits.device)
        warped_logits = warp_logits(target.logits, sampling)
        target_probs = warped_logits.softmax(-1)
        node_probs = target_probs[parents, draft.tokens]
        node_accepted = self.passes(node_probs, target_probs[parents], warped_logits[parents])
        path = best_path(draft.tree, node_accepted, node_probs.clamp_min(1e-30).log())
        return tree_verdict(path, int(sample(target_probs[path[-1]][None], generator)[0]))
