"""The target's hidden states at chosen depths, kept from each forward: what an EAGLE-3 layer
reads (heads/eagle3_layer.py) beside the final ones, with no second target forward. A hook on each chosen
decoder layer keeps the layer's input, the residual stream after the layers before it."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..runtime.model_runner import runner_of


def keep_aux_states(model: torch.nn.Module, layers: Sequence[int]) -> None:
    """From now on every forward of `model` keeps the inputs of its decoder layers `layers`."""
    runner = runner_of(model.model)
    if runner.stage is not None:
        raise ValueError("an EAGLE-3 layer reads layers of every stage: not over a pipeline (pp_size 1 only)")
    if runner.kept_layers == tuple(layers):
        return
    if runner.kept_layers is not None:
        raise ValueError(f"this target already keeps the states of layers {list(runner.kept_layers)}")
    runner.kept_layers = tuple(layers)

    def keep(layer: int):
        def hook(module, args, kwargs):
            runner.kept_states[layer] = args[0] if args else kwargs["hidden_states"]

        return hook

    for layer in layers:
        model.model.layers[layer].register_forward_pre_hook(keep(layer), with_kwargs=True)
    runner.drop_graphs()  # recorded without the hooks


def aux_states(model: torch.nn.Module, num_positions: int) -> Optional[torch.Tensor]:
    """The kept states of the last forward's first `num_positions` positions, low to high
    `[1, N, A * H]`; None where the model keeps none."""
    runner = runner_of(model.model)
    if runner.kept_layers is None:
        return None
    return torch.cat([runner.kept_states[layer][:, :num_positions] for layer in runner.kept_layers], -1)
