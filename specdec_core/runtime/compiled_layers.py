"""Regional compilation: every decoder layer compiled by inductor around its attention, which runs
eagerly between the compiled parts (a graph break, as vLLM's piecewise graphs split at attention).

Why regions, not the whole step (compiled_step.py): a model's layers share their code, so dynamo
traces and inductor compiles the layer once and every layer reuses it (its weights are the
compiled code's inputs); the attention, left out, reads the pool by the layer's index, which
would otherwise specialize the code per layer. What it buys on CUDA: the norms, rotary
embeddings, activations and residual adds fuse into a few kernels a layer; the step's CUDA graph
(step_graphs.py) then replays those fused kernels. Inductor keeps its compiled kernels on disk
(`TORCHINDUCTOR_CACHE_DIR`), so a second start reuses the first start's work.

Shapes: a layer compiles for one new token (dynamo specializes sizes 0 and 1) and once for any
other count (dynamic), so a bounded set of compiles covers prefill and decoding alike."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .ragged_attention import use_ragged_attention


def compile_layers(model: torch.nn.Module, cache: Path) -> None:
    """Compile each of `model`'s decoder layers (one compile shared by all), its attention left
    out and run eagerly; inductor's kernels cached under `cache` unless
    `TORCHINDUCTOR_CACHE_DIR` names a place of the user's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor writes its default into the variable at its first use: that one is not a choice
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    use_ragged_attention(model, traced=False)
    for layer in model.model.layers:
        layer.compile(dynamic=True)


def layers_compiled(model: torch.nn.Module) -> bool:
    """Whether `compile_layers` compiled `model`'s layers (nn.Module.compile keeps the compiled call)."""
    return getattr(model.model.layers[0], "_compiled_call_impl", None) is not None
