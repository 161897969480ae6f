"""A model's runner on this rank: what its ragged steps (batching.py) need beside the transformers
model, in one typed object. It holds the model's KV pool, how its steps are laid out (padded to
buckets for a compiled or graphed step; the paged kernel or SDPA), its CUDA graphs with their
static buffers (step_graphs.py), its pipeline stage (models/pipeline.py), and the layer inputs
its forwards keep for an EAGLE-3 layer (target/aux_states.py). Settings are made at load
(models/loader.py) and read at each step. The base model holds its runner (`runner_of`), so
that a session, a worker or a tool that has the model has its runner too."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from .kv_pool import KVPool
from .step_graphs import StepGraphs


class PipelineStepper(Protocol):
    """A pipeline stage's step (models/pipeline.py's PipelineStage): the rows of a step as
    micro-batches, and their forwards run stage by stage."""

    num_stages: int
    forward: Callable[..., Any]  # the stage's own layers (the base model's forward before it became the stage)

    def microbatches(self, lengths: Sequence[int]) -> list[range]: ...

    def run_each(self, calls: list[dict], layers: Optional[Callable[[dict], torch.Tensor]] = None) -> list[Any]: ...


@dataclass(eq=False)
class ModelRunner:
    base_model: torch.nn.Module = field(repr=False)  # this rank's layers (a pipeline stage's own), no LM head
    kv_dtype: Optional[torch.dtype] = None  # the pool's entries; None: the activations'
    pool: Optional[KVPool] = None  # made at the first ragged forward, unless fixed (batching.fix_pool)
    padded: bool = False  # a compiled step: every size padded to its bucket (batching.padded_size)
    paged: bool = False  # short rows attend with the paged kernel (kernels/paged_attention.py)
    graphs: Optional[StepGraphs] = None  # None: every step eager
    stage: Optional[PipelineStepper] = None  # None: every layer on this rank
    tp_ranks: int = 1  # the tensor-parallel ranks each layer is split over
    kept_layers: Optional[tuple[int, ...]] = None  # the decoder layers whose inputs each forward keeps
    kept_states: dict[int, torch.Tensor] = field(default_factory=dict)  # [1, N, H] each, the last forward's

    def kv_pool(self) -> KVPool:
        """The pool, made at its first use (one per model and process)."""
        if self.pool is None:
            self.pool = KVPool(num_layers=len(self.base_model.layers), dtype=self.kv_dtype)
        return self.pool

    def use_graphs(self, record: bool = True) -> StepGraphs:
        """From now on the steps a graph covers replay one (`record` False: over the static
        buffers eagerly, the CPU's stand-in); a pipeline stage's, one a micro-batch."""
        forward = self.stage.forward if self.stage is not None else self.base_model.forward
        self.graphs = StepGraphs(forward, lambda: self.kept_states, record)
        return self.graphs

    def drop_graphs(self) -> None:
        """Forget the graphs (they no longer record what the forward does: hooks were added)."""
        if self.graphs is not None:
            self.graphs.drop()


def runner_of(base_model: torch.nn.Module) -> ModelRunner:
    """`base_model`'s runner (a causal LM's `.model`), made at its first use."""
    runner = base_model.__dict__.get("runner")
    if runner is None:
        runner = base_model.runner = ModelRunner(base_model)
    return runner


def use_paged_attention(model: torch.nn.Module) -> None:
    """`model`'s steps of short rows (verify blocks, trees, single tokens: every step a CUDA graph
    covers) attend with the paged kernel; prompt chunks keep SDPA."""
    import triton  # noqa: F401 - a clear ImportError at load, not at the first step

    if model.device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        raise ValueError(
            "the paged attention kernel runs on CUDA (on the CPU only under TRITON_INTERPRET=1, for tests)"
        )
    runner_of(model.model).paged = True


def use_step_graphs(model: torch.nn.Module, record: bool = True) -> StepGraphs:
    """`ModelRunner.use_graphs` for a causal LM."""
    return runner_of(model.model).use_graphs(record)
