"""Grouped-head attention for CPU: `grouped_sdpa`, registered with transformers as an attention
implementation by `use_grouped_attention`."""

from __future__ import annotations

import torch

from .linear import packable_dtypes

GROUPED_SDPA = "sdpa_grouped"


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' "sdpa" attention, except that on CPU the grouped K/V heads go to SDPA as they
    are (`enable_gqa`) also under a mask. transformers repeats K and V to the query heads' count
    whenever a mask is passed, i.e. in every multi-token block after the prefill (each verify):
    for SmolLM2 (9 query, 3 KV heads) that copied every layer's whole cache 3x per verify. CPU's
    flash kernel takes the groups natively, bitwise equal.
    Other devices, position biases, ungrouped heads, and a causal flag with a longer cache
    (which SDPA would align top-left) take transformers' path. A one-token step in bf16 or fp16
    takes `grouped_low_precision_attention`."""
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    if (
        query.device.type != "cpu"
        or getattr(module, "num_key_value_groups", 1) == 1
        or kwargs.get("position_bias") is not None
        or (is_causal and key.shape[2] != query.shape[2])
    ):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if query.shape[2] == 1 and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0:
        return grouped_low_precision_attention(query, key, value, attention_mask, scaling), None
    output = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=is_causal,
        enable_gqa=True,
    )
    return output.transpose(1, 2).contiguous(), None


def grouped_low_precision_attention(query, key, value, attention_mask, scaling=None) -> torch.Tensor:
    """Attention in bf16 or fp16 on CPU as two matmuls per KV head, the group's query heads and
    queries stacked as rows and the softmax in fp32; `query` `[B, H, Q, D]`, `key`, `value`
    `[B, H_kv, L, D]`, `attention_mask` `[B, 1, Q, L]` (bool, True attends; or additive) or None; returns
    `[B, Q, H, D]`. CPU SDPA's bf16 flash kernel is slow for a single query (several times
    slower than this for SmolLM2's shapes at 1,000 tokens of context), and a row's numbers here
    do not depend on how many queries the other rows of its step bring (SDPA's would: it picks
    another kernel), so a draft's proposals come out the same alone and batched."""
    batch, num_heads, num_queries, head_dim = query.shape
    num_kv_heads = key.shape[1]
    groups = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scaling is None else scaling
    # the matmuls in fp32 where this CPU has no fast bf16 matmul (AVX2 alone: a 512-token
    # prompt's bf16 attention took 3.2 s of a 3.9 s draft prefill on a Zen 5 VM held to AVX2)
    compute = query.dtype if query.dtype in packable_dtypes() else torch.float32
    # query heads h * g .. h * g + g - 1 share KV head h (transformers' repeat_kv order)
    grouped_query = query.reshape(batch, num_kv_heads, groups * num_queries, head_dim).to(compute)
    scores = torch.matmul(grouped_query, key.to(compute).transpose(-1, -2)).float() * scale  # [B, H_kv, g * Q, L]
    if attention_mask is not None:
        mask = attention_mask.expand(batch, groups, num_queries, -1).reshape(batch, 1, groups * num_queries, -1)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = scores.softmax(-1).to(compute)
    output = torch.matmul(weights, value.to(compute)).to(query.dtype).reshape(batch, num_heads, num_queries, head_dim)
    return output.transpose(1, 2)


def use_grouped_attention(model: torch.nn.Module) -> None:
    """Switch a model on transformers' sdpa attention to `grouped_sdpa` (same masks)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    model.set_attn_implementation(GROUPED_SDPA)
