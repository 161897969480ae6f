"""The ragged step's attention calls (specdec_core/runtime/ragged_attention.py) beyond what the batching
tests cover: CUDA's masked path, run here on the CPU, and gpu-report's table of them."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("num_queries", [1, 5])
def test_folded_heads_attend_as_expanded_ones(monkeypatch, num_queries: int):
    """CUDA's masked path (ragged_attention.folded_heads_attention, run here on the CPU): each K/V
    head's query heads folded into its query rows give what SDPA gives over K/V heads expanded to
    the query heads, with a causal mask over padded keys."""
    from specdec_core.runtime.ragged_attention import folded_heads_attention

    generator = torch.Generator().manual_seed(num_queries)
    rows, heads, kv_heads, keys_length, head_dim = 3, 8, 2, 16, 32
    # [B, H, Q, D], not contiguous, as a step's queries are
    queries = torch.randn(rows, num_queries, heads, head_dim, generator=generator).transpose(1, 2)
    keys, values = (torch.randn(rows, kv_heads, keys_length, head_dim, generator=generator) for _ in range(2))
    history = torch.tensor([4, 9, 11])  # [B]; keys past a row's end are padding
    positions = torch.arange(keys_length)
    mask = positions[None, None] <= history[:, None, None] + torch.arange(num_queries)[None, :, None]  # [B, Q, L]
    mask = mask[:, None]  # [B, 1, Q, L]
    expanded = torch.nn.functional.scaled_dot_product_attention(
        queries, keys.repeat_interleave(4, 1), values.repeat_interleave(4, 1), attn_mask=mask, scale=0.1
    )
    folded = folded_heads_attention(queries, keys, values, mask, 0.1)
    torch.testing.assert_close(folded, expanded, atol=1e-6, rtol=1e-5)
    # CUDA's efficient kernel returns its output laid out [B, M, H, D], transposed: the same here
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def laid_out_as_cuda(*args, **kwargs):
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", laid_out_as_cuda)
    torch.testing.assert_close(folded_heads_attention(queries, keys, values, mask, 0.1), folded, atol=0, rtol=0)


def test_the_attention_table_times_both_masked_calls():
    """gpu-report's attention section (tools/attention_calls.py), here on the CPU with small rows:
    the masked call with the K/V heads expanded and with the query heads folded."""
    from specdec_core.tools.measuring.attention_calls import attention_calls

    calls = attention_calls(rows=2, tokens=3, history=20, device="cpu")
    assert [call["kernel"] for call in calls] == [
        "one masked call, 32 keys a row: K/V heads expanded",
        "one masked call, 32 keys a row: query heads folded",
    ]
    assert all(call["us per layer"] > 0 for call in calls)
