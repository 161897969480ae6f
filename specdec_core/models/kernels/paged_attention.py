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
def row_of_query_block(query_start, program, num_rows, BLOCK_Q: tl.constexpr):
    """The row whose query blocks include `program`: row b's first block is `query_start[b] //
    BLOCK_Q + b`, an upper bound of the blocks before it, so that every row's blocks fit without
    knowing the rows' lengths on the host (the last row with a first block <= program)."""
    low: tl.int32 = 0  # typed: a count of 1 comes in as a constant, and the loop reassigns it
    high: tl.int32 = num_rows
    while low < high:  # binary search over the rows' first blocks, which never decrease
        middle = (low + high) // 2
        if tl.load(query_start + middle) // BLOCK_Q + middle <= program:
            low = middle + 1
        else:
            high = middle
    return low - 1


@triton.jit
def split_attention_kernel(
    query,  # [N, H, D]
    keys,  # [slots, H_kv, D] one layer's pool
    values,  # [slots, H_kv, D]
    block_tables,  # [B, max_blocks] int32
    seq_lens,  # [B] int32: each row's keys (history and new tokens)
    query_start,  # [B + 1] int32: where each row's new tokens start among the N
    new_mask,  # [N, max_new] int8: which of its row's new tokens each sees
    partial_out,  # [N, H, S, D] fp32: each split's output, not normalized
    partial_max,  # [N, H, S] fp32: each split's largest score
    partial_sum,  # [N, H, S] fp32: each split's softmax denominator at that max
    scale,
    num_rows,
    max_blocks,
    max_new,
    num_splits,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # G rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,  # the pool's positions a block
    BLOCK_Q: tl.constexpr,  # a program's new tokens, all of one row
    TILE: tl.constexpr,  # keys a loop iteration reads
    PRECISION: tl.constexpr,  # the products': "ieee" for fp32 queries (not TF32's rounding)
):
    # One program: up to BLOCK_Q new tokens of one row, the G query heads of one K/V head, one
    # split of the row's keys. Its M = BLOCK_Q * G query rows (token t, head g at t * GROUP + g)
    # share each key tile it reads: the tile is read once for all of them, by matrix products.
    program, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = row_of_query_block(query_start, program, num_rows, BLOCK_Q)
    first_new = tl.load(query_start + row)
    row_tokens = tl.load(query_start + row + 1) - first_new
    first_token = (program - (first_new // BLOCK_Q + row)) * BLOCK_Q  # within the row
    if first_token >= row_tokens:  # a spare block of the upper bound: nothing to do
        return
    seq_len = tl.load(seq_lens + row)
    history = seq_len - row_tokens
    m = tl.arange(0, BLOCK_Q * GROUP)  # [M]
    within = first_token + m // GROUP  # [M] each query row's token, within its row
    group = m % GROUP
    real = (within < row_tokens) & (group < HEADS // KV_HEADS)  # [M]
    token = first_new + within  # [M] among the N
    head = kv_head * (HEADS // KV_HEADS) + group  # [M]
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(query + (token * HEADS + head)[:, None] * HEAD_DIM + dims[None, :], mask=real[:, None], other=0.0)
    largest = tl.full([BLOCK_Q * GROUP], float("-inf"), tl.float32)  # [M] the scores' running max
    total = tl.zeros([BLOCK_Q * GROUP], tl.float32)  # [M] the softmax's running denominator at that max
    acc = tl.zeros([BLOCK_Q * GROUP, HEAD_DIM], tl.float32)  # [M, D] the weighted values, not normalized
    offsets = tl.arange(0, TILE)
    num_tiles = tl.cdiv(seq_len, TILE)
    per_split = tl.cdiv(num_tiles, num_splits)
    tile = split * per_split
    last = tl.minimum((split + 1) * per_split, num_tiles)
    while tile < last:  # not `range`: Triton's interpreter takes no loaded bound there
        positions = tile * TILE + offsets  # [TILE] the row's key positions in this tile
        present = positions < seq_len
        block = tl.load(block_tables + row * max_blocks + positions // BLOCK, mask=present, other=0)
        slots = block.to(tl.int64) * BLOCK + positions % BLOCK  # int64: a large pool's offsets pass 2**31
        entries = (slots * KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]  # [TILE, D]
        k = tl.load(keys + entries, mask=present[:, None], other=0.0).to(q.dtype)
        v = tl.load(values + entries, mask=present[:, None], other=0.0).to(q.dtype)
        new = positions - history  # [TILE] >= 0: one of the row's new tokens
        seen = tl.load(
            new_mask + token[:, None] * max_new + new[None, :],
            mask=real[:, None] & (new >= 0)[None, :] & present[None, :],
            other=0,
        )  # [M, TILE]
        visible = present[None, :] & ((new < 0)[None, :] | (seen != 0))  # [M, TILE]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, TILE] fp32
        scores = tl.where(visible, scores, float("-inf"))
        new_largest = tl.maximum(largest, tl.max(scores, axis=1))
        # a tile with nothing visible yet keeps -inf: its rescale must not be nan
        safe = tl.where(new_largest == float("-inf"), 0.0, new_largest)
        weights = tl.exp(scores - safe[:, None])  # [M, TILE]
        rescale = tl.exp(largest - safe)
        total = total * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        largest = new_largest
        tile += 1
    part = (token * HEADS + head) * num_splits + split  # [M]
    tl.store(partial_max + part, largest, mask=real)
    tl.store(partial_sum + part, total, mask=real)
    tl.store(partial_out + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=real[:, None])


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


# programs that keep a device of ~130 multiprocessors busy; each split at least one tile of keys
BUSY_PROGRAMS, MOST_SPLITS = 512, 16
# keys an iteration reads: a matrix product's width (at least 16); any multiple of the pool's blocks
KEY_TILE = 32


def tokens_a_program(widest_row: int, group: int) -> int:
    """BLOCK_Q: a row's new tokens one program takes, so that its query rows (tokens times the
    group's heads) are at least the 16 a matrix product needs and at most 64 (registers)."""
    return max(16 // group, min(triton.next_power_of_2(widest_row), max(1, 64 // group)))


def splits_for(query_blocks: int, kv_heads: int, max_tiles: int) -> int:
    """How many ways to split a row's keys: enough programs to fill the device when the query
    blocks are few (a draft's one token over a long history), none when they are many (each
    split's partial output costs a write and a read). Static for a graphed step's shapes."""
    wanted = -(-BUSY_PROGRAMS // (query_blocks * kv_heads))
    return max(1, min(wanted, MOST_SPLITS, max_tiles))


def paged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    new_mask: torch.Tensor,
    scale: Optional[float] = None,
    num_splits: Optional[int] = None,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """Each new token's attention over its row's keys in the pool: `query` `[N, H, D]`, one layer's
    `keys`, `values` `[slots, H_kv, D]` (slot = block * BLOCK + offset), `block_tables` `[B,
    max_blocks]`, `seq_lens` `[B]`, `query_start` `[B + 1]` (int32 each), `new_mask` `[N,
    max_new]` (a token's view of its row's new tokens); returns `[N, H, D]` in the query's dtype.
    Every size is a tensor's: nothing is read back to the host. `num_splits`: None, `splits_for`
    the shapes."""
    query = query.contiguous()  # the kernels index [N, H, D] densely, the output too
    num_tokens, heads, head_dim = query.shape
    num_rows, max_blocks = block_tables.shape
    kv_heads = keys.shape[1]
    group = triton.next_power_of_2(heads // kv_heads)
    block_q = tokens_a_program(new_mask.shape[1], group)
    # every row's blocks, without the rows' lengths: row b's first is query_start[b] // BLOCK_Q + b
    query_blocks = -(-num_tokens // block_q) + num_rows
    max_tiles = -(-max_blocks * block_size // KEY_TILE)
    num_splits = num_splits or splits_for(max(num_rows, query_blocks - num_rows), kv_heads, max_tiles)
    partial_out = torch.empty(num_tokens, heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    partial_max = torch.empty(num_tokens, heads, num_splits, dtype=torch.float32, device=query.device)
    partial_sum = torch.empty_like(partial_max)
    split_attention_kernel[(query_blocks, kv_heads, num_splits)](
        query,
        keys,
        values,
        block_tables,
        seq_lens,
        query_start,
        new_mask,
        partial_out,
        partial_max,
        partial_sum,
        head_dim**-0.5 if scale is None else scale,
        num_rows,
        max_blocks,
        new_mask.shape[1],
        num_splits,
        HEADS=heads,
        KV_HEADS=kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK=block_size,
        BLOCK_Q=block_q,
        TILE=KEY_TILE,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
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
