"""Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023); greedy at T = 0. A
sampled chain accepts c_i with probability min(1, p_t(c_i)/p_d(c_i)) and after its first rejection
samples from norm(max(0, p_t - p_d)) (the bonus from p_t), many requests' chains at once
(sampled_chains.py).

A sampled tree is verified by SpecInfer's multi-round rule with point-mass drafts (as EAGLE
verifies its trees), many requests' trees at once (sampled_trees.py). From the root, a node's
children are tried in rank order, each as a draft that proposed its token for sure: child c is
accepted with probability r(c) / |r|, r being the target's warped distribution p at the node less
the tokens of the children rejected before c. An accepted child becomes the node; when every child
is rejected (or the node is a leaf) the next token is drawn from r (from p where rounding left r
no mass). Each round is exact speculative sampling for its point mass, so the emitted tokens
follow the target for any tree whose tokens were chosen before the draws.

The walk goes down every tree at once, a depth a round, warping one row a tree (the node it is
at), so a round's operations do not grow with the trees. Within a round a node's children are
decided together, each with its own uniform, as if all were tried: r at child c is p less its
earlier siblings' distinct tokens (0 at c where an earlier sibling holds c's token), and the child
taken is the first passing one. Draws the walk never reaches change nothing, so this is the
sequential rule's law, and its very tokens for the same uniforms (a uniform per node, in node
order, then one for the next token)."""

from __future__ import annotations

import torch

from ..api.sampling import sample_with
from ..loop.stage_types import Verdict
from .greedy import GreedyPolicy
from .policy_base import AcceptancePolicy
from .sampled_chains import Check, decide_chains
from .sampled_trees import decide_trees


class RejectionPolicy(AcceptancePolicy):
    name = "rejection"
    lossless = True
    supports_trees = True
    decides_chains = True
    draws_per_draft = True
    reads_draft_probs = True  # min(1, p_t / p_d), and the residual max(0, p_t - p_d) after a rejection
    decides_trees = True

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
        return decide_trees([Check(self, draft, target, sampling, generator)])[0]

    @classmethod
    def tree_paths(cls, trees) -> tuple[torch.Tensor, torch.Tensor]:
        parents, tokens, real = trees.parents, trees.tokens, trees.real  # [B, N] each
        earlier_siblings = trees.square([tree.earlier_siblings for tree in trees.trees])  # [B, N, N]
        # a token an earlier sibling already proposed has no mass left when its turn comes
        repeated = (earlier_siblings & (tokens[:, :, None] == tokens[:, None, :])).any(-1)  # [B, N]
        sums_earlier = earlier_siblings.double()  # [B, N, N] a node's row sums its earlier siblings' entries
        at = torch.zeros_like(trees.roots)  # [B] the node each walk is at (0: the root)
        on_path = torch.zeros_like(real)  # [B, N]
        for _ in range(max(tree.max_depth for tree in trees.trees)):
            probs = trees.warped_probs(trees.roots + at)[1]  # [B, V] p at the node
            token_mass = torch.where(repeated, 0.0, probs.gather(1, tokens).double())  # [B, N] r(c) when c is tried
            earlier_mass = (sums_earlier @ token_mass[:, :, None]).squeeze(-1)  # [B, N]
            # |r| when c is tried; the difference may round below 0, a sum of r's entries never does
            mass = (probs.sum(-1, keepdim=True, dtype=torch.float64) - earlier_mass).clamp_min(0)  # [B, N]
            passes = (parents == at[:, None]) & (trees.uniform * mass < token_mass)  # [B, N] passing children
            taken = passes & ~(earlier_siblings & passes[:, None, :]).any(-1)  # [B, N] the first passing child
            on_path |= taken
            at = torch.where(taken.any(-1), taken.long().argmax(-1) + 1, at)  # a walk that took none stays
        # each walk's last node: the next token comes from p there less its children's tokens (all rejected)
        probs = trees.warped_probs(trees.roots + at)[1].double()  # [B, V]
        removed = torch.where(parents == at[:, None], 0.0, torch.inf).to(probs.dtype)  # [B, N] 0: a rejected child
        residual = probs.scatter_reduce(1, tokens, removed, reduce="amin")  # [B, V] r
        weights = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)  # [B, V]
        return on_path, sample_with(weights, trees.next_uniform)
