"""DropMatch, MC-dropout LM-head paths (Lee et al., "Training-free Dropout Sampling for Semantic
Token Acceptance in Speculative Decoding", arXiv:2603.03333).

N inverted-dropout masks (prob p) on the target's final hidden state, all paths through the LM
head in one batched matmul (the KV cache is untouched: only the head input is perturbed). A
token the base rule rejects is accepted if one of the chosen `criteria` holds: "majority", c_i is
the most frequent path token; "js", JS(p_d || centroid) <= max_k JS(p_k || centroid) (centroid =
softmax of the mean path logits); "naive", any path token equals c_i (works across vocabularies
and for trees). The paper's rule is majority or JS. Path tokens are argmax at T = 0, sampled
otherwise. The paper's text lost its numbers: N and p are parameters. p = 0 makes every path
equal the target, which reduces to greedy at T = 0."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator

from ..api.sampling import argmax, entropy, sample, sampling_probs
from ..loop.stage_types import Verdict
from .policy_base import AcceptancePolicy, PolicyParams, accepted_prefix, base_decision, first_false, recover_token

Criterion = Literal["majority", "js", "naive"]


class DropMatchParams(PolicyParams):
    num_paths: int = Field(5, ge=1, le=64)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    criteria: tuple[Criterion, ...] = Field(("majority", "js"), description="a rejected token passes if any holds")

    @field_validator("criteria")
    @classmethod
    def _some_criteria(cls, criteria):
        if not criteria:
            raise ValueError("give at least one of majority, js, naive")
        return tuple(dict.fromkeys(criteria))


def js_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (nats) between distributions given as log-probs, last dim:
    H(m) - (H(p) + H(q)) / 2 with m the mixture (0 log 0 = 0, so one-hot rows work)."""
    p, q = log_p.exp(), log_q.exp()
    return entropy(0.5 * (p + q)) - 0.5 * (entropy(p) + entropy(q))


class DropMatchPolicy(AcceptancePolicy):
    name = "dropmatch"
    Params = DropMatchParams
    counters = ("loose",)
    needs_hidden = True

    def needs_draft_logits(self) -> bool:
        return "js" in self.params.criteria

    def wire_top_k(self, sampling):
        return 1 if sampling.greedy and "js" not in self.params.criteria else None

    def target_features(self, target, draft_tokens, sampling, generator):
        """Dropout paths for the positions whose outcome they can change: at T = 0 only where the
        draft token is not the target argmax (elsewhere the base rule accepts), at T > 0 all."""
        num_draft = draft_tokens.shape[0]
        rows = torch.arange(num_draft, device=draft_tokens.device)
        if sampling.greedy:
            rows = rows[draft_tokens != argmax(target.logits[:num_draft])]
        hidden = target.hidden[rows].float()  # [R, H]
        keep = 1.0 - self.params.dropout
        # drawn on the host (the request's generator lives there), the same on every rank of a group
        masks = torch.bernoulli(torch.full((self.params.num_paths, *hidden.shape), keep), generator=generator)
        masks = masks.to(hidden.device) / keep
        path_logits = target.lm_head(hidden[None] * masks).float()  # [N, R, V], one matmul
        if sampling.greedy:
            path_tokens = argmax(path_logits)
        else:
            path_probs = sampling_probs(path_logits.flatten(0, 1), sampling)
            path_tokens = sample(path_probs, generator).view(self.params.num_paths, len(rows))
        features = {"rows": rows, "path_tokens": path_tokens}
        if "js" in self.params.criteria:
            path_log_probs = path_logits.log_softmax(-1)
            centroid_log_probs = path_logits.mean(0).log_softmax(-1)  # [R, V]
            features["centroid_log_probs"] = centroid_log_probs
            features["max_path_js"] = js_divergence(path_log_probs, centroid_log_probs[None]).max(0).values
        return features

    def verify(self, draft, target, sampling, generator) -> Verdict:
        decision = base_decision(draft, target, sampling, generator)
        features = target.features
        rows, path_tokens = features["rows"], features["path_tokens"]  # [R], [N, R]
        row_tokens = draft.tokens[rows]
        criteria = self.params.criteria
        row_matched = torch.zeros(len(rows), dtype=torch.bool, device=rows.device)
        if "naive" in criteria:
            row_matched |= (path_tokens == row_tokens[None]).any(0)
        if "majority" in criteria:
            row_matched |= path_tokens.mode(0).values == row_tokens
        if "js" in criteria:
            # only where neither the base rule nor another criterion already accepts
            todo = (~row_matched & ~decision.accepted[rows]).nonzero().squeeze(-1)
            if draft.logits is None:  # a deterministic draft is one-hot
                draft_log_probs = torch.full((len(todo), target.vocab_size), float("-inf"), device=rows.device)
                draft_log_probs.scatter_(-1, row_tokens[todo, None], 0.0)
            else:
                draft_log_probs = draft.logits[rows[todo]].float().log_softmax(-1)
            draft_js = js_divergence(draft_log_probs, features["centroid_log_probs"][todo])
            row_matched[todo] = draft_js <= features["max_path_js"][todo]
        matched = torch.zeros(draft.num_tokens, dtype=torch.bool, device=rows.device)
        matched[rows] = row_matched
        accepted = decision.accepted | matched
        num_accepted = first_false(accepted)
        next_token = recover_token(num_accepted, draft, decision, sampling, generator)
        kept = accepted_prefix(accepted, num_accepted)
        return Verdict(num_accepted, next_token, {"accepted": kept, "loose": kept & ~decision.accepted})
