"""The attention of a ragged step (batching.py): every row's queries over its own history in the
model's KV pool, one call per group of rows (at most two a layer), and the layout that the step
builds once for all its layers. Registered with transformers (`use_ragged_attention`), it finds
the step's layout in a keyword argument the model passes down; without one it is the model's
usual attention, so the same model still serves plain forwards.

Vocabulary: B rows, N new tokens in all, Q the most new tokens of a row, L the longest row."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..models.kernels.attention import grouped_low_precision_attention, grouped_sdpa
from .kv_pool import KVPool, gather, write

RAGGED_ATTENTION = "specdec_ragged"
# rows with more new tokens than this (prompt chunks) attend in a call of their own: padded to a
# 512-token chunk's queries, a 5-token verify row's attention would cost 100 times its own
LONG_ROW = 64
# the same attention, never traced by torch.compile: the layers compiled around it
# (compiled_layers.py) break their graphs there and run it eagerly
UNTRACED_RAGGED_ATTENTION = "specdec_ragged_untraced"


@dataclass
class RowGroup:
    """Rows that attend in one call: keys padded to the longest of them, queries to the most."""

    read: "torch.Tensor | slice"  # [B, L] each row's slots, padded; or a lone row's consecutive slots
    query_index: Optional[torch.Tensor]  # [B, Q] the packed index of row b's t-th token (None: one row)
    mask: Optional[torch.Tensor]  # [B, 1, Q, L] bool, True attends (None: every key, one token a row)


@dataclass
class PagedRows:
    """The rows as the paged kernel reads them (kernels/paged_attention.py), int32 each: no
    gather, no padding of a row to the longest."""

    block_tables: torch.Tensor  # [B, blocks] each row's blocks
    seq_lens: torch.Tensor  # [B] each row's keys, its history and new tokens
    query_start: torch.Tensor  # [B + 1] where each row's new tokens start among the N
    new_mask: torch.Tensor  # [N, Q] int8: which of its row's new tokens each sees


@dataclass
class StepLayout:
    """Where one forward's rows write and read in the pool, built once for all its layers: one
    attention call per group, at most two (short rows, long rows); or, with the paged kernel,
    one call over every row (`paged`, the groups then empty)."""

    pool: KVPool
    write_slots: torch.Tensor  # [N] the slot of each new token
    groups: list[RowGroup]
    # [N] where each packed token's output lies among the groups' outputs, [B * Q] each, in order
    # (None: one row, whose outputs are its tokens in order)
    output_index: Optional[torch.Tensor]
    paged: Optional[PagedRows] = None


def on_device(tensor: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A tensor the host laid out, copied to `device` without waiting for the work queued there
    (a blocking copy synchronizes the stream): the host lays out the next step while the device
    runs this one. From pageable memory the copy is staged before it returns, so the host tensor
    may go at once."""
    return tensor.to(device, dtype, non_blocking=True)


@functools.lru_cache(maxsize=None)
def mask_made(device: torch.device) -> torch.Tensor:
    """A ragged step's `attention_mask`: a 4-d placeholder, which transformers takes as a mask
    already made, so that it builds none (a [N, N] mask each forward, about 1.7 ms of host time
    at 320 tokens on a CPU); the ragged attention ignores it, its layout says what each token sees."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)


def attention_backends(device: torch.device):
    """The SDPA kernels a forward may use. Not cuDNN's on CUDA: it builds a plan for every new
    sequence length, about 2.3 ms of host time per call on an H100, and a row's length grows
    every step (docs/architecture.md, "Why the CPU kernels")."""
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
    write(pool_keys, ragged.write_slots, key[0].transpose(0, 1))
    write(pool_values, ragged.write_slots, value[0].transpose(0, 1))
    if ragged.paged is not None:
        from ..models.kernels.paged_attention import paged_attention  # Triton: imported where used

        rows, block_size = vars(ragged.paged), ragged.pool.block_size
        output = paged_attention(
            query[0].transpose(0, 1), pool_keys, pool_values, **rows, scale=scaling, block_size=block_size
        )
        return output[None], None  # [1, N, H, D]
    outputs = [attend(group, query, pool_keys, pool_values, scaling).flatten(0, 1) for group in ragged.groups]
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [sum of B * Q, heads, head_dim]
    return (output if ragged.output_index is None else output[ragged.output_index])[None], None


def attend(group: RowGroup, query, pool_keys, pool_values, scaling) -> torch.Tensor:
    """One group's attention: `[B, Q, heads, head_dim]`."""
    keys, values = gather(pool_keys, group.read), gather(pool_values, group.read)  # [B, L, kv_heads, head_dim]
    if isinstance(group.read, slice):  # one row's consecutive blocks, read as a view: [L, ..]
        keys, values = keys[None], values[None]
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, kv_heads, L, head_dim]
    if keys.dtype != query.dtype:  # an FP8 cache, read back in the activations' dtype
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    queries = query if group.query_index is None else query[0].transpose(0, 1)[group.query_index].transpose(1, 2)
    if queries.dtype in (torch.bfloat16, torch.float16) and queries.device.type == "cpu":
        return grouped_low_precision_attention(queries, keys, values, group.mask, scaling)  # [B, Q, heads, head_dim]
    if group.mask is not None and queries.device.type == "cuda":
        return folded_heads_attention(queries, keys, values, group.mask, scaling).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(
        queries, keys, values, attn_mask=group.mask, scale=scaling, enable_gqa=True
    ).transpose(1, 2)  # [B, Q, heads, head_dim]


def folded_heads_attention(queries, keys, values, mask, scaling) -> torch.Tensor:
    """SDPA of `queries` `[B, H, Q, D]` over grouped `keys`, `values` `[B, H_kv, L, D]` under `mask`
    `[B, 1, Q, L]`, each K/V head's G = H / H_kv query heads folded into its query rows: `[B, H,
    Q, D]`. CUDA's efficient kernel takes a mask but not grouped heads (the math kernel that does
    took 302 against 64 us a call on an H100), and expanding the K/V heads to the query heads'
    count copies every key G times and reads it G times (docs/architecture.md, "Why the CPU kernels")."""
    batch, heads, num_queries, head_dim = queries.shape
    groups = heads // keys.shape[1]
    # query head kv * G + g (transformers' repeat_kv order), query q -> row g * Q + q of head kv
    folded = queries.reshape(batch, keys.shape[1], groups * num_queries, head_dim)  # [B, H_kv, G * Q, D]
    output = torch.nn.functional.scaled_dot_product_attention(
        folded, keys, values, attn_mask=mask.repeat(1, 1, groups, 1), scale=scaling
    )  # [B, H_kv, G * Q, D]; CUDA's efficient kernel lays it out as [B, G * Q, H_kv, D]: no view
    return output.reshape(batch, heads, num_queries, head_dim)


def register_ragged_attention() -> None:
    """Make the ragged attention (and its mask function) known to transformers by name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
    AttentionInterface.register(UNTRACED_RAGGED_ATTENTION, torch.compiler.disable(ragged_attention))
    for name in (RAGGED_ATTENTION, UNTRACED_RAGGED_ATTENTION):
        AttentionMaskInterface.register(name, sdpa_mask)


def paged_kernel_misfit(model: torch.nn.Module, kv_cache_dtype: str = "auto") -> Optional[str]:
    """Why the paged kernel cannot run `model` (None: it can): its matrix products need a head
    size that is a power of two of at least 16, and on CUDA bf16 products (compute capability
    8.0) and, for an FP8 cache, FP8 loads (8.9)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"its head size {head_dim} is not a power of two of at least 16"
    if model.device.type == "cuda":
        capability = torch.cuda.get_device_capability(model.device)
        needed = (8, 9) if kv_cache_dtype == "fp8" else (8, 0)
        if capability < needed:
            return f"compute capability {capability[0]}.{capability[1]} (it needs {needed[0]}.{needed[1]})"
    return None


def use_ragged_attention(model: torch.nn.Module, traced: bool = True) -> None:
    """Give `model` the ragged attention (once; it keeps plain forwards working). `traced` False:
    torch.compile runs it eagerly between the compiled parts of a layer (compiled_layers.py)."""
    if model.config._attn_implementation in (RAGGED_ATTENTION, UNTRACED_RAGGED_ATTENTION):  # every forward asks
        return
    register_ragged_attention()
    model.set_attn_implementation(RAGGED_ATTENTION if traced else UNTRACED_RAGGED_ATTENTION)
