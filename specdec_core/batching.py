"""One forward over many sequences: each row brings its own new tokens, KV history and positions
(a ragged batch, packed into one `[1, N]` sequence with no padding). Linears, norms and the LM
head see N rows; attention runs per row against that row's own cache (`SequenceKV`), so a row's
result does not depend on its batch companions (the CPU linears are batch invariant, see
docs/performance.md, and an int4 draft's rows pick their kernel by their own chunk). The
attention is registered with transformers (`use_ragged_attention`) and finds the rows in a
keyword argument the model passes down to it; without one it is the model's usual attention, so
the same model still serves plain forwards.

A row may also be a candidate tree (tree.py): its tokens are the tree's root and nodes, each at
position history + its depth, each seeing the history and its own ancestors only."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .kernels.attention import grouped_decode_attention, grouped_sdpa
from .kernels.int4 import kernels_by_chunk
from .tree import Topology

RAGGED_ATTENTION = "specdec_ragged"
DEFAULT_CAPACITY = 256


class SequenceKV:
    """One sequence's keys and values for every layer: buffers `[kv_heads, capacity, head_dim]`
    that double when full, of which the first `length` positions are the sequence's. Rollback
    lowers `length`; nothing is copied."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        """`capacity`: positions to allocate at the first write (a session's most, when known)."""
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.capacity = capacity
        self.length = 0

    @classmethod
    def for_request(cls, num_prompt: int, max_tokens: Optional[int]) -> "SequenceKV":
        """A request's cache, allocated at first for its prompt and the tokens it may emit, at most
        DEFAULT_CAPACITY of them (None: that many): past them it doubles as it goes, so a long or
        open-ended request holds the memory it uses, not its whole reach."""
        return cls(num_prompt + 1 + min(DEFAULT_CAPACITY if max_tokens is None else max_tokens, DEFAULT_CAPACITY))

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `[kv_heads, T, head_dim]` at positions length..length+T; return the layer's keys
        and values up to there (views). `advance` moves `length` once every layer wrote."""
        needed = self.length + keys.shape[1]
        held = self.buffers.get(layer)
        if held is None or needed > held[0].shape[1]:
            capacity = max(needed, 2 * held[0].shape[1] if held else self.capacity)
            held = tuple(self._grown(old, new, capacity) for old, new in zip(held or (None, None), (keys, values)))
            self.buffers[layer] = held
        for buffer, new in zip(held, (keys, values)):
            buffer[:, self.length : needed] = new
        return held[0][:, :needed], held[1][:, :needed]

    def _grown(self, old: Optional[torch.Tensor], new: torch.Tensor, capacity: int) -> torch.Tensor:
        buffer = new.new_empty((new.shape[0], capacity, new.shape[2]))
        if old is not None and self.length:
            buffer[:, : self.length] = old[:, : self.length]
        return buffer

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def crop(self, keep: int) -> None:
        self.length = min(self.length, keep)

    @torch.inference_mode()  # the buffers were made in the forwards' inference mode
    def keep_at(self, start: int, positions: Sequence[int]) -> None:
        """Keep the entries at `positions` (ascending, >= start), moved to start, start + 1, ..;
        the sequence ends after them (a tree's accepted path into place)."""
        moved = torch.as_tensor(positions, dtype=torch.long)
        for keys, values in self.buffers.values():
            for buffer in (keys, values):
                buffer[:, start : start + len(positions)] = buffer[:, moved]
        self.length = start + len(positions)


@dataclass
class RaggedRows:
    """The rows of one forward: row i's tokens are packed positions offsets[i]..offsets[i+1]."""

    caches: Sequence[SequenceKV]
    offsets: list[int]
    trees: Sequence[Optional[Topology]]  # a row's tree, or None for a chain of tokens


def forward_ragged(
    model: torch.nn.Module,
    caches: Sequence[SequenceKV],
    token_lists: Sequence[Sequence[int]],
    trees: Optional[Sequence[Optional[Topology]]] = None,
):
    """Run each row's new tokens after its cached ones in one forward; returns the final hidden
    states `[1, N, H]` of the packed rows (row i at positions offsets[i]..) and the offsets.
    `trees`: per row, the topology its tokens (root, then nodes) form, or None for a chain."""
    input_ids = torch.tensor([[token for tokens in token_lists for token in tokens]], dtype=torch.long)
    lengths = [len(tokens) for tokens in token_lists]
    use_ragged_attention(model)
    with kernels_by_chunk(lengths):
        return run_ragged(model.model, caches, lengths, trees, input_ids=input_ids.to(model.device))


def run_ragged(
    base_model: torch.nn.Module,
    caches: Sequence[SequenceKV],
    lengths: Sequence[int],
    trees: Optional[Sequence[Optional[Topology]]] = None,
    **inputs: torch.Tensor,
):
    """`forward_ragged` for a base model (layers, no LM head; its attention the ragged one) over
    rows of `lengths` new positions, given as its `input_ids` or `inputs_embeds` `[1, N, ..]`."""
    trees = trees or [None] * len(caches)
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    positions = torch.cat(
        [
            cache.length + (tree.depths if tree is not None else torch.arange(length))
            for cache, length, tree in zip(caches, lengths, trees)
        ]
    )
    with attention_backends(base_model.device):
        output = base_model(
            **inputs,
            position_ids=positions[None].to(base_model.device),
            use_cache=False,
            ragged=RaggedRows(caches, offsets, trees),
        )
    for cache, length in zip(caches, lengths):
        cache.advance(length)
    return output.last_hidden_state, offsets


def attention_backends(device: torch.device):
    """The SDPA kernels a forward may use. Not cuDNN's on CUDA: it builds a plan for every new
    sequence length, about 2.3 ms of host time per call on an H100, and a row's length grows
    every step (docs/performance.md, gpu-report 2026-11-25)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(backends)


def ragged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, ragged=None, **kwargs):
    """Attention of each row's queries over its own cache (written here first). `query`,
    `key`, `value`: `[1, heads, N, head_dim]` of the packed rows; returns `[1, N, heads, head_dim]`.
    Without `ragged` rows: the model's usual attention (`grouped_sdpa`)."""
    if ragged is None:
        return grouped_sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    outputs = []
    for cache, start, end, tree in zip(ragged.caches, ragged.offsets, ragged.offsets[1:], ragged.trees):
        history = cache.length
        keys, values = cache.write(module.layer_idx, key[0, :, start:end], value[0, :, start:end])
        row_query = query[:, :, start:end]
        num_new = end - start
        if num_new == 1 and row_query.dtype in (torch.bfloat16, torch.float16) and row_query.device.type == "cpu":
            outputs.append(grouped_decode_attention(row_query, keys[None], values[None], None, scaling))
            continue
        # query t sees the history and new tokens 0..t (a causal mask shifted by the history), or in
        # a tree the history and its own ancestors
        mask = None
        if tree is not None:
            mask = torch.ones(num_new, history + num_new, dtype=torch.bool, device=query.device)
            mask[:, history:] = tree.attention_mask.to(query.device)
        elif num_new > 1:
            mask = torch.ones(num_new, history + num_new, dtype=torch.bool, device=query.device).tril(history)
        if mask is not None and query.device.type == "cuda":
            # CUDA's efficient kernel takes a mask but not grouped K/V heads: without this the math
            # one runs, 302 against 64 us a call on an H100 (docs/performance.md)
            groups = row_query.shape[1] // keys.shape[0]
            keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
        row_output = torch.nn.functional.scaled_dot_product_attention(
            row_query, keys[None], values[None], attn_mask=mask, scale=scaling, enable_gqa=True
        )
        outputs.append(row_output.transpose(1, 2))
    return torch.cat(outputs, dim=1), None


def use_ragged_attention(model: torch.nn.Module) -> None:
    """Give `model` the ragged attention (once; it keeps plain forwards working)."""
    if model.config._attn_implementation == RAGGED_ATTENTION:  # every forward asks: answer first
        return
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
    AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)
    model.set_attn_implementation(RAGGED_ATTENTION)
