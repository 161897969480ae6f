"""The KV cache of targets and draft models: a transformers DynamicCache whose layers write each
token once, with rollback by crop."""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


def make_cache(model: torch.nn.Module) -> DynamicCache:
    """A DynamicCache whose full-attention layers are `GrowableLayer`s."""
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowableLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class GrowableLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views into buffers that double when full, so
    each token's K/V is written once. DynamicLayer's `torch.cat` re-copies the layer's whole
    cache on every forward (for SmolLM2 at 1,000 tokens, 46 MB per forward). Crop stays the
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


def crop_cache(cache: DynamicCache, keep: int) -> None:
    """Drop cached positions beyond `keep` (negative crop works in transformers 4.x and 5.x)."""
    surplus = cache.get_seq_length() - keep
    if surplus > 0:
        cache.crop(-surplus)
