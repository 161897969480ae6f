"""Target scorer: chain verification of `[last committed, d_1..d_K]` in one forward, with a KV
cache that always holds exactly the committed tokens but the last one. Rollback of rejected
positions crops the cache."""

from __future__ import annotations

from typing import Sequence

import torch

from .kernels.kv_cache import crop_cache, make_cache
from .logprobs import token_log_probs
from .policies import AcceptancePolicy
from .sampling import SamplingParams
from .types import TargetBlock


class TargetScorer:
    """One request's target state (a `TargetSession`). `score` appends the scored tokens to the
    cache; `commit(n)` keeps the first n of them. The request's policy computes its target-side
    features (`policy.target_features`, e.g. DropMatch's dropout paths) here, next to the hidden
    states and LM head, from `sampling.generator("target")`, so they come out the same wherever
    the target runs."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache = None
        self.committed_len = 0
        self.num_scored = 0  # tokens of the last `score`, of which `commit` keeps some

    @torch.inference_mode()
    def reset(self, prompt_ids: Sequence[int], policy: AcceptancePolicy, sampling: SamplingParams) -> None:
        """Prefill all prompt tokens but the last (which the first `score` call feeds)."""
        if len(prompt_ids) == 0:
            raise ValueError("prompt must contain at least one token")
        self.policy = policy
        self.sampling = sampling
        self.features_rng = sampling.generator("target")
        self.cache = make_cache(self.model)
        self.committed_len = 0
        self.num_scored = 0
        if len(prompt_ids) > 1:
            self.model.model(input_ids=self.ids(prompt_ids[:-1]), past_key_values=self.cache, use_cache=True)
            self.committed_len = len(prompt_ids) - 1

    @torch.inference_mode()
    def score(self, tokens: Sequence[int]) -> TargetBlock:
        """Logits `[len(tokens), V]` (fp32) for the tokens appended after the committed prefix,
        plus the policy's target-side features for the `len(tokens) - 1` draft positions."""
        crop_cache(self.cache, self.committed_len)
        self.num_scored = len(tokens)
        output = self.model.model(input_ids=self.ids(tokens), past_key_values=self.cache, use_cache=True)
        hidden = output.last_hidden_state  # [1, T, H]: a row-parallel LM head (DeepSpeed's) splits dim 2
        block = TargetBlock(logits=self.model.lm_head(hidden)[0].float())
        if self.policy.needs_hidden:
            block.hidden, block.lm_head = hidden[0], self.model.lm_head
        draft_tokens = self.ids(tokens[1:])[0]
        if self.sampling.logprobs is not None:
            block.token_log_probs = token_log_probs(block.logits[:-1], draft_tokens)
        block.features = self.policy.target_features(block, draft_tokens, self.sampling, self.features_rng)
        return block

    def ids(self, tokens: Sequence[int]) -> torch.Tensor:
        """`[1, n]` token ids on the model's device."""
        return torch.tensor([list(tokens)], dtype=torch.long, device=self.model.device)

    def commit(self, num_keep: int) -> None:
        """Keep the first `num_keep` scored tokens; the rest are rolled back on the next call."""
        self.committed_len += num_keep
        crop_cache(self.cache, self.committed_len)
