"""Typical acceptance (Medusa / Hydra): accept c_i iff p_t(c_i) > min(eps, alpha * exp(-H(p_t))).

p_t is the temperature-warped target distribution; at T = 0 the rule is exact match. After the
accepted prefix the next token is sampled from p_t at that position (the bonus likewise). In a
tree (Medusa's own use of the rule) a node passes when its token clears the threshold of p_t at
its parent; after the best path (the longest whose nodes all pass, ties to the higher total
log-probability) the next token is sampled from p_t at its last node. A step decides many requests'
sampled chains at once (sampled_chains.py), and their trees (sampled_trees.py)."""

from __future__ import annotations

import torch
from pydantic import Field

from ..api.sampling import entropy_of_probs, sample_with
from ..loop.stage_types import Verdict
from .greedy import GreedyPolicy
from .policy_base import AcceptancePolicy, PolicyParams
from .sampled_chains import Check, decide_chains
from .sampled_trees import decide_trees


class TypicalParams(PolicyParams):
    epsilon: float = Field(0.09, ge=0.0, le=1.0, description="hard probability threshold")
    alpha: float = Field(0.3, ge=0.0, le=1.0, description="entropy-scaled threshold factor")


class TypicalPolicy(AcceptancePolicy):
    name = "typical"
    Params = TypicalParams
    supports_trees = True
    decides_chains = True
    decides_trees = True

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
        return decide_trees([Check(self, draft, target, sampling, generator)])[0]

    @classmethod
    def tree_paths(cls, trees) -> tuple[torch.Tensor, torch.Tensor]:
        # the best path: the longest whose nodes all pass, ties to the higher total log-probability,
        # then to the first leaf's (tree_verify.best_path's order)
        inner_rows, parent_slots = trees.inner_rows()  # [I], [B, N]
        warped_logits, probs = trees.warped_probs(inner_rows)  # [I, V]
        node_probs = probs[parent_slots, trees.tokens]  # [B, N] p(c) at c's parent
        node_entropy = entropy_of_probs(probs, warped_logits)[parent_slots]  # [B, N] H(p) at c's parent
        params = [check.policy.params for check in trees.checks]
        epsilon, alpha = (trees.per_tree([getattr(each, name) for each in params]) for name in ("epsilon", "alpha"))
        passes = trees.real & clears(node_probs, node_entropy, epsilon, alpha)  # [B, N]
        lineage = trees.square([tree.attention_mask[1:, 1:] for tree in trees.trees])  # [B, N, N] n and its ancestors
        kept = passes & ~(lineage & ~passes[:, None, :]).any(-1)  # [B, N] it and every ancestor pass
        log_probs = torch.where(passes, node_probs.clamp_min(1e-30).log(), 0.0).double()  # [B, N]
        scores = (lineage.double() @ log_probs[:, :, None]).squeeze(-1)  # [B, N] the path to n's total
        depths = torch.where(kept, trees.padded([tree.depths[1:] for tree in trees.trees]), 0)  # [B, N]
        longest = kept & (depths == depths.amax(-1, keepdim=True))  # [B, N]
        best_scores = torch.where(longest, scores, -torch.inf)  # [B, N]
        best = longest & (best_scores == best_scores.amax(-1, keepdim=True))  # [B, N]
        first_leaves = trees.padded([tree.first_leaf for tree in trees.trees])  # [B, N]
        last = torch.where(best, first_leaves, torch.iinfo(torch.long).max).argmin(-1)  # [B] the last node - 1
        has_path = kept.any(-1)  # [B]
        on_path = lineage[torch.arange(len(last), device=last.device), last] & has_path[:, None]  # [B, N]
        last_rows = trees.roots + torch.where(has_path, last + 1, 0)  # [B]
        return on_path, sample_with(trees.warped_probs(last_rows)[1], trees.next_uniform)


def clears(token_probs: torch.Tensor, row_entropy: torch.Tensor, epsilon, alpha) -> torch.Tensor:
    """Whether each token clears its row's threshold, p_t(c) > min(eps, alpha exp(-H(p_t))), from
    `token_probs [R]` and its row's entropy `[R]`; `epsilon` and `alpha` one for all or one a row `[R]`."""
    return (token_probs > epsilon) | (token_probs > alpha * torch.exp(-row_entropy))
