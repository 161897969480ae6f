"""Medusa-style multi-token heads on the target's last hidden state: head i (0-based) reads the
final hidden state at position t, which the target's LM head turns into token t + 1, and
predicts token t + 2 + i. Each head is `num_layers` residual blocks (x + SiLU(W x + b)) and its
own vocabulary projection.

`MedusaHeads.load` reads Medusa's published format: a `medusa_lm_head.pt` state dict of a
ModuleList of heads, `{head}.{layer}.linear.{weight,bias}` then `{head}.{num_layers}.weight`.
The head and layer counts come from the keys: the `medusa_num_heads` of published configs is not
always the number of heads their weights hold (Medusa's own loader overrides it). Medusa repeats
one block object per head (`[ResBlock] * num_layers`), so its layers share weights; here each
layer has its own parameters, loaded with the same values, which computes the same function.
`save` writes the same format, so heads trained here load in Medusa's code and back."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Union

import torch
from torch import nn

WEIGHTS_FILE = "medusa_lm_head.pt"
CONFIG_FILE = "config.json"


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # a fresh head starts as the identity: the target's own state

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + nn.functional.silu(self.linear(hidden))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.heads = nn.ModuleList(
            nn.Sequential(
                *(ResidualBlock(hidden_size) for _ in range(num_layers)),
                nn.Linear(hidden_size, vocab_size, bias=False),
            )
            for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[num_heads, *hidden.shape[:-1], V]` of every head at every position."""
        return torch.stack([head(hidden) for head in self.heads])

    @classmethod
    def load(cls, directory: Union[str, Path]) -> "MedusaHeads":
        """Heads from a directory holding `medusa_lm_head.pt`."""
        directory = Path(directory)
        weights_path = directory / WEIGHTS_FILE
        if not weights_path.exists():
            raise FileNotFoundError(f"no {WEIGHTS_FILE} in {directory}")
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
        key = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")
        layout = [key.match(name) for name in state]
        if not state or not all(layout):
            raise ValueError(f"{weights_path} is not a Medusa head state dict (keys like 0.0.linear.weight)")
        num_heads = 1 + max(int(match[1]) for match in layout)
        num_layers = max(int(match[2]) for match in layout)  # the last index is the vocabulary projection
        vocab_size, hidden_size = state[f"0.{num_layers}.weight"].shape
        heads = cls(hidden_size, vocab_size, num_heads, num_layers)
        heads.heads.load_state_dict(state)
        return heads

    def save(self, directory: Union[str, Path], base_model: str = "") -> None:
        """Write Medusa's format: `medusa_lm_head.pt` and the head counts in `config.json`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().cpu() for name, tensor in self.heads.state_dict().items()}
        torch.save(state, directory / WEIGHTS_FILE)
        config = {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "base_model_name_or_path": base_model,
        }
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
