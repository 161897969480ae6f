"""A compiled worker step: `torch.compile` over a model's base forward (every layer and the ragged
attention, no graph break: `specdec compile-check`), its sizes padded (batching.padded_size) so
that on CUDA a CUDA graph is recorded once for each combination of the sizes' buckets and
replayed after."""

from __future__ import annotations

import torch

from .model_runner import runner_of
from .ragged_attention import use_ragged_attention


def compile_step(model: torch.nn.Module, backend: str = "inductor") -> None:
    """Compile `model`'s base forward (every layer and the ragged attention: no graph break,
    `specdec compile-check`). Its sizes turn symbolic at the first recompile, so a server compiles
    a few graphs (one or two row groups, one row or many); the step pads every size
    (`padded_size`), so on CUDA (mode reduce-overhead) a CUDA graph is recorded per combination
    of buckets and replayed, the pool a static buffer that the graphs write in place."""
    use_ragged_attention(model)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    cuda_graphs = backend == "inductor" and model.device.type == "cuda"
    mode = "reduce-overhead" if cuda_graphs else None
    stage = runner_of(model.model).stage
    if stage is not None:  # a pipeline stage's layers, not its transfers between stages
        stage.forward = torch.compile(stage.forward, backend=backend, mode=mode)
    else:
        model.model.forward = torch.compile(model.model.forward, backend=backend, mode=mode)
    pad_steps(model)


def pad_steps(model: torch.nn.Module) -> None:
    """From now on `model`'s steps pad every size to `padded_size` (a compiled step's few shapes)."""
    runner_of(model.model).padded = True
