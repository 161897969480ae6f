"""CUDA graphs of a model's eager step, without inductor (SGLang's default): one graph per shape of
the step's inputs, recorded at its first use and replayed after, all of a model's graphs in one
memory pool. A graph replays the whole forward (every layer, the ragged attention, the KV pool's
writes) as one launch: the step costs its device time, not its ~2,000 kernel launches.

A replay reads its inputs from static buffers: the step's tokens, positions and layout are copied
into the buffers of the graph that matches their shapes (batching.padded_size rounds every size
to a few buckets, so a bounded set of graphs covers decoding). The pool's storage is a static
address; where it moves (a growable pool grew) every graph is dropped and recorded again.

Steps that no graph covers run eagerly: a row of more than `ragged_attention.LONG_ROW` new tokens (a
prompt chunk), a step of more than `GRAPH_MAX_TOKENS`, and the first forward (it allocates the
pool). A rank of a tensor-parallel group records its collectives in its graphs: its ranks run the
same steps in the same order (their worker's rank 0 sends them), so they record and replay the same
graphs together. A pipeline stage replays a graph a micro-batch, of its own layers; its sends and
receives run between replays (pipeline.py). A greedy draft chain's later forwards are one graph of
their own (chained_steps.py), in the same pool. Graphs stay until the pool moves: a bucket of keys
more per 1,024 tokens of context adds graphs (on the paged kernel, a doubling: paged_layout.py),
each holding its static inputs (on SDPA the largest, a 64-row mask, a few MB; on the paged kernel
the block tables, 8 MB at 64 rows of 128k positions); the pool's intermediates are shared."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

import torch

from .ragged_attention import LONG_ROW, PagedRows, RowGroup, StepLayout

# a step of more tokens than this (after padding) runs eagerly: 64 sessions' verify rows of up to
# 16 tokens; a row of more than LONG_ROW new tokens (a prompt chunk) is never graphed
GRAPH_MAX_TOKENS = 1024


@dataclasses.dataclass
class CapturedStep:
    """One graph and the buffers it reads and writes."""

    inputs: dict  # the step's keyword arguments, every tensor a static buffer
    outputs: tuple[torch.Tensor, ...]  # what the graph writes: a step's final hidden states [1, N, H]
    graph: Optional["torch.cuda.CUDAGraph"]  # None: replayed eagerly over the buffers (CPU tests)
    kept: dict  # what the forward's hooks kept (aux_states.py), restored after each replay


# what a graph records: a function of its static inputs, returning the tensors it writes
Recorded = Callable[[dict], tuple[torch.Tensor, ...]]


class StepGraphs:
    """The graphs of one model's step (`forward`: its base model's forward, keyword arguments as
    batching.step_inputs makes them, returning an output with `last_hidden_state`), and of other
    functions of a step's inputs (`replay`: a draft chain's forwards, chained_steps.py), in one
    memory pool. `record`: capture CUDA graphs; without, a "replay" runs the function over the
    static buffers, which tests the buffers' bookkeeping where there is no CUDA."""

    def __init__(self, forward: Callable[..., Any], kept: Callable[[], dict], record: bool = True):
        self.forward = forward
        self.kept = kept  # the hooks' current states (an empty dict where the model keeps none)
        self.record = record
        self.memory_pool = torch.cuda.graph_pool_handle() if record else None
        self.graphs: dict[tuple, CapturedStep] = {}
        self.storage: Optional[tuple] = None  # the KV pool and its storage version the graphs write
        self.recorded, self.recording_seconds = 0, 0.0  # graphs recorded (dropped ones too), and their time

    def covers(self, lengths: Sequence[int]) -> bool:
        """Whether a step over rows of `lengths` new tokens replays a graph (padded to buckets)."""
        return max(lengths) <= LONG_ROW and sum(lengths) <= GRAPH_MAX_TOKENS

    def run(self, inputs: dict) -> torch.Tensor:
        """The step's final hidden states `[1, N, H]` (N padded): a graph's static output,
        overwritten by that graph's next replay."""
        if inputs["ragged"].pool.keys is None:  # the first forward allocates the pool: eagerly
            return self.forward(**inputs).last_hidden_state
        return self.replay(inputs, self.hidden, "step")[0]

    def hidden(self, inputs: dict) -> tuple[torch.Tensor]:
        return (self.forward(**inputs).last_hidden_state,)

    def replay(self, inputs: dict, function: Recorded, kind: Any) -> tuple[torch.Tensor, ...]:
        """`function(inputs)`'s outputs, from the graph of `kind` recorded for `inputs`' shapes
        (recorded now if none is): static tensors, overwritten by that graph's next replay. The
        pool must be allocated (`inputs["ragged"].pool`)."""
        layout: StepLayout = inputs["ragged"]
        storage = (layout.pool.serial, layout.pool.storage_version)
        if storage != self.storage:  # the pool grew (moved), or is another: every graph wrote the old one
            self.drop()
            self.storage = storage
        key = (kind, shapes(inputs))
        captured = self.graphs.get(key)
        if captured is None:
            clock = time.perf_counter()
            captured = self.graphs[key] = self.capture(inputs, function)
            self.recorded += 1
            self.recording_seconds += time.perf_counter() - clock
        for static, tensor in zip(tensors(captured.inputs), tensors(inputs)):
            static.copy_(tensor, non_blocking=True)
        if captured.graph is None:
            for static, output in zip(captured.outputs, function(captured.inputs)):
                static.copy_(output)
        else:
            captured.graph.replay()
            self.kept().update(captured.kept)  # the hooks ran at the capture only
        return captured.outputs

    def drop(self) -> None:
        """Forget every graph, and their memory pool with them (CUDA frees a pool with its last
        graph: a graph recorded after needs a new one)."""
        self.graphs.clear()
        self.memory_pool = torch.cuda.graph_pool_handle() if self.record else None

    def capture(self, inputs: dict, function: Recorded) -> CapturedStep:
        """Record `function` for `inputs`' shapes. It runs once eagerly first (on a side stream,
        as CUDA graphs require: libraries allocate their workspaces at a first call); both runs
        write the same KV entries to the same slots, which the replay after writes again."""
        static = map_tensors(inputs, torch.clone)
        if not self.record:
            outputs = tuple(output.clone() for output in function(static))
            return CapturedStep(static, outputs, None, dict(self.kept()))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            function(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool, capture_error_mode="thread_local"):
            outputs = function(static)
        return CapturedStep(static, outputs, graph, dict(self.kept()))


def tensors(inputs: dict) -> list[torch.Tensor]:
    """The step's tensors in a fixed order (its tokens, positions and layout's)."""
    found: list[torch.Tensor] = []
    map_tensors(inputs, lambda tensor: found.append(tensor) or tensor)
    return found


def shapes(inputs: dict) -> tuple:
    """What picks a step's graph: its other arguments (`use_cache`, an absent `input_ids`), each
    tensor's shape and dtype in `tensors`' order, and where the layout has none (a group without
    a mask, one row without an output index)."""
    described: list = []
    map_tensors(inputs, lambda tensor: described.append((tuple(tensor.shape), tensor.dtype)) or tensor, described)
    plain = (torch.Tensor, StepLayout, dict)
    others = tuple((name, value) for name, value in sorted(inputs.items()) if not isinstance(value, plain))
    return (others, *described)


def map_tensors(inputs: dict, function: Callable, absent: Optional[list] = None) -> dict:
    """`inputs` with `function` applied to each tensor, its layout's included, in `tensors`' order
    (`absent` collects a marker where the layout has None)."""

    def apply(value):
        if value is None and absent is not None:
            absent.append(None)
        return function(value) if isinstance(value, torch.Tensor) else value

    mapped = {}
    for name, value in sorted(inputs.items()):
        if isinstance(value, dict):  # a chain's carried tensors (chained_steps.py)
            value = map_tensors(value, function, absent)
        elif isinstance(value, StepLayout):
            groups = [
                RowGroup(apply(group.read), apply(group.query_index), apply(group.mask)) for group in value.groups
            ]
            paged = value.paged
            if paged is not None:
                paged = PagedRows(**{part.name: apply(getattr(paged, part.name)) for part in dataclasses.fields(paged)})
            value = StepLayout(value.pool, apply(value.write_slots), groups, apply(value.output_index), paged)
        mapped[name] = apply(value)
    return mapped
