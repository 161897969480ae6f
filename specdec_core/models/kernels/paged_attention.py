"""Attention that reads the KV pool through the block tables itself (vLLM's unified attention, in
Triton): no gather of the histories, no padding to the longest row, no host synchronization, so
a CUDA graph can hold it. It splits each row's keys across programs (flash-decoding) and a second
kernel merges the splits, so that one query over a long history still keeps the device busy,
where PyTorch's memory-efficient kernel gives a K/V head one block (docs/performance.md,
"Where a step's time goes").

Rows are ragged: row b's `q_b` new tokens (a verify block of K + 1, a tree, one token) come after
its `h_b` cached ones, its keys are its `h_b + q_b` positions (`seq_lens`), and its new tokens'
entries are already in the pool. A new token sees the whole history and, among the row's new
tokens, those `new_mask` allows (a causal block: the earlier ones and itself; a tree: its
ancestors and itself). Tested under Triton's interpreter on the CPU (`TRITON_INTERPRET=1`)
against SDPA, and on CUDA in tests/core/test_gpu.py.

Vocabulary: N new tokens in all, H query heads, H_kv K/V heads (G = H / H_kv a group), D the
head size, B rows, S splits of a row's keys, BLOCK the pool's positions a block."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...runtime.kv_pool import BLOCK_SIZE


@triton.jit
def split_attention_kernel(
    query,  # [N, H, D]
    keys,  # [slots, H_kv, D] one layer's pool
    values,  # [slots, H_kv, D]
    block_tables,  # [B, max_blocks] int32
    seq_lens,  # [B] int32: each row's keys (history and new tokens)
    query_start,  # [B + 1] int32: where each row's new tokens start among the N
    token_row,  # [N] int32: the row of each new token
    new_mask,  # [N, max_new] int8: which of its row's new tokens each sees
    partial_out,  # [N, H, S, D] fp32: each split's output, not normalized
    partial_max,  # [N, H, S] fp32: each split's largest score
    partial_sum,  # [N, H, S] fp32: each split's softmax denominator at that max
    scale,
    max_blocks,
    max_new,
    num_splits,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # G rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(token_row + token)
    seq_len = tl.load(seq_lens + row)
    first_new = tl.load(query_start + row)
    history = seq_len - (tl.load(query_start + row + 1) - first_new)
    groups = tl.arange(0, GROUP)  # [G]
    heads = kv_head * (HEADS // KV_HEADS) + groups
    real_head = groups < HEADS // KV_HEADS
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(query + (token * HEADS + heads)[:, None] * HEAD_DIM + dims[None, :], mask=real_head[:, None], other=0.0)
    q = q.to(tl.float32) * scale  # [G, D]
    num_tiles = tl.cdiv(seq_len, BLOCK)
    per_split = tl.cdiv(num_tiles, num_splits)
    largest = tl.full([GROUP], float("-inf"), tl.float32)  # [G] the scores' running max
    total = tl.zeros([GROUP], tl.float32)  # [G] the softmax's running denominator at that max
    acc = tl.zeros([GROUP, HEAD_DIM], tl.float32)  # [G, D] the weighted values, not normalized
    offsets = tl.arange(0, BLOCK)
    tile = split * per_split
    last = tl.minimum((split + 1) * per_split, num_tiles)
    while tile < last:  # not `range`: Triton's interpreter takes no loaded bound there
        block = tl.load(block_tables + row * max_blocks + tile)
        positions = tile * BLOCK + offsets  # [BLOCK] the row's key positions in this tile
        slots = block.to(tl.int64) * BLOCK + offsets  # int64: a large pool's offsets pass 2**31
        new = positions - history  # >= 0: one of the row's new tokens
        seen = tl.load(new_mask + token * max_new + new, mask=(new >= 0) & (positions < seq_len), other=0)
        visible = (positions < seq_len) & ((new < 0) | (seen != 0))  # [BLOCK]
        k = tl.load(keys + (slots * KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :])  # [BLOCK, D]
        v = tl.load(values + (slots * KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :])  # [BLOCK, D]
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [G, BLOCK]
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_largest = tl.maximum(largest, tl.max(scores, axis=1))
        # a tile with nothing visible yet keeps -inf: its rescale must not be nan
        safe = tl.where(new_largest == float("-inf"), 0.0, new_largest)
        weights = tl.exp(scores - safe[:, None])  # [G, BLOCK]
        rescale = tl.exp(largest - safe)
        total = total * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        largest = new_largest
        tile += 1
    part = (token * HEADS + heads) * num_splits + split  # [G]
    tl.store(partial_max + part, largest, mask=real_head)
    tl.store(partial_sum + part, total, mask=real_head)
    tl.store(partial_out + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=real_head[:, None])


@triton.jit
def merge_splits_kernel(
    partial_out,  # [N, H, S, D]
    partial_max,  # [N, H, S]
    partial_sum,  # [N, H, S]
    output,  # [N, H, D] in the query's dtype
    num_splits,
    SPLITS: tl.constexpr,  # S rounded up to a power of two
    HEAD_DIM: tl.constexpr,
):
    token_head = tl.program_id(0)  # token * H + head
    splits = tl.arange(0, SPLITS)
    real = splits < num_splits
    largest = tl.load(partial_max + token_head * num_splits + splits, mask=real, other=float("-inf"))
    top = tl.max(largest, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key: no -inf - -inf
    weights = tl.where(real & (largest > float("-inf")), tl.exp(largest - top), 0.0)  # [S]
    total = tl.sum(weights * tl.load(partial_sum + token_head * num_splits + splits, mask=real, other=0.0), axis=0)
    dims = tl.arange(0, HEAD_DIM)
    parts = tl.load(
        partial_out + (token_head * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=real[:, None],
        other=0.0,
    )  # [S, D]
    # a token that sees no key (a padding token of a graphed step) comes out 0, not nan
    merged = tl.sum(weights[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)  # [D]
    tl.store(output + token_head * HEAD_DIM + dims, merged.to(output.dtype.element_ty))


# programs that keep a device of ~130 multiprocessors busy; each split at least one block of keys
BUSY_PROGRAMS, MOST_SPLITS = 512, 16


def splits_for(num_tokens: int, kv_heads: int, max_blocks: int) -> int:
    """How many ways to split a row's keys: enough programs to fill the device when the tokens
    are few (a draft's one token over a long history), none when they are many (each split's
    partial output costs a write and a read). Static for a graphed step's shapes."""
    wanted = -(-BUSY_PROGRAMS // (num_tokens * kv_heads))
    return max(1, min(wanted, MOST_SPLITS, max_blocks))


def paged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    token_row: torch.Tensor,
    new_mask: torch.Tensor,
    scale: Optional[float] = None,
    num_splits: Optional[int] = None,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """Each new token's attention over its row's keys in the pool: `query` `[N, H, D]`, one layer's
    `keys`, `values` `[slots, H_kv, D]` (slot = block * BLOCK + offset), `block_tables` `[B,
    max_blocks]`, `seq_lens` `[B]`, `query_start` `[B + 1]`, `token_row` `[N]` (int32 each),
    `new_mask` `[N, max_new]` (a token's view of its row's new tokens); returns `[N, H, D]` in
    the query's dtype. Every size is a tensor's: nothing is read back to the host.
    `num_splits`: None, `splits_for` the shapes."""
    query = query.contiguous()  # the kernels index [N, H, D] densely, the output too
    num_tokens, heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    num_splits = num_splits or splits_for(num_tokens, kv_heads, block_tables.shape[1])
    partial_out = torch.empty(num_tokens, heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    partial_max = torch.empty(num_tokens, heads, num_splits, dtype=torch.float32, device=query.device)
    partial_sum = torch.empty_like(partial_max)
    split_attention_kernel[(num_tokens, kv_heads, num_splits)](
        query,
        keys,
        values,
        block_tables,
        seq_lens,
        query_start,
        token_row,
        new_mask,
        partial_out,
        partial_max,
        partial_sum,
        head_dim**-0.5 if scale is None else scale,
        block_tables.shape[1],
        new_mask.shape[1],
        num_splits,
        HEADS=heads,
        KV_HEADS=kv_heads,
        GROUP=triton.next_power_of_2(heads // kv_heads),
        HEAD_DIM=head_dim,
        BLOCK=block_size,
    )
    output = torch.empty(num_tokens, heads, head_dim, dtype=query.dtype, device=query.device)
    merge_splits_kernel[(num_tokens * heads,)](
        partial_out,
        partial_max,
        partial_sum,
        output,
        num_splits,
        SPLITS=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
    )
    return output
