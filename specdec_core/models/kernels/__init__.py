"""CPU kernels, beside the loop as gpt-fast keeps `quantize.py` and `tp.py`: packed linears
(linear.py), weight-only int4 (int4.py), a draft's linears on a kernel per chunk length
(chunked.py) measured once per machine (kernel_choice.py), grouped-head attention (attention.py)
and process-wide CPU settings (cpu.py). KV caches are kv_pool.py's `PagedKV` sessions in a
model's `KVPool`."""

from __future__ import annotations

import torch

from .attention import use_grouped_attention
from .linear import use_packed_matmul


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode with this project's CPU kernels: packed linears and grouped-head SDPA (both fall
    back to transformers' own path off CPU)."""
    use_packed_matmul(model)
    use_grouped_attention(model)
    return model.eval()
