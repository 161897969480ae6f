"""DropMatch, MC-dropout LM-head paths (papers/dropmatch_mc_dropout_acceptance.txt).

N inverted-dropout masks (prob p) on the target's final hidden state, all paths through the LM
head in one batched matmul (the KV cache is untouched: only the head input is perturbed).
Criterion "js" accepts c_i if it passes the base rule, or JS(p_d || centroid) <=
max_k JS(p_k || centroid) (centroid = softmax of the mean path logits), or c_i is the majority
(most frequent) path token. Criterion "naive" accepts c_i if any path token equals c_i (works
across vocabularies and for trees). Path tokens are argmax at T = 0, sampled otherwise. The
paper's text lost its numbers: N = 5, p = 0.1 are our defaults, both configurable. p = 0 makes
every path equal the target, which reduces to greedy at T = 0."""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from ..sampling import sample, sampling_probs
from ..types import Verdict
from .base import AcceptancePolicy, PolicyParams, accepted_prefix, base_decision, first_false, recover_token


class DropMatchParams(PolicyParams):
    num_paths: int = Field(5, ge=1, le=64)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    criterion: Literal["js", "naive"] = "js"


def js_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (nats) between distributions given as log-probs, last dim."""
    log_mid = torch.logaddexp(log_p, log_q) - math.log(2.0)
    kl_p = (log_p.exp() * (log_p - log_mid)).nan_to_num(0.0).sum(-1)
    kl_q = (log_q.exp() * (log_q - log_mid)).nan_to_num(0.0).sum(-1)
    return 0.5 * (kl_p + kl_q)


class DropMatchPolicy(AcceptancePolicy):
    name = "dropmatch"
    Params = DropMatchParams
    needs_hidden = True

    def needs_draft_logits(self) -> bool:
        return self.params.criterion == "js"

    def wire_top_k(self, sampling):
        return 1 if sampling.greedy and self.params.criterion == "naive" else None

    def target_features(self, target, num_draft, sampling, generator):
        hidden = target.hidden[:num_draft].float()  # [K, H]
        keep = 1.0 - self.params.dropout
        masks = torch.bernoulli(
            torch.full((self.params.num_paths, *hidden.shape), keep), generator=generator
        ) / keep
        path_logits = target.lm_head(hidden[None] * masks).float()  # [N, K, V], one matmul
        if sampling.greedy:
            path_tokens = path_logits.argmax(-1)
        else:
            path_probs = sampling_probs(path_logits.flatten(0, 1), sampling)
            path_tokens = sample(path_probs, generator).view(self.params.num_paths, num_draft)
        features = {"path_tokens": path_tokens}
        if self.params.criterion == "js":
            path_log_probs = path_logits.log_softmax(-1)
            centroid_log_probs = path_logits.mean(0).log_softmax(-1)  # [K, V]
            features["centroid_log_probs"] = centroid_log_probs
            features["max_path_js"] = js_divergence(path_log_probs, centroid_log_probs[None]).max(0).values
        return features

    def verify(self, draft, target, sampling, generator) -> Verdict:
        decision = base_decision(draft, target, sampling, generator)
        path_tokens = target.features["path_tokens"]  # [N, K]
        if self.params.criterion == "naive":
            matched = (path_tokens == draft.tokens[None]).any(0)
        else:
            majority_tokens = path_tokens.mode(0).values
            if draft.logits is None:
                draft_log_probs = torch.full_like(target.features["centroid_log_probs"], float("-inf"))
                draft_log_probs.scatter_(-1, draft.tokens[:, None], 0.0)
            else:
                draft_log_probs = draft.logits.float().log_softmax(-1)
            draft_js = js_divergence(draft_log_probs, target.features["centroid_log_probs"])
            matched = (draft_js <= target.features["max_path_js"]) | (majority_tokens == draft.tokens)
        accepted = decision.accepted | matched
        num_accepted = first_false(accepted)
        next_token = recover_token(num_accepted, draft, decision, sampling, generator)
        kept = accepted_prefix(accepted, num_accepted)
        return Verdict(num_accepted, next_token, {"accepted": kept, "loose": kept & ~decision.accepted})
