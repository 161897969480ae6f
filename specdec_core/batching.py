"""One forward over many sequences: each row brings its own new tokens, KV history and positions
(a ragged batch, packed into one `[1, N]` sequence with no padding). Linears, norms and the LM
head see N rows; attention runs over the model's KV pool (kv_pool.py) in at most two calls per
layer, whatever the number of rows: one for the short rows (verify blocks, trees, single
tokens) and one for the long ones (prompt chunks), so that no short row is padded to a chunk's
length. The step's new entries go into the pool with one write; a group's rows' histories come
back padded to its longest, `[B, L]`, with one gather (a view for a lone row whose blocks are
consecutive), and a mask built once per forward says what each query sees. A padded key is
masked, so it adds an exact zero: a row's result does not depend on its batch companions beyond
the kernels' own blocking (the CPU linears are batch invariant, see docs/performance.md). The
attention is registered with transformers (`use_ragged_attention`) and finds the step in a
keyword argument the model passes down to it; without one it is the model's usual attention, so
the same model still serves plain forwards.

A row may also be a candidate tree (tree.py): its tokens are the tree's root and nodes, each at
position history + its depth, each seeing the history and its own ancestors only.

Vocabulary: B rows, N new tokens in all (row b has T_b of them after H_b cached ones), Q the
most new tokens of a row, L the longest row (H_b + T_b)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .kernels.attention import grouped_low_precision_attention, grouped_sdpa
from .kernels.int4 import kernels_by_chunk
from .kv_pool import BLOCK_SIZE, KVPool, PagedKV, blocks_for
from .tree import Topology

RAGGED_ATTENTION = "specdec_ragged"


# rows with more new tokens than this (prompt chunks) attend in a call of their own: padded to a
# 512-token chunk's queries, a 5-token verify row's attention would cost 100 times its own
LONG_ROW = 64


@dataclass
class RowGroup:
    """Rows that attend in one call: keys padded to the longest of them, queries to the most."""

    read: "torch.Tensor | slice"  # [B, L] each row's slots, padded; or a lone row's consecutive slots
    query_index: Optional[torch.Tensor]  # [B, Q] the packed index of row b's t-th token (None: one row)
    output_index: Optional[torch.Tensor]  # [N_g] where each of its tokens lies in [B * Q] (None: one row)
    tokens: Optional[torch.Tensor]  # [N_g] its tokens' packed indices (None: the step's only group)
    mask: Optional[torch.Tensor]  # [B, 1, Q, L] bool, True attends (None: every key, one token a row)


@dataclass
class StepLayout:
    """Where one forward's rows write and read in the pool, built once for all its layers: one
    attention call per group, at most two (short rows, long rows)."""

    pool: KVPool
    write_slots: torch.Tensor  # [N] the slot of each new token
    groups: list[RowGroup]


def pool_of(base_model: torch.nn.Module) -> KVPool:
    """The model's KV pool, made at its first ragged forward (one per model and process) unless
    `fix_pool` sized it."""
    pool = getattr(base_model, "kv_pool", None)
    if pool is None:
        pool = base_model.kv_pool = KVPool(num_layers=len(base_model.layers))
    return pool


def fix_pool(model: torch.nn.Module, budget_bytes: float, bytes_per_token: float) -> KVPool:
    """Give `model` a pool of `budget_bytes`, allocated once and never grown: a worker's KV
    budget, within which its admission keeps every session's blocks (`bytes_per_token`: what a
    position costs in all layers of this rank)."""
    num_blocks = int(budget_bytes // (bytes_per_token * BLOCK_SIZE))
    model.model.kv_pool = KVPool(len(model.model.layers), num_blocks=num_blocks, growable=False)
    return model.model.kv_pool


def step_layout(
    pool: KVPool,
    caches: Sequence[PagedKV],
    lengths: Sequence[int],
    trees: Sequence[Optional[Topology]],
    device,
    views: bool = True,
) -> StepLayout:
    """Reserve each row's blocks for its new tokens and lay out the step (host-side, a few ops
    per forward, not per layer). `views`: a lone row whose blocks are consecutive reads them as a
    slice (not for a compiled step: its bounds would be constants, a new graph every step)."""
    for cache, length in zip(caches, lengths):
        cache.reserve(pool, cache.length + length)
    history = torch.tensor([cache.length for cache in caches])  # [B]
    new = torch.tensor(list(lengths))  # [B]
    total, size = history + new, pool.block_size
    num_blocks = blocks_for(int(total.max()), size)
    # [B, blocks]; a shorter row's padding names block 0, whose slots its mask hides
    tables = torch.tensor([cache.table[:num_blocks] + [0] * (num_blocks - len(cache.table)) for cache in caches])
    keys = torch.arange(int(total.max()))  # [L]
    read_slots = tables[:, keys // size] * size + keys % size  # [B, L]; past a row's end: some slot, masked
    queries = torch.arange(int(new.max()))  # [Q]
    real = queries[None] < new[:, None]  # [B, Q]
    write_slots = read_slots.gather(1, (history[:, None] + queries[None]).clamp(max=keys.numel() - 1))[real]  # [N]
    offsets = torch.cumsum(new, 0) - new  # [B]
    long = new > LONG_ROW
    parts = [members for members in (torch.nonzero(~long)[:, 0], torch.nonzero(long)[:, 0]) if members.numel()]
    if len(caches) == 1 and views:
        table = caches[0].table
        if all(block == table[0] + index for index, block in enumerate(table[:num_blocks])):
            read_slots = slice(table[0] * size, table[0] * size + int(total[0]))  # a view, not a gather
    groups = [
        row_group(members, history, new, offsets, read_slots, trees, len(parts) == 1, device) for members in parts
    ]
    return StepLayout(pool, write_slots.to(device), groups)


def row_group(members, history, new, offsets, read_slots, trees, only, device) -> RowGroup:
    """The rows `members` (indices `[B_g]` into the step's `[B]` rows) as one attention call;
    `only`: the step has no other group (its output is the packed one, in order)."""
    num_tokens = int(new.sum())
    history, new, offsets = history[members], new[members], offsets[members]  # [B_g]
    total = history + new
    keys, queries = torch.arange(int(total.max())), torch.arange(int(new.max()))  # [L], [Q]
    real = queries[None] < new[:, None]  # [B_g, Q]
    read, query_index, output_index, tokens = read_slots, None, None, None
    if not isinstance(read_slots, slice):  # else the step is one row, read as a view
        read = read_slots[members, : keys.numel()].to(device)
        packed = offsets[:, None] + queries[None]  # [B_g, Q]
        query_index = packed.clamp(max=num_tokens - 1).to(device)
        output_index = (torch.arange(len(members))[:, None] * queries.numel() + queries[None])[real].to(device)
        tokens = None if only else packed[real].to(device)
    mask = None
    row_trees = [trees[row] for row in members.tolist()]
    if queries.numel() > 1 or any(tree is not None for tree in row_trees) or total.unique().numel() > 1:
        # query t of row b sees the history and new tokens 0..t (a causal mask shifted by the
        # history), or in a tree the history and its own ancestors; a padded query sees key 0
        mask = keys[None, None] <= (history[:, None, None] + queries[None, :, None])  # [B_g, Q, L]
        for index, tree in enumerate(row_trees):
            if tree is not None:
                start, width = int(history[index]), tree.num_nodes + 1
                mask[index, :width, start : start + width] = tree.attention_mask
        mask = torch.where(real[:, :, None], mask, keys[None, None] == 0)[:, None].to(device)  # [B_g, 1, Q, L]
    return RowGroup(read, query_index, output_index, tokens, mask)


def forward_ragged(
    model: torch.nn.Module,
    caches: Sequence[PagedKV],
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
    caches: Sequence[PagedKV],
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
    # a chain's tokens follow its history; a tree's root and nodes sit at history + their depth
    positions = torch.tensor(
        [
            cache.length + offset
            for cache, length, tree in zip(caches, lengths, trees)
            for offset in (range(length) if tree is None else (0, *map(len, tree.paths)))
        ]
    )
    compiled = getattr(base_model, "compiled_step", False)
    layout = step_layout(pool_of(base_model), caches, lengths, trees, base_model.device, views=not compiled)
    with attention_backends(base_model.device):
        output = base_model(
            **inputs, position_ids=positions[None].to(base_model.device), use_cache=False, ragged=layout
        )
    for cache, length in zip(caches, lengths):
        cache.advance(length)
    return output.last_hidden_state, offsets


def compile_step(model: torch.nn.Module, backend: str = "inductor") -> None:
    """Compile `model`'s base forward (every layer and the ragged attention: no graph break,
    `specdec compile-check`). A step's shapes (rows, tokens, history) change every call, so after
    the first recompile its sizes are symbolic; what stays a guard is the layout's kind (one or
    two row groups, a mask or none, one row or many): a few graphs in all."""
    use_ragged_attention(model)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    model.model.forward = torch.compile(model.model.forward, backend=backend)
    model.model.compiled_step = True


def attention_backends(device: torch.device):
    """The SDPA kernels a forward may use. Not cuDNN's on CUDA: it builds a plan for every new
    sequence length, about 2.3 ms of host time per call on an H100, and a row's length grows
    every step (docs/performance.md)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(backends)


def ragged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, ragged=None, **kwargs):
    """Every row's queries over its own history, one call per group of rows: `query`, `key`,
    `value` are `[1, heads, N, head_dim]` of the packed rows; returns `[1, N, heads, head_dim]`.
    Without a `ragged` layout: the model's usual attention (`grouped_sdpa`)."""
    if ragged is None:
        return grouped_sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    pool_keys, pool_values = ragged.pool.storage(module.layer_idx, key)  # [slots, kv_heads, head_dim] each
    pool_keys.index_copy_(0, ragged.write_slots, key[0].transpose(0, 1))
    pool_values.index_copy_(0, ragged.write_slots, value[0].transpose(0, 1))
    if len(ragged.groups) == 1:
        return attend(ragged.groups[0], query, pool_keys, pool_values, scaling), None
    output = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [N, heads, head_dim]
    for group in ragged.groups:
        output[group.tokens] = attend(group, query, pool_keys, pool_values, scaling)[0]
    return output[None], None


def attend(group: RowGroup, query, pool_keys, pool_values, scaling) -> torch.Tensor:
    """One group's attention: `[1, N_g, heads, head_dim]` (its tokens in packed order)."""
    if isinstance(group.read, slice):
        keys, values = pool_keys[group.read][None], pool_values[group.read][None]  # [1, L, kv_heads, head_dim]
    else:
        keys, values = pool_keys[group.read], pool_values[group.read]  # [B, L, kv_heads, head_dim]
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, kv_heads, L, head_dim]
    queries = query if group.query_index is None else query[0].transpose(0, 1)[group.query_index].transpose(1, 2)
    if queries.dtype in (torch.bfloat16, torch.float16) and queries.device.type == "cpu":
        output = grouped_low_precision_attention(queries, keys, values, group.mask, scaling)  # [B, Q, heads, head_dim]
    else:
        if group.mask is not None and queries.device.type == "cuda":
            # CUDA's efficient kernel takes a mask but not grouped K/V heads: without this the math
            # one runs, 302 against 64 us a call on an H100 (docs/performance.md)
            groups = queries.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        output = torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=group.mask, scale=scaling, enable_gqa=True
        ).transpose(1, 2)  # [B, Q, heads, head_dim]
    if group.output_index is None:
        return output
    return output.reshape(-1, *output.shape[2:])[group.output_index][None]


def use_ragged_attention(model: torch.nn.Module) -> None:
    """Give `model` the ragged attention (once; it keeps plain forwards working)."""
    if model.config._attn_implementation == RAGGED_ATTENTION:  # every forward asks: answer first
        return
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
    AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)
    model.set_attn_implementation(RAGGED_ATTENTION)
