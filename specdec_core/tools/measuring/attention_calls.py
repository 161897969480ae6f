"""What one step's attention costs on a CUDA device, per layer: the step's one masked call over
every row (its keys gathered and padded to the longest row's bucket), with the K/V heads expanded
to the query heads (before) or the query heads folded into the query rows (ragged_attention.
folded_heads_attention, now), against one flex_attention call over the rows packed. A row is
`tokens` new queries over its own `history` keys (causal within the new ones), heads grouped as
Llama-3.1-8B's (32 query heads, 8 K/V heads of 128). And the paged kernel (kernels/
paged_attention.py), which reads the rows' keys in the pool through their block tables: no
gather, no padding."""

from __future__ import annotations

import contextlib
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from ...runtime.batching import padded_size
from ...runtime.ragged_attention import folded_heads_attention
from .device_clock import seconds_per_call

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
GROUPS = HEADS // KV_HEADS


def microseconds(call, repeats: int = 20) -> float:
    return seconds_per_call(call, repeats) * 1e6


def attention_calls(
    rows: int = 64, tokens: int = 5, history: int = 352, device: str = "cuda", flex: bool = True
) -> list[dict]:
    """Microseconds of one layer's attention over `rows` rows, per way of calling it (on CUDA, its
    efficient kernel, which takes a mask; `flex`: flex_attention too, there only)."""
    bf16 = torch.bfloat16
    width = padded_size(history + tokens)  # a graphed step's keys
    query = torch.randn(rows, HEADS, tokens, HEAD_DIM, device=device, dtype=bf16)
    keys = torch.randn(rows, KV_HEADS, width, HEAD_DIM, device=device, dtype=bf16)
    positions = torch.arange(width, device=device)
    mask = positions <= history + torch.arange(tokens, device=device)[:, None]  # [Q, L]
    mask = mask.expand(rows, 1, tokens, width)  # [B, 1, Q, L]
    ways = {
        "K/V heads expanded": lambda: scaled_dot_product_attention(
            query, keys.repeat_interleave(GROUPS, 1), keys.repeat_interleave(GROUPS, 1), attn_mask=mask
        ),
        "query heads folded": lambda: folded_heads_attention(query, keys, keys, mask, None),
    }
    on_cuda = device == "cuda"
    results = []
    for name, call in ways.items():
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]) if on_cuda else contextlib.nullcontext():
            one = microseconds(call)
        kernel = f"one masked call, {width} keys a row: {name}"
        results.append({"kernel": kernel, "us per layer": round(one), "calls": 1})
    if not on_cuda:  # Triton's interpreter would time numpy
        return results
    try:  # a kernel new to this device: its failure is the row's answer, not the report's end
        paged_us = paged_call(rows, tokens, history)
    except Exception as error:  # noqa: BLE001 - shown in the table
        paged_us = f"failed: {type(error).__name__}: {str(error)[:200]}"
    results.append({"kernel": "one paged call (Triton)", "us per layer": paged_us, "calls": 1})
    return [*results, one_flex_call(rows, tokens, history)] if flex else results


def paged_call(rows: int, tokens: int, history: int, device: str = "cuda") -> int:
    """Microseconds of kernels/paged_attention.py over `rows` rows of `tokens` new tokens after
    `history`, each row's blocks where the pool put them (consecutive here: the kernel reads
    them through the tables all the same)."""
    from ...models.kernels.paged_attention import paged_attention
    from ...runtime.kv_pool import BLOCK_SIZE, blocks_for

    total = history + tokens
    per_row = blocks_for(total, BLOCK_SIZE)
    bf16, int32 = torch.bfloat16, torch.int32
    keys = torch.randn((rows * per_row + 1) * BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=bf16)
    arguments = {
        "query": torch.randn(rows * tokens, HEADS, HEAD_DIM, device=device, dtype=bf16),
        "keys": keys,
        "values": keys,
        "block_tables": torch.arange(rows * per_row, device=device, dtype=int32).view(rows, per_row),
        "seq_lens": torch.full((rows,), total, device=device, dtype=int32),
        "query_start": torch.arange(0, rows * tokens + 1, tokens, device=device, dtype=int32),
        "new_mask": torch.ones(tokens, tokens, device=device).tril().to(torch.int8).repeat(rows, 1),
    }
    return round(microseconds(lambda: paged_attention(**arguments)))


def one_flex_call(rows: int, tokens: int, history: int) -> dict:
    """`flex_attention` over all rows packed: row r's queries see row r's keys, causally."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    cuda, bf16 = "cuda", torch.bfloat16
    query = torch.randn(1, HEADS, rows * tokens, HEAD_DIM, device=cuda, dtype=bf16)
    keys = torch.randn(1, KV_HEADS, rows * history, HEAD_DIM, device=cuda, dtype=bf16)
    query_row = torch.arange(rows * tokens, device=cuda) // tokens
    query_position = history - tokens + torch.arange(rows * tokens, device=cuda) % tokens
    key_row = torch.arange(rows * history, device=cuda) // history
    key_position = torch.arange(rows * history, device=cuda) % history

    def same_row_causal(batch, head, q, k):
        return (query_row[q] == key_row[k]) & (key_position[k] <= query_position[q])

    def block_mask():
        return create_block_mask(same_row_causal, 1, 1, rows * tokens, rows * history, device=cuda)

    compiled = torch.compile(flex_attention)
    start = time.perf_counter()
    mask = block_mask()
    compiled(query, keys, keys, block_mask=mask, enable_gqa=True)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    mask_us = microseconds(block_mask, 5)
    return {
        "kernel": f"one flex_attention call (compiled in {first_s:.1f} s; its block mask built in {mask_us:.0f} us)",
        "us per layer": round(microseconds(lambda: compiled(query, keys, keys, block_mask=mask, enable_gqa=True))),
        "calls": 1,
    }
