"""What one step's attention costs on a CUDA device, per layer, as today's per-row calls against
one call for every row: the measure behind issue 33's choice of kernel (docs/performance.md).
A row is `tokens` new queries over its own `history` keys (causal within the new ones), heads
grouped as Llama-3.1-8B's (32 query heads, 8 K/V heads of 128)."""

from __future__ import annotations

import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from .device_clock import seconds_per_call

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PER_ROW = {
    "efficient, K/V heads expanded": ([SDPBackend.EFFICIENT_ATTENTION], True),
    "math, grouped K/V heads": ([SDPBackend.MATH], False),
}


def microseconds(call, repeats: int = 20) -> float:
    return seconds_per_call(call, repeats) * 1e6


def attention_calls(rows: int = 64, tokens: int = 5, history: int = 352) -> list[dict]:
    """Microseconds of one layer's attention over `rows` rows, per kernel."""
    cuda, bf16 = "cuda", torch.bfloat16
    query = torch.randn(1, HEADS, tokens, HEAD_DIM, device=cuda, dtype=bf16)
    keys = torch.randn(1, KV_HEADS, history, HEAD_DIM, device=cuda, dtype=bf16)
    mask = torch.ones(tokens, history, dtype=torch.bool, device=cuda).tril(history - tokens)
    results = []
    for name, (backends, expand) in PER_ROW.items():
        row_keys = keys.repeat_interleave(HEADS // KV_HEADS, 1) if expand else keys
        with sdpa_kernel(backends):
            one = microseconds(
                lambda: scaled_dot_product_attention(query, row_keys, row_keys, attn_mask=mask, enable_gqa=True)
            )
        results.append({"kernel": f"per row: {name}", "us per layer": round(one * rows), "calls": rows})
    results.append(one_flex_call(rows, tokens, history))
    return results


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
