"""Ragged rows over a random paged KV pool, and their attention by SDPA over each row's gathered
keys: what kernels/paged_attention.py must equal (tests/core/test_paged_attention.py on the CPU,
test_gpu.py on CUDA)."""

from __future__ import annotations

import torch

from specdec_core.runtime.kv_pool import BLOCK_SIZE as BLOCK


def causal(new: int) -> torch.Tensor:
    """A verify block's view of its new tokens: the earlier ones and itself."""
    return torch.ones(new, new).tril().bool()


def tree_mask() -> torch.Tensor:
    """A root with two children, the first with a child: each node sees its ancestors."""
    parents = [-1, 0, 0, 1]
    mask = torch.eye(4, dtype=torch.bool)
    for node, parent in enumerate(parents):
        while parent >= 0:
            mask[node, parent] = True
            parent = parents[parent]
    return mask


def random_paged_arguments(
    seq_lens, masks, heads, kv_heads, head_dim, seed=0, dtype=torch.float32, device="cpu"
) -> dict:
    """The kernel's arguments for rows of `seq_lens` keys whose last `len(mask)` are new tokens
    seeing each other by `mask`; each row owns shuffled blocks of a random pool."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-total // BLOCK) for total in seq_lens]
    order = torch.randperm(sum(blocks), generator=generator).tolist()
    tables, start = [], 0
    for count in blocks:
        tables.append(order[start : start + count] + [0] * (max(blocks) - count))
        start += count
    slots = (sum(blocks) + 1) * BLOCK
    keys, values = (torch.randn(slots, kv_heads, head_dim, generator=generator) for _ in "kv")
    news = [len(mask) for mask in masks]
    query = torch.randn(sum(news), heads, head_dim, generator=generator)
    new_mask = torch.zeros(sum(news), max(news), dtype=torch.int8)
    start = 0
    for new, mask in zip(news, masks):
        new_mask[start : start + new, :new] = mask.to(torch.int8)
        start += new
    int32 = torch.int32
    arguments = {
        "query": query.to(dtype),
        "keys": keys.to(dtype),
        "values": values.to(dtype),
        "block_tables": torch.tensor(tables, dtype=int32),
        "seq_lens": torch.tensor(seq_lens, dtype=int32),
        "query_start": torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=int32),
        "new_mask": new_mask,
    }
    return {name: tensor.to(device) for name, tensor in arguments.items()}


def sdpa_reference(arguments: dict) -> torch.Tensor:
    """Each row's attention by SDPA over its keys gathered in order (fp32), `[N, H, D]`."""
    query, keys, values = (arguments[name].float().cpu() for name in ("query", "keys", "values"))
    tables, seq_lens = arguments["block_tables"].cpu(), arguments["seq_lens"].tolist()
    starts, new_mask = arguments["query_start"].tolist(), arguments["new_mask"].cpu().bool()
    outputs = []
    for row, total in enumerate(seq_lens):
        new = starts[row + 1] - starts[row]
        positions = torch.arange(total)
        slots = tables[row, positions // BLOCK].long() * BLOCK + positions % BLOCK
        k, v = keys[slots].transpose(0, 1), values[slots].transpose(0, 1)  # [H_kv, L, D]
        seen = torch.ones(new, total, dtype=torch.bool)
        seen[:, total - new :] = new_mask[starts[row] : starts[row + 1], :new]
        q = query[starts[row] : starts[row + 1]].transpose(0, 1)  # [H, q, D]
        grouped = q.shape[0] != k.shape[0]
        out = torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=seen, enable_gqa=grouped
        )
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs)
