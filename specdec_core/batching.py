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
# a compiled step's sizes round up to powers of two below this, to multiples of it above
PAD_STEP = 1024


@dataclass
class RowGroup:
    """Rows that attend in one call: keys padded to the longest of them, queries to the most."""

    read: "torch.Tensor | slice"  # [B, L] each row's slots, padded; or a lone row's consecutive slots
    query_index: Optional[torch.Tensor]  # [B, Q] the packed index of row b's t-th token (None: one row)
    mask: Optional[torch.Tensor]  # [B, 1, Q, L] bool, True attends (None: every key, one token a row)


@dataclass
class StepLayout:
    """Where one forward's rows write and read in the pool, built once for all its layers: one
    attention call per group, at most two (short rows, long rows)."""

    pool: KVPool
    write_slots: torch.Tensor  # [N] the slot of each new token
    groups: list[RowGroup]
    # [N] where each packed token's output lies among the groups' outputs, [B * Q] each, in order
    # (None: one row, whose outputs are its tokens in order)
    output_index: Optional[torch.Tensor]


def padded_size(size: int) -> int:
    """What a compiled step pads a size to (its tokens, a group's rows, queries and keys): a power
    of two up to PAD_STEP, then a multiple of it, each at most twice the work below PAD_STEP and
    PAD_STEP - 1 more above. A CUDA graph is recorded per combination of the sizes' buckets: a
    bounded set, which grows by one bucket of keys per PAD_STEP tokens of context."""
    if size <= PAD_STEP:
        return 1 << max(size - 1, 0).bit_length()
    return blocks_for(size, PAD_STEP) * PAD_STEP


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
    position costs in all layers of this rank; the pool's scratch block is one more)."""
    num_blocks = int(budget_bytes // (bytes_per_token * BLOCK_SIZE))
    model.model.kv_pool = KVPool(len(model.model.layers), num_blocks=num_blocks, growable=False)
    return model.model.kv_pool


def step_layout(
    pool: KVPool,
    caches: Sequence[PagedKV],
    lengths: Sequence[int],
    trees: Sequence[Optional[Topology]],
    device,
    padded: bool = False,
) -> StepLayout:
    """Reserve each row's blocks for its new tokens and lay out the step (host-side, a few ops
    per forward, not per layer). A lone row whose blocks are consecutive reads them as a slice.
    `padded` (a compiled step): every size rounds up to `padded_size`, so that a step's tensors
    take a bounded set of shapes; the padding tokens write to the pool's scratch block, padding rows and
    queries see key 0 only, and no view (a slice's bounds would be a new graph every step)."""
    for cache, length in zip(caches, lengths):
        cache.reserve(pool, cache.length + length)
    history = torch.tensor([cache.length for cache in caches])  # [B]
    new = torch.tensor(list(lengths))  # [B]
    total, size = history + new, pool.block_size
    pad = padded_size if padded else int
    num_tokens, width = int(new.sum()), pad(int(total.max()))
    num_blocks = blocks_for(width, size)
    # [B, blocks]; a shorter row's padding names block 0, whose slots its mask hides
    tables = torch.tensor([cache.table[:num_blocks] + [0] * (num_blocks - len(cache.table)) for cache in caches])
    keys = torch.arange(width)  # [L]
    read_slots = tables[:, keys // size] * size + keys % size  # [B, L]; past a row's end: some slot, masked
    queries = torch.arange(int(new.max()))  # [Q]
    real = queries[None] < new[:, None]  # [B, Q]
    write_slots = read_slots.gather(1, (history[:, None] + queries[None]).clamp(max=width - 1))[real]  # [N]
    scratch = pool.scratch_slot + torch.arange(pad(num_tokens) - num_tokens) % size  # [padding]
    offsets = torch.cumsum(new, 0) - new  # [B]
    long = new > LONG_ROW
    parts = [members for members in (torch.nonzero(~long)[:, 0], torch.nonzero(long)[:, 0]) if members.numel()]
    if len(caches) == 1 and not padded:
        table = caches[0].table
        if all(block == table[0] + index for index, block in enumerate(table[:num_blocks])):
            read_slots = slice(table[0] * size, table[0] * size + int(total[0]))  # a view, not a gather
        group, _, _ = row_group(torch.tensor([0]), history, new, offsets, read_slots, trees, pad, device)
        return StepLayout(pool, write_slots.to(device), [RowGroup(group.read, None, group.mask)], None)
    groups, output_index, start = [], torch.zeros(pad(num_tokens), dtype=torch.long), 0  # [N]
    for members in parts:
        group, tokens, places = row_group(members, history, new, offsets, read_slots, trees, pad, device)
        output_index[tokens] = start + places  # where each token's output lies among the groups'
        groups.append(RowGroup(group.read, group.query_index.to(device), group.mask))
        start += group.query_index.numel()
    write_slots = torch.cat([write_slots, scratch])
    return StepLayout(pool, write_slots.to(device), groups, output_index.to(device))


def row_group(members, history, new, offsets, read_slots, trees, pad, device):
    """The rows `members` (indices `[B_g]` into the step's `[B]` rows) as one attention call,
    `pad`ded to `pad(B_g)` rows of `pad(Q_g)` queries over `pad(L_g)` keys (a padding row has no
    history and no new token). Returns the group (its `query_index` still on the host) and, for
    each of its N_g tokens, its packed index and its place among the group's `[B_g * Q_g]`
    outputs (`[N_g]` each)."""
    num_tokens = int(new.sum())
    history, new, offsets = history[members], new[members], offsets[members]  # [B_g]
    total = history + new
    rows = pad(len(members))
    history, new, offsets = (torch.cat([part, part.new_zeros(rows - len(members))]) for part in (history, new, offsets))
    keys, queries = torch.arange(pad(int(total.max()))), torch.arange(pad(int(new.max())))  # [L], [Q]
    real = queries[None] < new[:, None]  # [B_g, Q]
    packed = offsets[:, None] + queries[None]  # [B_g, Q]; a padded query names some token, masked
    places = torch.arange(rows * queries.numel()).view(rows, -1)  # [B_g, Q]
    read = read_slots
    if not isinstance(read_slots, slice):
        read = read_slots[members, : keys.numel()]
        read = torch.cat([read, read.new_zeros(rows - len(members), keys.numel())]).to(device)
    mask = None
    row_trees = [trees[row] for row in members.tolist()]
    padded = pad is not int
    if padded or queries.numel() > 1 or any(tree is not None for tree in row_trees) or total.unique().numel() > 1:
        # query t of row b sees the history and new tokens 0..t (a causal mask shifted by the
        # history), or in a tree the history and its own ancestors; a padded query sees key 0
        mask = keys[None, None] <= (history[:, None, None] + queries[None, :, None])  # [B_g, Q, L]
        for index, tree in enumerate(row_trees):
            if tree is not None:
                start, width = int(history[index]), tree.num_nodes + 1
                mask[index, :width, start : start + width] = tree.attention_mask
        mask = torch.where(real[:, :, None], mask, keys[None, None] == 0)[:, None].to(device)  # [B_g, 1, Q, L]
    return RowGroup(read, packed.clamp(max=num_tokens - 1), mask), packed[real], places[real]


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
    padded = getattr(base_model, "padded_step", False)
    pool = pool_of(base_model)
    layout = step_layout(pool, caches, lengths, trees, base_model.device, padded=padded)
    padding = layout.write_slots.numel() - offsets[-1]
    inputs = {name: pad_tokens(tensor, padding) for name, tensor in inputs.items()}
    # a pool's storage is allocated by its first forward: that one runs eagerly, outside any
    # CUDA graph, and later ones find it in place (a static address)
    first = padded and pool.keys is None
    with attention_backends(base_model.device), torch.compiler.set_stance("force_eager" if first else "default"):
        output = base_model(
            **inputs,
            position_ids=pad_tokens(positions[None], padding).to(base_model.device),
            use_cache=False,
            ragged=layout,
        )
    for cache, length in zip(caches, lengths):
        cache.advance(length)
    hidden = output.last_hidden_state[:, : offsets[-1]]
    # a CUDA graph's output is overwritten by its next replay, and a scorer keeps its rows
    return (hidden.clone() if padded else hidden), offsets


def pad_tokens(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """`tensor` `[1, N, ..]` followed by `count` zero tokens (a padded step's; position 0, id 0)."""
    if not count:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(tensor.shape[0], count, *tensor.shape[2:])], 1)


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
    outputs = [attend(group, query, pool_keys, pool_values, scaling).flatten(0, 1) for group in ragged.groups]
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [sum of B * Q, heads, head_dim]
    return (output if ragged.output_index is None else output[ragged.output_index])[None], None


def attend(group: RowGroup, query, pool_keys, pool_values, scaling) -> torch.Tensor:
    """One group's attention: `[B, Q, heads, head_dim]`."""
    if isinstance(group.read, slice):
        keys, values = pool_keys[group.read][None], pool_values[group.read][None]  # [1, L, kv_heads, head_dim]
    else:
        keys, values = pool_keys[group.read], pool_values[group.read]  # [B, L, kv_heads, head_dim]
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, kv_heads, L, head_dim]
    queries = query if group.query_index is None else query[0].transpose(0, 1)[group.query_index].transpose(1, 2)
    if queries.dtype in (torch.bfloat16, torch.float16) and queries.device.type == "cpu":
        return grouped_low_precision_attention(queries, keys, values, group.mask, scaling)  # [B, Q, heads, head_dim]
    if group.mask is not None and queries.device.type == "cuda":
        # CUDA's efficient kernel takes a mask but not grouped K/V heads: without this the math
        # one runs, 302 against 64 us a call on an H100 (docs/performance.md)
        groups = queries.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    return torch.nn.functional.scaled_dot_product_attention(
        queries, keys, values, attn_mask=group.mask, scale=scaling, enable_gqa=True
    ).transpose(1, 2)  # [B, Q, heads, head_dim]


def use_ragged_attention(model: torch.nn.Module) -> None:
    """Give `model` the ragged attention (once; it keeps plain forwards working)."""
    if model.config._attn_implementation == RAGGED_ATTENTION:  # every forward asks: answer first
        return
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
    AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)
    model.set_attn_implementation(RAGGED_ATTENTION)
