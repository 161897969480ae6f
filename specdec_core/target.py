"""Target scorer: chain verification of `[last committed, d_1..d_K]` in one forward, with a KV
cache that always holds exactly the committed tokens but the last one. Rollback of rejected
positions crops the DynamicCache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .sampling import SamplingParams
from .types import TargetBlock

if TYPE_CHECKING:
    from .policies import AcceptancePolicy


def make_cache(model: torch.nn.Module):
    """A DynamicCache whose full-attention layers are `GrowableLayer`s."""
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowableLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class GrowableLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views into buffers that double when full, so
    each token's K/V is written once. DynamicLayer's `torch.cat` re-copies the layer's whole
    cache on every forward: for SmolLM2 at 1,000 tokens, 46 MB per forward. Crop stays the
    inherited slice, a view into the same buffers."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        needed = length + key_states.shape[-2]
        held = self.buffers is not None and self.keys.data_ptr() == self.buffers[0].data_ptr()
        if not held or needed > self.buffers[0].shape[-2]:
            # first use, growth, or keys replaced by another Cache method: copy into new buffers
            capacity = max(needed, 256, 2 * self.buffers[0].shape[-2] if held else 0)
            self.buffers = tuple(
                self._grown(states, new_states, capacity, length)
                for states, new_states in ((self.keys, key_states), (self.values, value_states))
            )
        for buffer, new_states in zip(self.buffers, (key_states, value_states)):
            buffer[..., length:needed, :] = new_states
        self.keys, self.values = (buffer[..., :needed, :] for buffer in self.buffers)
        return self.keys, self.values

    @staticmethod
    def _grown(states: torch.Tensor, new_states: torch.Tensor, capacity: int, length: int) -> torch.Tensor:
        buffer = new_states.new_empty((*new_states.shape[:-2], capacity, new_states.shape[-1]))
        if length:
            buffer[..., :length, :] = states
        return buffer


def crop_cache(cache, keep: int) -> None:
    """Drop cached positions beyond `keep` (negative crop works in transformers 4.x and 5.x)."""
    surplus = cache.get_seq_length() - keep
    if surplus > 0:
        cache.crop(-surplus)


class TargetScorer:
    """One request's target state. `score` appends the scored tokens to the cache; `commit(n)`
    keeps the first n of them. The request's policy computes its target-side features
    (`policy.target_features`, e.g. DropMatch's dropout paths) here, next to the hidden states
    and LM head, from the scorer's own RNG (seed + 2), so they come out the same wherever the
    target runs."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache = None
        self.committed_len = 0
        self.policy: Optional["AcceptancePolicy"] = None
        self.sampling = SamplingParams()
        self.features_rng = torch.Generator()

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.inference_mode()
    def reset(
        self,
        prompt_ids: Sequence[int],
        policy: Optional["AcceptancePolicy"] = None,
        sampling: Optional[SamplingParams] = None,
    ) -> None:
        """Prefill all prompt tokens but the last (which the first `score` call feeds)."""
        if len(prompt_ids) == 0:
            raise ValueError("prompt must contain at least one token")
        self.policy = policy
        self.sampling = sampling or SamplingParams()
        self.features_rng = torch.Generator().manual_seed(self.sampling.seed + 2)
        self.cache = make_cache(self.model)
        self.committed_len = 0
        if len(prompt_ids) > 1:
            self.model.model(input_ids=torch.tensor([list(prompt_ids[:-1])]), past_key_values=self.cache, use_cache=True)
            self.committed_len = len(prompt_ids) - 1

    @torch.inference_mode()
    def score(self, tokens: Sequence[int]) -> TargetBlock:
        """Logits `[len(tokens), V]` (fp32) for the tokens appended after the committed prefix,
        plus the policy's target-side features for the `len(tokens) - 1` draft positions."""
        crop_cache(self.cache, self.committed_len)
        output = self.model.model(input_ids=torch.tensor([list(tokens)]), past_key_values=self.cache, use_cache=True)
        hidden = output.last_hidden_state[0]
        block = TargetBlock(logits=self.model.lm_head(hidden).float())
        if self.policy is not None:
            if self.policy.needs_hidden:
                block.hidden, block.lm_head = hidden, self.model.lm_head
            draft_tokens = torch.tensor(list(tokens[1:]), dtype=torch.long)
            block.features = self.policy.target_features(block, draft_tokens, self.sampling, self.features_rng)
        return block

    def commit(self, num_keep: int) -> None:
        """Keep the first `num_keep` scored tokens; the rest are rolled back on the next call."""
        self.committed_len += num_keep
        crop_cache(self.cache, self.committed_len)

    @torch.inference_mode()
    def full_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits of a fresh forward over `token_ids` (no cache): the rollback reference."""
        return self.model(input_ids=torch.tensor([list(token_ids)])).logits[0].float()
