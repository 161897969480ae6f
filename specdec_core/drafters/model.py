"""Draft-model drafter with its own KV cache, and FLy's multi-level acceleration (MLA).

`model`: the draft LM proposes one token per forward (argmax at T = 0, a sample of the warped
distribution otherwise), optionally stopping early when its top probability falls below
`confidence_threshold`. `mla`: prompt lookup guesses a continuation and the draft model checks
it greedily in the same forward, so one draft forward yields (matched guesses + 1) tokens;
the proposal equals the plain greedy draft, only cheaper. MLA proposals are deterministic
(one-hot draft distribution) also at T > 0.

The draft cache is reconciled with the committed context by longest common prefix, so any
commit (including loosely accepted or corrected tokens) rolls back exactly."""

from __future__ import annotations

from typing import ClassVar, Optional, Sequence

import torch
from pydantic import Field

from ..sampling import argmax, sample, sampling_probs
from ..target import crop_cache, make_cache
from ..types import DraftBlock
from .base import Drafter, DrafterParams, common_prefix_length
from .pld import PromptLookupParams, lookup_continuation


class ModelDrafterParams(DrafterParams):
    confidence_threshold: float = Field(
        0.0, ge=0.0, le=1.0, description="stop drafting when the draft's top prob is below this"
    )


class MultiLevelParams(ModelDrafterParams, PromptLookupParams):
    pass


class ModelDrafter(Drafter):
    name = "model"
    Params = ModelDrafterParams
    deterministic: ClassVar[bool] = False  # True: proposals never sampled (one-hot p_d)

    def __init__(self, model: torch.nn.Module, params: Optional[ModelDrafterParams] = None):
        super().__init__(params)
        self.model = model
        self.cache = None
        self.cached_tokens: list[int] = []
        self.forwards = 0

    def lookup(self, context: Sequence[int], max_tokens: int) -> list[int]:
        return []

    def reset(self, prompt_ids, sampling, generator) -> None:
        super().reset(prompt_ids, sampling, generator)
        self.cache = make_cache(self.model)
        self.cached_tokens = []

    def sync_cache(self, sequence: Sequence[int]) -> None:
        """Crop the cache to its longest prefix shared with `sequence` (leaving >= 1 to feed)."""
        shared = common_prefix_length(self.cached_tokens, sequence, min(len(self.cached_tokens), len(sequence) - 1))
        crop_cache(self.cache, shared)
        del self.cached_tokens[shared:]

    @torch.inference_mode()
    def propose(self, max_tokens: int) -> DraftBlock:
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        token_probs: list[torch.Tensor] = []  # p_d of sampled tokens, for verification
        sampled = not self.sampling.greedy and not self.deterministic
        while len(tokens) < max_tokens:
            sequence = self.context + tokens
            self.sync_cache(sequence)
            pending = sequence[len(self.cached_tokens) :]
            guess = self.lookup(sequence, max_tokens - len(tokens) - 1)
            logits = self.model(
                input_ids=torch.tensor([pending + guess]), past_key_values=self.cache, use_cache=True,
                logits_to_keep=len(guess) + 1,
            ).logits[0].float()
            self.forwards += 1
            self.cached_tokens.extend(pending + guess)
            if sampled:
                probs = sampling_probs(logits, self.sampling)
                predicted_ids = sample(probs, self.generator)
            else:
                predicted_ids = argmax(logits)
            predicted = predicted_ids.tolist()
            matched = common_prefix_length(guess, predicted, len(guess))
            tokens.extend(predicted[: matched + 1])
            rows.append(logits[: matched + 1])
            if sampled:
                token_probs.append(probs[: matched + 1].gather(-1, predicted_ids[: matched + 1, None]).squeeze(-1))
            threshold = self.params.confidence_threshold
            if threshold > 0 and logits[matched].softmax(-1).amax() < threshold:
                break
        if not tokens:
            return DraftBlock.empty()
        return DraftBlock(
            tokens=torch.tensor(tokens[:max_tokens], dtype=torch.long),
            logits=torch.cat(rows)[:max_tokens],
            token_probs=torch.cat(token_probs)[:max_tokens] if sampled else None,
        )


class MultiLevelDrafter(ModelDrafter):
    name = "mla"
    Params = MultiLevelParams
    deterministic = True

    def lookup(self, context: Sequence[int], max_tokens: int) -> list[int]:
        return lookup_continuation(context, self.params, max_tokens)[1]
