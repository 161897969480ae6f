"""Hydra's sequentially dependent heads (Ankner et al., 2024, "Hydra: Sequentially-Dependent Draft
Heads for Medusa Decoding"), read from their published format and run over a candidate tree
depth by depth.

Head d (0-based) predicts the token d + 2 positions after the last committed position from that
position's state and, where the heads are grounded, the embeddings of the tree's root and of
the d tokens on the path to the node it extends: a node's children depend on its own token, so
a tree is expanded one depth at a time (one call of head d over every node of depth d that has
children), unlike Medusa's independent heads. Hydra++ (`prefix-mlp`) first runs one decoder
layer of the target's architecture over the target's final hidden states, with a KV cache of its
own that every committed position enters once, in order; its output at the last committed
position is the heads' state (`mlp` heads read the target's hidden state itself).

The format is what Hydra's trainer saves: `hydra_lm_head.pt`, the state dict of its head module
(`hydra_mlp.{head}.{block}.{linear,res_connection}.{weight,bias}`, the first block of a
grounded head reading H * (head + 2) features with a linear residual, the others H with the
identity; `hydra_lm_head.{head}[.1].{weight,bias}`; Hydra++'s `prefix_embeding_layer.*`, sic),
and `config.json` (`hydra_head_arch`, `grounded_heads`, `hidden_state_offset`). Counts come from
the keys. Hydra repeats one block object for a head's later layers, so they share weights; here
each has its own parameters, loaded with the same values. The cross-attention and EAGLE-style
architectures and a `hidden_state_offset` other than 0 (heads on an earlier layer's states) are
refused with a message."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig

from ..planning.memory import kv_bytes_per_token
from ..runtime.batching import run_ragged
from ..runtime.kv_pool import PagedKV
from ..runtime.ragged_attention import use_ragged_attention
from ..trees.topologies import default_bank
from ..trees.tree import Topology
from .contract import HeadGuesses, root_probability

HYDRA_WEIGHTS_FILE = "hydra_lm_head.pt"
BLOCK_KEY = re.compile(r"^hydra_mlp\.(\d+)\.(\d+)\.(linear|res_connection)\.(weight|bias)$")
LM_HEAD_KEY = re.compile(r"^hydra_lm_head\.(\d+)\.(?:1\.)?(weight|bias)$")  # `.1.`: behind a dropout (prefix-mlp)
PREFIX = "prefix_embeding_layer."
ARCHITECTURES = ("mlp", "prefix-mlp")


class HydraBlock(nn.Module):
    """x -> R x + SiLU(W x + b): R the identity, or a linear map where x is wider (a grounded
    head's input: the state and the path's token embeddings)."""

    def __init__(self, in_features: int, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(in_features, hidden_size)
        self.res_connection = nn.Linear(in_features, hidden_size) if in_features != hidden_size else nn.Identity()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.res_connection(features) + nn.functional.silu(self.linear(features))


class HydraHeads(nn.Module):
    kind = "hydra"

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int,
        num_layers: int = 1,
        grounded: bool = True,
        prefix: Optional[nn.Module] = None,
    ):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.grounded = num_heads, num_layers, grounded
        self.blocks = nn.ModuleList(
            nn.Sequential(
                HydraBlock(hidden_size * (head + 2) if grounded else hidden_size, hidden_size),
                *(HydraBlock(hidden_size, hidden_size) for _ in range(num_layers - 1)),
            )
            for head in range(num_heads)
        )
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size) for _ in range(num_heads))
        self.prefix = prefix  # Hydra++'s decoder layer over the target's hidden states, or None

    def session(self, model: nn.Module) -> "HydraSession":
        return HydraSession(self, model)

    def cache_bytes_per_token(self) -> float:
        """A session's memory per committed position: Hydra++'s prefix layer's keys and values."""
        if self.prefix is None:
            return 0.0
        return kv_bytes_per_token(self.prefix.config, 1, next(self.prefix.parameters()).element_size())

    @torch.inference_mode()
    def expand(
        self, state: torch.Tensor, embed: nn.Module, root_token: int, tree: Topology
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The node tokens of `tree` (no deeper than the heads) after `root_token` and their
        probabilities, from the heads' state `[H]`, and each head's top-1 probability on the top-1
        path (as deep as the tree has it)."""
        device = state.device
        tokens = torch.zeros(tree.num_nodes + 1, dtype=torch.long, device=device)
        tokens[0] = root_token
        probs = torch.zeros(tree.num_nodes + 1, device=device)
        features = torch.cat([state[None], embed(tokens[:1])], -1) if self.grounded else state[None]
        row_of = torch.zeros(tree.num_nodes + 1, dtype=torch.long, device=device)  # node -> row of `features`
        chain, top_probs = tree.top1_path, []
        for head, (nodes, parents, ranks) in enumerate(tree.levels):
            nodes, parents, ranks = nodes.to(device), parents.to(device), ranks.to(device)
            expanded = parents.unique()  # sorted: the nodes with children at this depth
            logits = self.lm_heads[head](self.blocks[head](features[row_of[expanded]]))
            top = logits.float().softmax(-1).topk(int(ranks.max()) + 1, dim=-1)
            rows = torch.searchsorted(expanded, parents)
            tokens[nodes], probs[nodes] = top.indices[rows, ranks], top.values[rows, ranks]
            if len(top_probs) == head and head < len(chain) and chain[head] in expanded.tolist():
                top_probs.append(top.values[expanded.tolist().index(chain[head]), 0])
            if self.grounded:  # a node's features: its parent's and its own token's embedding
                features = torch.cat([features[row_of[parents]], embed(tokens[nodes])], -1)
            else:
                features = state[None].expand(len(nodes), -1)
            row_of[nodes] = torch.arange(len(nodes), device=device)
        return tokens[1:], probs[1:], torch.stack(top_probs) if top_probs else torch.zeros(0, device=device)

    @classmethod
    def load(cls, directory: Union[str, Path], target_config: PretrainedConfig) -> "HydraHeads":
        """Heads from a directory holding `hydra_lm_head.pt` and `config.json`; `target_config`
        shapes Hydra++'s prefix layer."""
        directory = Path(directory)
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        architecture = config.get("hydra_head_arch", "mlp")
        if architecture not in ARCHITECTURES:
            raise ValueError(
                f"Hydra head architecture {architecture!r} is not supported (only {', '.join(ARCHITECTURES)})"
            )
        if config.get("hidden_state_offset", 0):
            raise ValueError("Hydra heads on an earlier layer's states (hidden_state_offset != 0) are not supported")
        state = torch.load(directory / HYDRA_WEIGHTS_FILE, map_location="cpu", weights_only=True)
        blocks: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        lm_heads: dict[int, dict[str, torch.Tensor]] = {}
        prefix_state = {}
        for name, tensor in state.items():
            if match := BLOCK_KEY.match(name):
                blocks.setdefault(int(match[1]), {}).setdefault(int(match[2]), {})[f"{match[3]}.{match[4]}"] = tensor
            elif match := LM_HEAD_KEY.match(name):
                lm_heads.setdefault(int(match[1]), {})[match[2]] = tensor
            elif name.startswith(PREFIX):
                prefix_state[name[len(PREFIX) :]] = tensor
            else:
                raise ValueError(f"{directory / HYDRA_WEIGHTS_FILE} holds {name!r}, not a Hydra head weight")
        num_heads = len(lm_heads)
        if not num_heads or sorted(blocks) != list(range(num_heads)) or sorted(lm_heads) != list(range(num_heads)):
            raise ValueError(f"{directory / HYDRA_WEIGHTS_FILE}: every head needs blocks and an LM head")
        vocab_size, hidden_size = lm_heads[0]["weight"].shape
        first = blocks[0][min(blocks[0])]
        prefix = None
        if architecture == "prefix-mlp":
            prefix = prefix_layer(target_config, prefix_state)
        heads = cls(hidden_size, vocab_size, num_heads, len(blocks[0]), "res_connection.weight" in first, prefix)
        for head in range(num_heads):
            for layer, index in enumerate(sorted(blocks[head])):
                heads.blocks[head][layer].load_state_dict({k: v.float() for k, v in blocks[head][index].items()})
            heads.lm_heads[head].load_state_dict({k: v.float() for k, v in lm_heads[head].items()})
        return heads


def prefix_layer(target_config: PretrainedConfig, state: dict[str, torch.Tensor]) -> nn.Module:
    """Hydra++'s prefix: the target's base model with one decoder layer, fed hidden states (its
    token embedding, which nothing reads, is dropped)."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    model = AutoModel.from_config(config, attn_implementation="sdpa")
    model.embed_tokens = None
    # older transformers also saved the rotary frequencies, which the config gives
    read = {name: tensor.float() for name, tensor in state.items() if not name.endswith("rotary_emb.inv_freq")}
    model.load_state_dict({name: tensor for name, tensor in read.items() if not name.startswith("embed_tokens.")})
    use_ragged_attention(model)  # its cache is a PagedKV, as the target's
    return model


class HydraSession:
    """One request's Hydra heads: the prefix layer's cache (Hydra++) and the heads' state at the
    last committed position, with the target's own hidden state there (its LM head gives the root)."""

    def __init__(self, heads: HydraHeads, model: nn.Module):
        self.heads, self.model = heads, model
        self.cache = PagedKV() if heads.prefix is not None else None
        self.state: Optional[torch.Tensor] = None
        self.last_hidden: Optional[torch.Tensor] = None

    @torch.inference_mode()
    def advance(self, hidden: torch.Tensor, tokens: torch.Tensor, features: Optional[torch.Tensor]) -> None:
        if not len(hidden):
            return
        self.last_hidden = hidden[-1]
        if self.heads.prefix is None:
            self.state = hidden[-1]
            return
        states, _ = run_ragged(self.heads.prefix, [self.cache], [len(hidden)], inputs_embeds=hidden[None])
        self.state = states[0, -1]

    @torch.inference_mode()
    def guess(self, root_token: int, tree: str) -> Optional[HeadGuesses]:
        if self.state is None:
            return None
        topology = default_bank().limited(tree, self.heads.num_heads)
        tokens, probs, top_probs = self.heads.expand(
            self.state, self.model.get_input_embeddings(), root_token, topology
        )
        root_prob = root_probability(self.model, self.last_hidden, root_token)
        return HeadGuesses(topology, tokens, probs, top_probs.float(), root_prob)
