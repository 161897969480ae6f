"""Pipeline parallelism: a target's decoder layers split into `pp` stages, each stage a
tensor-parallel group of `tp` ranks (parallel.py), so that a model too large for one node runs
on several (Llama-3.1-405B in bf16: 2 stages of 8 H100s). Global rank = stage * tp + tp_rank.

Every rank runs every forward (its worker's ranks apply the same operations in the same order,
deployments/tensor_parallel.py), each over its own layers and its own KV pool: stage 0 embeds
the tokens and runs its layers, then sends the hidden states `[1, N, H]` to the rank of the
same tp index in the next stage, which runs its layers on them, and so on; the last stage's
final hidden states (after the model's norm) are broadcast to every rank, which applies the LM
head itself, so that every rank holds the step's logits as with tensor parallelism alone. A
rank's rollback and tree commits touch its own layers' KV only, the same on every stage.

This is the pipeline one step at a time: while stage 1 computes, stage 0 waits for the next
operation. Filling it with the next step's rows is the step batcher's part (issue 35)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.modeling_outputs import BaseModelOutputWithPast

from .errors import GroupBroken


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """The decoder layers of `stage`: equal parts, the first stages one more where they do not
    divide (memory.plan sizes a rank by the largest)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"pp_size {num_stages} must be between 1 and the model's {num_layers} layers")
    size, extra = divmod(num_layers, num_stages)
    start = stage * size + min(stage, extra)
    return range(start, start + size + (stage < extra))


def make_stage(model: torch.nn.Module, stage: int, num_stages: int, tp: int) -> torch.nn.Module:
    """Turn `model` (holding `stage`'s layers only, shard_loader.load_shard) into that stage of
    a pipeline over the default process group: its base forward passes hidden states on. Every
    rank calls it at once (it makes the process groups of the stages' tp columns)."""
    base = model.model
    if stage < num_stages - 1:
        base.norm = torch.nn.Identity()  # the last stage normalizes the final hidden states
    # one group per tp index: that rank of every stage (each rank makes every group, in order)
    columns = [dist.new_group([s * tp + column for s in range(num_stages)]) for column in range(tp)]
    column = dist.get_rank() % tp
    base.forward = stage_forward(base.forward, stage, num_stages, tp, columns[column])
    return model


def stage_forward(forward, stage: int, num_stages: int, tp: int, column_group):
    """`forward` (a base model's) as one stage: its input from the previous stage's rank of the
    same tp index (stage 0: the tokens), its output to the next; returns the last stage's final
    hidden states `[1, N, H]` on every rank (`column_group`: this rank's tp index in every stage)."""
    rank = dist.get_rank()
    previous, following, last = rank - tp, rank + tp, (num_stages - 1) * tp + rank % tp
    base = forward.__self__
    hidden_size, dtype = base.config.hidden_size, next(base.parameters()).dtype

    def run(input_ids=None, inputs_embeds=None, position_ids=None, **kwargs) -> BaseModelOutputWithPast:
        if stage > 0:
            input_ids = None
            inputs_embeds = torch.empty(1, position_ids.shape[1], hidden_size, dtype=dtype, device=position_ids.device)
            passing(dist.recv, inputs_embeds, src=previous)
        output = forward(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids, **kwargs)
        hidden = output.last_hidden_state.contiguous()  # [1, N, H]
        if stage < num_stages - 1:
            passing(dist.send, hidden, dst=following)
        passing(dist.broadcast, hidden, src=last, group=column_group)
        return BaseModelOutputWithPast(last_hidden_state=hidden)

    return run


def passing(transfer, *args, **kwargs) -> None:
    """One of a step's transfers between stages; a peer that is gone breaks the group."""
    try:
        transfer(*args, **kwargs)
    except (RuntimeError, dist.DistError) as error:
        raise GroupBroken(f"a pipeline stage is gone: {error}") from None
