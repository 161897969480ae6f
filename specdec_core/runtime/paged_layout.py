"""A step's rows as the paged attention kernel reads them (kernels/paged_attention.py): each row's
block table, its keys, where its new tokens start, what each new token sees among them, and the
slot each writes. Built on the host once a step (batching.step_layout), from plain integers: a
`torch.tensor` of a Python list converts each element (about 0.3 us), which for 64 rows' block
tables was most of a step's layout; each tensor here is one buffer handed to torch whole.

Padded for a CUDA graph, every size rounds up to its bucket and the padding tokens form one more
row of no keys (the kernel gives them 0), so the tensors' shapes take a bounded set of values; the
block tables' width, a power of two, so that a growing context changes a step's graph each time it
doubles, not each 1,024 tokens (vLLM's tables take the longest context's width, always).

Vocabulary: B rows (B_p padded), N new tokens (N_p), Q the most of a row (Q_p), `blocks` columns
of block tables."""

from __future__ import annotations

import array
import itertools
from typing import Callable, Optional, Sequence

import torch

from ..trees.tree import Topology
from .kv_pool import KVPool, PagedKV, blocks_for
from .ragged_attention import PagedRows, StepLayout, on_device

# array's typecodes of torch's integer dtypes
TYPECODES = {torch.int64: "q", torch.int32: "i"}


def host_tensor(values: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-d tensor of `values`, through one buffer (not element by element)."""
    return buffer_tensor(array.array(TYPECODES[dtype], values), dtype)


def buffer_tensor(buffer: array.array, dtype: torch.dtype) -> torch.Tensor:
    """A 1-d tensor over `buffer`'s memory (of `dtype`'s typecode), not copied."""
    if not buffer:  # torch.frombuffer refuses an empty buffer
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)


def paged_layout(
    pool: KVPool,
    caches: Sequence[PagedKV],
    lengths: Sequence[int],
    trees: Sequence[Optional[Topology]],
    pad: Callable[[int], int],
    ahead: int,
    device: torch.device,
) -> StepLayout:
    """The step of rows of `lengths` new tokens after `caches` (their blocks reserved), every row
    on the paged kernel; `pad`: a size's bucket (`int`: none); `ahead`: the block tables reach
    that many positions further (batching.step_layout)."""
    size, rows = pool.block_size, len(caches)
    history = [cache.length for cache in caches]
    totals = [length + held for length, held in zip(lengths, history)]
    num_tokens = sum(lengths)
    padded = pad is not int
    num_rows, tokens = (pad(rows + 1), pad(num_tokens)) if padded else (rows, num_tokens)
    # [B_p] new tokens a row; padded, the padding tokens are one more row, of no keys
    counts = [*lengths, *([tokens - num_tokens] if padded else []), *[0] * (num_rows - rows - padded)]
    num_blocks = blocks_for(max(totals) + ahead, size)
    if padded:  # the kernel reads a row's keys only: wider costs bytes, not work
        num_blocks = 1 << (num_blocks - 1).bit_length()
    # [B_p, blocks] each row's blocks, then block 0 (past its keys): one buffer, filled row by row
    tables = array.array(TYPECODES[torch.int32])
    zeros = memoryview(bytes(tables.itemsize * num_blocks))
    for cache in caches:
        blocks = cache.table[:num_blocks]
        tables.fromlist(blocks)
        tables.frombytes(zeros[: tables.itemsize * (num_blocks - len(blocks))])
    tables.frombytes(bytes(tables.itemsize * num_blocks * (num_rows - rows)))
    block_tables = buffer_tensor(tables, torch.int32).view(num_rows, num_blocks)
    # [N_p] each new token's slot: its row's block at its position; a padding token's, the scratch block's
    write_slots = [
        cache.table[position // size] * size + position % size
        for cache, held, length in zip(caches, history, lengths)
        for position in range(held, held + length)
    ]
    scratch = pool.scratch_slot
    write_slots += [scratch + index % size for index in range(tokens - num_tokens)]
    within = host_tensor([place for count in counts for place in range(count)])  # [N_p] each token's place in its row
    new_mask = torch.arange(pad(max(lengths)))[None] <= within[:, None]  # [N_p, Q_p] a chain's: causal
    starts = [0, *itertools.accumulate(counts)]  # [B_p + 1]
    for row, tree in enumerate(trees):
        if tree is not None:  # a tree's nodes see their ancestors (root and nodes, in its order)
            width = tree.num_nodes + 1
            new_mask[starts[row] : starts[row] + width, :width] = tree.attention_mask
    rows_read = PagedRows(
        on_device(block_tables, device),
        on_device(host_tensor([*totals, *[0] * (num_rows - rows)], torch.int32), device),  # [B_p] keys a row
        on_device(host_tensor(starts, torch.int32), device),
        on_device(new_mask, device, torch.int8),
    )
    return StepLayout(pool, on_device(host_tensor(write_slots), device), [], None, rows_read)
