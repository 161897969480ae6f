"""A draft chain's one-token steps as one CUDA graph: R forwards of every chain in a round, each fed
what the one before produced (a draft model's argmax, drafters/draft_rounds.py; an EAGLE-3
layer's top token and output state, heads/eagle3_session.py), recorded once per shape and
replayed as one launch (step_graphs.py's `replay`, in the model's graph pool).

The host lays out the first of the R forwards; each later one's layout is the one before,
advanced on the device: a token's position and its row's keys one more, its write slot the next
in its row's blocks (reserved, with the block tables' width, for all R ahead). So R forwards cost
one layout, one copy into the graph's buffers and one launch, where R rounds paid each R times:
the host time between a draft's replays (docs/performance.md, "Where a step's time goes").

Only for a model whose short rows attend with the paged kernel: its layout (block tables, lengths,
write slots) advances by arithmetic, where SDPA's (gathered slots, a mask over them) would be
rebuilt. Vocabulary: B chains (one token each), N_p padded tokens, B_p padded rows."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .batching import step_inputs
from .kv_pool import PagedKV
from .model_runner import runner_of
from .ragged_attention import StepLayout, attention_backends, on_device, use_ragged_attention

# One step of a chain: `(step, carried) -> (carried, outputs)`. `step`: the base model's keyword
# arguments (positions, layout), advanced for this step; `carried`: what the step before produced
# for this one's tokens, `[N_p, ..]` each (the first step's given). Returns the next step's
# `carried` and this step's outputs, `[N_p, ..]` each.
ChainStep = Callable[[dict, dict], tuple[dict, tuple[torch.Tensor, ...]]]


def chains_in_one_graph(base_model: torch.nn.Module, rows: int) -> bool:
    """Whether `rows` one-token chains of `base_model` can run their steps as one graph: it replays
    graphs, its short rows take the paged kernel, the whole model is on this rank, it keeps no
    layer states for a head, and its pool is allocated (at a first, eager forward)."""
    runner = runner_of(base_model)
    graphs, pool = runner.graphs, runner.pool
    return (
        graphs is not None
        and runner.paged
        and runner.stage is None
        and runner.tp_ranks == 1  # an LM head split over ranks gathers through DTensor: not captured
        and not runner.kept_layers
        and pool is not None
        and pool.keys is not None
        and graphs.covers([1] * rows)
    )


@torch.inference_mode()
def run_chain(
    base_model: torch.nn.Module, caches: list[PagedKV], carried: dict, chain_step: ChainStep, name: str, steps: int
) -> tuple[torch.Tensor, ...]:
    """`steps` one-token forwards of each of `caches`' rows (`chains_in_one_graph`), the first fed
    `carried` (`[B, ..]` each, on the device), each next one what `chain_step` (named `name`, its
    graphs' key) carried from the one before. Returns `chain_step`'s outputs stacked, `[steps, B,
    ..]` each, on the device."""
    rows, device = len(caches), base_model.device
    use_ragged_attention(base_model)
    inputs = step_inputs(base_model, caches, [1] * rows, [None] * rows, {}, True, steps - 1)
    layout: StepLayout = inputs["ragged"]
    tokens = layout.write_slots.numel()
    chain = {
        "carried": {
            key: torch.cat([value, value.new_zeros(tokens - rows, *value.shape[1:])]) for key, value in carried.items()
        },
        # what a later step adds: 1 to each real token's position, to each real row's keys
        "grow_tokens": on_device(torch.arange(tokens) < rows, device, torch.long),  # [N_p]
        "grow_rows": on_device(torch.arange(layout.paged.seq_lens.numel()) < rows, device, torch.int32),  # [B_p]
    }
    with attention_backends(device):
        outputs = runner_of(base_model).graphs.replay(
            {**inputs, "chain": chain}, functools.partial(chained, chain_step, steps), ("chain", name, steps)
        )
    for cache in caches:
        cache.advance(steps)
    return tuple(output[:, :rows].clone() for output in outputs)  # a replay overwrites the graph's outputs


def chained(chain_step: ChainStep, steps: int, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The recorded function: `steps` steps over `inputs` (step_inputs' keyword arguments, and the
    `chain`'s first carried tensors and growths), advancing the layout in place."""
    step = {name: value for name, value in inputs.items() if name != "chain"}
    carried, grow_tokens, grow_rows = (inputs["chain"][part] for part in ("carried", "grow_tokens", "grow_rows"))
    outputs = []
    for index in range(steps):
        if index:
            advance(step, grow_tokens, grow_rows)
        carried, produced = chain_step(step, carried)
        outputs.append(produced)
    return tuple(torch.stack(parts) for parts in zip(*outputs))


def advance(step: dict, grow_tokens: torch.Tensor, grow_rows: torch.Tensor) -> None:
    """A one-token-a-row step's layout, in place, for the next token of each row: positions `[1,
    N_p]` and keys `[B_p]` one more where real, each real token's write slot its row's next
    (token b is row b's; a padding token keeps its scratch slot)."""
    layout: StepLayout = step["ragged"]
    paged, size = layout.paged, layout.pool.block_size
    positions = step["position_ids"]  # [1, N_p]
    positions += grow_tokens
    paged.seq_lens += grow_rows  # [B_p]
    where = positions[0]  # [N_p]
    tokens = torch.arange(where.numel(), device=where.device)  # [N_p]; N_p <= B_p, so each names a row
    slots = paged.block_tables[tokens, where // size].long() * size + where % size  # [N_p]
    layout.write_slots.copy_(torch.where(grow_tokens.bool(), slots, layout.write_slots))
