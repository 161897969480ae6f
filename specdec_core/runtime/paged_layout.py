"""A step's rows as the paged attention kernel reads them (kernels/paged_attention.py): each row's
block table, its keys, where its new tokens start, and what each new token sees among them. Built
on the host once a step, beside the write slots (batching.step_layout).

Padded for a CUDA graph, every size rounds up to its bucket and the padding tokens form one more
row of no keys (the kernel gives them 0), so the tensors' shapes take a bounded set of values.

Vocabulary: B rows (B_p padded), N new tokens (N_p), Q the most of a row (Q_p), `blocks` columns
of block tables."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..trees.tree import Topology
from .ragged_attention import PagedRows, on_device


def paged_rows(
    history: torch.Tensor,
    new: torch.Tensor,
    tables: torch.Tensor,
    trees: Sequence[Optional[Topology]],
    pad: Callable[[int], int],
    device: torch.device,
) -> PagedRows:
    """`history`, `new` `[B]`: each row's cached and new tokens; `tables` `[B, blocks]` its blocks
    (a shorter row's padded with block 0, past its keys); `pad`: a size's bucket (`int`: none)."""
    rows, num_tokens = len(new), int(new.sum())
    padded = pad is not int
    num_rows, tokens = (pad(rows + 1), pad(num_tokens)) if padded else (rows, num_tokens)
    counts = torch.zeros(num_rows, dtype=torch.long)  # [B_p] new tokens a row
    counts[:rows] = new
    if padded:
        counts[rows] = tokens - num_tokens  # the padding tokens' row: no keys
    seq_lens = torch.zeros(num_rows, dtype=torch.long)  # [B_p]
    seq_lens[:rows] = history + new
    block_tables = torch.zeros(num_rows, tables.shape[1], dtype=torch.long)  # [B_p, blocks]
    block_tables[:rows] = tables
    query_start = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # [B_p + 1]
    token_row = torch.repeat_interleave(torch.arange(num_rows), counts)  # [N_p]
    within = torch.arange(tokens) - query_start[token_row]  # [N_p] each token's place in its row
    widest = pad(int(new.max()))
    new_mask = torch.arange(widest)[None] <= within[:, None]  # [N_p, Q_p] a chain's: causal
    for row, tree in enumerate(trees):
        if tree is not None:  # a tree's nodes see their ancestors (root and nodes, in its order)
            start, width = int(query_start[row]), tree.num_nodes + 1
            new_mask[start : start + width, :width] = tree.attention_mask
    int32 = torch.int32
    return PagedRows(
        on_device(block_tables, device, int32),
        on_device(seq_lens, device, int32),
        on_device(query_start, device, int32),
        on_device(new_mask, device, torch.int8),
    )
