"""Typical acceptance (Medusa / Hydra): accept c_i iff p_t(c_i) > min(eps, alpha * exp(-H(p_t))).

p_t is the temperature-warped target distribution; at T = 0 the rule is exact match. After the
accepted prefix the next token is sampled from p_t at that position (the bonus likewise). In a
tree (Medusa's own use of the rule) a node passes when its token clears the threshold of p_t at
its parent; after the best path the next token is sampled from p_t at its last node."""

from __future__ import annotations

import torch
from pydantic import Field

from ..api.sampling import entropy_of_probs, sample_draws, sample_with, warp_logits
from ..loop.stage_types import Verdict
from ..trees.tree_verify import best_path
from .greedy import GreedyPolicy, tree_verdict
from .policy_base import AcceptancePolicy, PolicyParams
from .sampled_chains import Check, decide_chains


class TypicalParams(PolicyParams):
    epsilon: float = Field(0.09, ge=0.0, le=1.0, description="hard probability threshold")
    alpha: float = Field(0.3, ge=0.0, le=1.0, description="entropy-scaled threshold factor")


class TypicalPolicy(AcceptancePolicy):
    name = "typical"
    Params = TypicalParams
    supports_trees = True
    decides_chains = True

    def verify(self, draft, target, sampling, generator) -> Verdict:
        if sampling.greedy:
            return GreedyPolicy().verify(draft, target, sampling, generator)
        return decide_chains([Check(self, draft, target, sampling, generator)])[0]

    @classmethod
    def chain_accepts(cls, chains) -> torch.Tensor:
        params = [check.policy.params for check in chains.checks]
        epsilon, alpha = (chains.per_draft([getattr(each, name) for each in params]) for name in ("epsilon", "alpha"))
        # every row's entropy, the bonus rows' too: indexing the draft rows out first copies them
        row_entropy = entropy_of_probs(chains.target_probs, chains.warped_logits)[chains.draft_rows]  # [D]
        return clears(chains.token_target_probs, row_entropy, epsilon, alpha)

    @classmethod
    def chain_next_weights(cls, chains, num_accepted) -> torch.Tensor:
        return chains.target_probs[chains.starts + num_accepted]  # [B, V] p_t after the accepted prefix

    def verify_tree(self, draft, target, sampling, generator) -> Verdict:
        if sampling.greedy:
            return GreedyPolicy().verify_tree(draft, target, sampling, generator)
        parents = draft.tree.parents[1:].to(target.logits.device)
        warped_logits = warp_logits(target.logits, sampling)
        target_probs = warped_logits.softmax(-1)
        node_probs = target_probs[parents, draft.tokens]
        params = self.params
        node_entropy = entropy_of_probs(target_probs, warped_logits)[parents]  # [N] each node's parent row's
        node_accepted = clears(node_probs, node_entropy, params.epsilon, params.alpha)
        uniform = sample_draws(generator)

        def sampled_after(node: torch.Tensor) -> torch.Tensor:
            return sample_with(target_probs[node][None], uniform)[0]

        return tree_verdict(*best_path(draft.tree, node_accepted, node_probs.clamp_min(1e-30).log(), sampled_after))


def clears(token_probs: torch.Tensor, row_entropy: torch.Tensor, epsilon, alpha) -> torch.Tensor:
    """Whether each token clears its row's threshold, p_t(c) > min(eps, alpha exp(-H(p_t))), from
    `token_probs [R]` and its row's entropy `[R]`; `epsilon` and `alpha` one for all or one a row `[R]`."""
    return (token_probs > epsilon) | (token_probs > alpha * torch.exp(-row_entropy))
