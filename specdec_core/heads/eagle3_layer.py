"""EAGLE-3's draft layer (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test") on the target worker, beside the heads: one decoder layer
that reads the target's own hidden states from three depths and drafts token by token.

Vocabulary: H the draft's hidden size (the target's, for every published head), Ht the target's,
A the number of target layers read (3), V the target's vocabulary, Vd the draft's (its LM head's
rows; draft id i is target id i + d2t[i]), N a forward's packed positions.

The target's features at position t are the inputs of its layers `aux_layers` (by default 2, L // 2
and L - 3 of its L layers: the residual stream after layers 1, L // 2 - 1 and L - 4), `[A * Ht]`
concatenated low to high; `fc` maps them to `[H]`. The layer's input at position t pairs a
hidden state g_t with the embedding of token t + 1 (the target's own embedding unless the
checkpoint has one): x = [input_layernorm(e_{t+1}); hidden_norm(g_t)] `[2H]` into q/k/v, the
residual g_t (hidden_norm(g_t) with `norm_before_residual`), then the MLP; its output o_t, after
`norm` and the LM head, predicts token t + 2. The first draft step's g is fc(features); each later
step's g is the layer's own output at the parent position (not through fc again). The layer's
keys and values live in a KV pool of its own (batching.py's ragged forward), one entry per
committed position (eagle3_session.py)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from ..planning.memory import kv_bytes_per_token
from ..runtime.model_runner import runner_of
from ..runtime.ragged_attention import RAGGED_ATTENTION, paged_kernel_misfit, register_ragged_attention
from .eagle3_session import Eagle3Session

# the deepest chain or tree an EAGLE-3 layer drafts per step (its `num_heads` for the heads drafter)
MAX_DRAFT_DEPTH = 8


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs EAGLE-3 reads when its checkpoint names none."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Layer(nn.Module):
    """The draft decoder layer; its checkpoint names (`self_attn.q_proj`, `hidden_norm`, ..) are
    the published ones under `midlayer.` or `layers.0.`."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool = False):
        super().__init__()
        hidden = config.hidden_size
        self.norm_before_residual = norm_before_residual
        self.self_attn = LlamaAttention(config, layer_idx=0)
        bias = config.attention_bias
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        # q, k and v read the embedding and the hidden state side by side
        self.self_attn.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=bias)
        self.self_attn.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, **attention) -> torch.Tensor:
        """`embeds`, `hidden` `[1, N, H]` each: the layer's output `[1, N, H]` (before `norm`)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        inputs = torch.cat([self.input_layernorm(embeds), normed], -1)  # [1, N, 2H]
        attended, _ = self.self_attn(inputs, position_embeddings=position_embeddings, attention_mask=None, **attention)
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    """The draft module: `fc`, the layer, `norm`, the LM head over the draft vocabulary and
    `d2t`. As a base model of batching.py's ragged forward it takes `inputs_embeds` `[1, N, 2H]`:
    each position's token embedding and hidden state side by side."""

    kind = "eagle3"

    def __init__(
        self,
        config: LlamaConfig,
        target_hidden_size: int,
        aux_layers: tuple[int, ...],
        draft_vocab_size: int,
        norm_before_residual: bool = False,
        own_embedding: bool = False,
    ):
        super().__init__()
        config._attn_implementation = RAGGED_ATTENTION
        register_ragged_attention()
        self.config, self.aux_layers = config, tuple(aux_layers)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(aux_layers) * target_hidden_size, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config, norm_before_residual)])  # a pool of one layer
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # [Vd] target id - draft id
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embedding else None
        self.rotary_emb = LlamaRotaryEmbedding(config)

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int) -> "Eagle3Draft":
        """A fresh layer shaped as the published heads are for a target of `target_config`: its
        hidden size, heads and MLP, reading its default layers."""
        layer = LlamaConfig(
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_attention_heads=target_config.num_attention_heads,
            num_key_value_heads=target_config.num_key_value_heads,
            vocab_size=target_config.vocab_size,
            max_position_embeddings=target_config.max_position_embeddings,
            rms_norm_eps=target_config.rms_norm_eps,
        )
        aux_layers = default_aux_layers(target_config.num_hidden_layers)
        return cls(layer, target_config.hidden_size, aux_layers, draft_vocab_size)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def num_heads(self) -> int:
        """The heads drafter's depth limit: an EAGLE-3 layer drafts as deep as it is asked."""
        return MAX_DRAFT_DEPTH

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, **attention) -> BaseModelOutputWithPast:
        """Outputs `[1, N, H]` (before `norm`) of the packed positions `inputs_embeds` `[1, N, 2H]`."""
        embeds, hidden = inputs_embeds.chunk(2, -1)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for unused in ("use_cache", "attention_mask"):  # the ragged layout masks
            attention.pop(unused, None)
        output = self.layers[0](embeds, hidden, position_embeddings, **attention)
        return BaseModelOutputWithPast(last_hidden_state=output)

    def draft_logits(self, output: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary `[.., Vd]` of outputs `[.., H]`."""
        return self.lm_head(self.norm(output))

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def run_as(self, model: nn.Module) -> "Eagle3Draft":
        """Its steps run as the target `model`'s do: on the paged kernel, and replaying CUDA graphs
        (a chain guess one graph, runtime/chained_steps.py), where the target's do."""
        target, mine = runner_of(model.model), runner_of(self)
        mine.paged = target.paged and paged_kernel_misfit(self) is None
        if target.graphs is not None:
            mine.use_graphs(target.graphs.record)
        return self

    def session(self, model: nn.Module) -> Eagle3Session:
        return Eagle3Session(self, model)

    def cache_bytes_per_token(self) -> float:
        """A session's memory per committed position: the layer's keys and values."""
        return kv_bytes_per_token(self.config, 1, self.fc.weight.element_size())
