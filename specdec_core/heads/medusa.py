"""Medusa-style multi-token heads on the target's last hidden state: head i (0-based) reads the
final hidden state at position t, which the target's LM head turns into token t + 1, and
predicts token t + 2 + i. Each head is `num_layers` residual blocks (x + SiLU(W x + b)) and a
vocabulary projection: its own, or the target's LM head (`own_lm_head=False`, Medusa's heads
with the projection shared, which makes heads small enough to ship: specdec_core/data/heads/).

`MedusaHeads.load` reads Medusa's published format: a `medusa_lm_head.pt` state dict of a
ModuleList of heads, `{head}.{layer}.linear.{weight,bias}` then `{head}.{num_layers}.weight`
(absent: the target's LM head projects). The head and layer counts come from the keys: the
`medusa_num_heads` of published configs is not always the number of heads their weights hold
(Medusa's own loader overrides it). Medusa repeats one block object per head
(`[ResBlock] * num_layers`), so its layers share weights; here each layer has its own
parameters, loaded with the same values, which computes the same function. `save` writes the
same format, so heads trained here load in Medusa's code and back."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch import nn

from ..trees.topologies import default_bank
from ..trees.tree import Topology
from .contract import HeadGuesses

WEIGHTS_FILE = "medusa_lm_head.pt"
CONFIG_FILE = "config.json"


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # a fresh head starts as the identity: the target's own state

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + nn.functional.silu(self.linear(hidden))


class MedusaSession:
    """Medusa's heads read only the last committed position's state."""

    def __init__(self, heads: "MedusaHeads", model: nn.Module):
        self.heads, self.lm_head = heads, model.lm_head
        self.last: Optional[torch.Tensor] = None

    def advance(self, hidden: torch.Tensor, tokens: torch.Tensor, features: Optional[torch.Tensor]) -> None:
        if len(hidden):
            self.last = hidden[-1]

    def guess(self, root_token: int, tree: str) -> Optional[HeadGuesses]:
        if self.last is None:
            return None
        return self.heads.guess(self.last, self.lm_head, root_token, default_bank().limited(tree, self.heads.num_heads))


class MedusaHeads(nn.Module):
    kind = "medusa"

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1, own_lm_head=True):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.own_lm_head = num_heads, num_layers, own_lm_head
        self.heads = nn.ModuleList(
            nn.Sequential(
                *(ResidualBlock(hidden_size) for _ in range(num_layers)),
                *([nn.Linear(hidden_size, vocab_size, bias=False)] if own_lm_head else []),
            )
            for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor, lm_head: Optional[Callable] = None) -> torch.Tensor:
        """Logits `[num_heads, *hidden.shape[:-1], V]` of every head at every position;
        `lm_head`: the target's, which projects heads that have none of their own."""
        if not self.own_lm_head and lm_head is None:
            raise ValueError("these heads share the target's LM head: pass it")
        project = (lambda states: states) if self.own_lm_head else lm_head
        return torch.stack([project(head(hidden)) for head in self.heads])

    def session(self, model: nn.Module) -> MedusaSession:
        return MedusaSession(self, model)

    def cache_bytes_per_token(self) -> float:
        """A session's memory per committed position: none (it keeps the last state only)."""
        return 0.0

    @torch.inference_mode()
    def guess(self, hidden: torch.Tensor, lm_head: Callable, root_token: int, tree: Topology) -> HeadGuesses:
        """The node tokens of `tree` (no deeper than the heads) at one final hidden state `[H]`
        (the target's, whose LM head gave `root_token`): node (r_1, .., r_d) is head d's r_d-th
        guess, whatever its parent (Medusa's candidate gather)."""
        state = hidden.reshape(1, -1)
        if self.own_lm_head:  # [1, T, H] into the target's LM head, as its forward does
            root_logits, head_logits = lm_head(state[None])[0, 0], self(state)[:, 0]
        else:  # one pass over the shared projection for the root and every head: it is the largest
            # weight of a guess, and on a CPU reading it once instead of per head saves most of the time
            logits = lm_head(torch.cat([state, *(head(state) for head in self.heads)])[None])[0]
            root_logits, head_logits = logits[0], logits[1:]
        top = head_logits.float().softmax(-1).topk(tree.top_k, dim=-1)
        root_prob = float(root_logits.float().softmax(-1)[root_token])
        nodes = tree.candidate_index.to(top.indices.device)
        tokens = top.indices[: tree.max_depth].reshape(-1)[nodes]
        node_probs = top.values[: tree.max_depth].reshape(-1)[nodes]
        return HeadGuesses(tree, tokens, node_probs, top.values[:, 0].contiguous(), root_prob)

    @classmethod
    def load(cls, directory: Union[str, Path]) -> "MedusaHeads":
        """Heads from a directory holding `medusa_lm_head.pt`."""
        directory = Path(directory)
        weights_path = directory / WEIGHTS_FILE
        if not weights_path.exists():
            raise FileNotFoundError(f"no {WEIGHTS_FILE} in {directory}")
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
        key = re.compile(r"^(\d+)\.(\d+)\.(linear\.)?(weight|bias)$")
        layout = [key.match(name) for name in state]
        if not state or not all(layout):
            raise ValueError(f"{weights_path} is not a Medusa head state dict (keys like 0.0.linear.weight)")
        num_heads = 1 + max(int(match[1]) for match in layout)
        num_layers = 1 + max(int(match[2]) for match in layout if match[3])
        own_lm_head = any(not match[3] for match in layout)
        hidden_size = state["0.0.linear.weight"].shape[1]
        vocab_size = state[f"0.{num_layers}.weight"].shape[0] if own_lm_head else 0
        heads = cls(hidden_size, vocab_size, num_heads, num_layers, own_lm_head)
        heads.heads.load_state_dict({name: tensor.float() for name, tensor in state.items()})
        return heads

    def save(self, directory: Union[str, Path], base_model: str = "", dtype: torch.dtype = torch.float32) -> None:
        """Write Medusa's format: `medusa_lm_head.pt` (in `dtype`) and the head counts in `config.json`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().to("cpu", dtype) for name, tensor in self.heads.state_dict().items()}
        torch.save(state, directory / WEIGHTS_FILE)
        config = {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "shares_base_lm_head": not self.own_lm_head,
            "base_model_name_or_path": base_model,
        }
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
