"""Pipeline parallelism: a target's decoder layers split into `pp` stages, each stage a
tensor-parallel group of `tp` ranks (parallel.py), so that a model too large for one node runs
on several (Llama-3.1-405B in bf16: 2 stages of 8 H100s). Global rank = stage * tp + tp_rank.

Every rank runs every forward (its worker's ranks apply the same operations in the same order,
deployments/workers/tensor_parallel.py), each over its own layers and its own KV pool: stage 0 embeds
the tokens and runs its layers, then sends the hidden states `[1, N, H]` to the rank of the
same tp index in the next stage, which runs its layers on them, and so on; the last stage's
final hidden states (after the model's norm) are broadcast to every rank. Only the first stage
holds the embedding, and only the last the norm and the LM head (split over its tp ranks,
shard_loader.py): its logits are broadcast to the other stages (`PipelineHead`), so that every
rank holds the step's logits as with tensor parallelism alone (rank 0, on the first stage,
answers the step). A rank's rollback and tree commits touch its own layers' KV only, the same
on every stage.

A step of several rows fills the pipeline: its rows run as micro-batches (`microbatches`), so
that while stage 1 computes the first rows, stage 0 computes the next ones; a step of S stages
and M micro-batches takes M + S - 1 stage-times of a micro-batch instead of S of the whole step.
A micro-batch pays a forward's fixed costs again (its launches, and on a GPU a read of the stage's
weights), which is a loss for a small step: `MICROBATCH_MIN_TOKENS` keeps such steps whole.
Every rank splits a step alike, since every rank runs the same step."""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch
import torch.distributed as dist
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..api.errors import GroupBroken
from ..runtime.model_runner import runner_of
from .shard_loader import activation_dtype

# the fewest tokens a micro-batch holds: a forward costs more than its tokens' work (on the Zen 4
# VM, about 2 ms a layer on one thread: 8 one-token rows took 134 ms split against 108 whole, 8
# rows of 11 tokens 343 against 382, docs/performance.md), and on a GPU a forward of fewer is bound
# by reading the weights (an H100: ~990 bf16 TFLOP/s over 3.35 TB/s, ~300 tokens a weight read;
# other accelerators are taken as CUDA)
MICROBATCH_MIN_TOKENS = {"cpu": 32, "cuda": 256}


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """The decoder layers of `stage`: equal parts, the first stages one more where they do not
    divide (memory.plan sizes a rank by the largest)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"pp_size {num_stages} must be between 1 and the model's {num_layers} layers")
    size, extra = divmod(num_layers, num_stages)
    start = stage * size + min(stage, extra)
    return range(start, start + size + (stage < extra))


def make_stage(model: torch.nn.Module, stage: int, num_stages: int, tp: int) -> torch.nn.Module:
    """Turn `model` (holding `stage`'s layers only, and its ends: shard_loader.load_shard) into
    that stage of a pipeline over the default process group: its base forward passes hidden
    states on, its LM head logits. Every rank calls it at once (it makes the process groups of
    the stages' tp columns)."""
    base = model.model
    # one group per tp index: that rank of every stage (each rank makes every group, in order)
    columns = [dist.new_group([s * tp + column for s in range(num_stages)]) for column in range(tp)]
    column = dist.get_rank() % tp
    dtype = activation_dtype(model)
    pipeline_stage = PipelineStage(base.forward, stage, num_stages, tp, columns[column], dtype)
    runner_of(base).stage = base.forward = pipeline_stage
    model.lm_head = PipelineHead(model.lm_head, model.config.vocab_size, pipeline_stage)
    return model


class PipelineStage:
    """A base model's forward as one stage: its input from the previous stage's rank of the same
    tp index (stage 0: the tokens), its output to the next; every rank gets the last stage's
    final hidden states `[1, N, H]` (`column_group`: this rank's tp index in every stage)."""

    def __init__(self, forward, stage: int, num_stages: int, tp: int, column_group, dtype: torch.dtype):
        """`dtype`: the hidden states' (the model's activations')."""
        self.forward, self.stage, self.num_stages, self.column_group = forward, stage, num_stages, column_group
        rank = dist.get_rank()
        self.previous, self.following, self.last = rank - tp, rank + tp, (num_stages - 1) * tp + rank % tp
        base = forward.__self__
        self.hidden_size, self.dtype = base.config.hidden_size, dtype
        self.min_tokens = MICROBATCH_MIN_TOKENS.get(base.device.type, MICROBATCH_MIN_TOKENS["cuda"])

    def microbatches(self, lengths: list[int]) -> list[range]:
        """A step's rows (of `lengths` new tokens) as one part per stage where each part keeps
        `min_tokens`, else fewer (one: the step whole)."""
        count = max(1, min(self.num_stages, len(lengths), sum(lengths) // self.min_tokens))
        return split_rows(lengths, count)

    def __call__(self, **kwargs) -> BaseModelOutputWithPast:
        return self.run_each([kwargs])[0]

    def run_each(
        self, calls: list[dict], layers: Optional[Callable[[dict], torch.Tensor]] = None
    ) -> list[BaseModelOutputWithPast]:
        """The forwards of a step's micro-batches (`calls`: each one's keyword arguments), in
        order: each goes on to the next stage as soon as it is computed, and the final hidden
        states come back to every rank after the last one. `layers(kwargs)`: a part's hidden
        states `[1, N_part, H]` through this stage's layers (a graph's replay, step_graphs.py:
        the sends and receives stay outside it); by default the stage's eager forward."""
        layers = layers or (lambda kwargs: self.forward(**kwargs).last_hidden_state)
        sends, outputs = [], []
        for kwargs in calls:
            if self.stage > 0:
                positions = kwargs["position_ids"]
                received = torch.empty(
                    1, positions.shape[1], self.hidden_size, dtype=self.dtype, device=positions.device
                )
                passing(dist.recv, received, src=self.previous)
                kwargs = {**kwargs, "input_ids": None, "inputs_embeds": received}
            hidden = layers(kwargs).contiguous()  # [1, N_part, H]
            if len(calls) > 1:  # a CUDA graph's output is overwritten by the next part's replay
                hidden = hidden.clone()
            if self.stage < self.num_stages - 1:
                sends.append(passing(dist.isend, hidden, dst=self.following))  # not waited: the next part runs
            outputs.append(hidden)
        for send in sends:
            passing(send.wait)
        for hidden in outputs:
            passing(dist.broadcast, hidden, src=self.last, group=self.column_group)
        return [BaseModelOutputWithPast(last_hidden_state=hidden) for hidden in outputs]


class PipelineHead(torch.nn.Module):
    """The LM head of a pipeline's stage: the last stage applies its own (`head`) and broadcasts
    the logits `[1, N, V]` to the same tp index of every stage, whose ranks hold no head
    (`head` None) and receive them. Every rank of the column calls it for the same rows, as
    every rank runs the same step."""

    def __init__(self, head: torch.nn.Module | None, vocab_size: int, stage: "PipelineStage"):
        super().__init__()
        self.head, self.vocab_size, self.stage = head, vocab_size, stage

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            logits = self.head(hidden).contiguous()
        else:
            logits = torch.empty(*hidden.shape[:-1], self.vocab_size, dtype=self.stage.dtype, device=hidden.device)
        passing(dist.broadcast, logits, src=self.stage.last, group=self.stage.column_group)
        return logits


def split_rows(lengths: list[int], count: int) -> list[range]:
    """Rows of `lengths` new tokens as `count` consecutive parts of about equal tokens, each
    holding a row at least."""
    cumulative = list(itertools.accumulate(lengths))
    bounds = [0]
    for part in range(1, count):
        end = next(row + 1 for row, done in enumerate(cumulative) if done * count >= cumulative[-1] * part)
        bounds.append(min(max(end, bounds[-1] + 1), len(lengths) - (count - part)))
    bounds.append(len(lengths))
    return [range(start, end) for start, end in zip(bounds, bounds[1:])]


def passing(transfer, *args, **kwargs):
    """One of a step's transfers between stages; a peer that is gone breaks the group."""
    try:
        return transfer(*args, **kwargs)
    except (RuntimeError, dist.DistError) as error:
        raise GroupBroken(f"a pipeline stage is gone: {error}") from None
