"""Tiny EAGLE-3 heads for tests (test_eagle3.py, the served tests): a random head for a target,
saved in the EAGLE authors' format or in `speculators`', as each publishes them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdec_core.heads.eagle3_layer import default_aux_layers

DRAFT_VOCAB = 96  # of the tiny target's 512


def write_eagle3(directory: Path, target, layout: str, seed: int = 0) -> Path:
    """A random EAGLE-3 head for `target` in `layout` ("authors" or "speculators"), saved as
    published: its layer under `midlayer.` or `layers.0.`, a d2t over a random draft vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    config = target.config
    hidden, vocab, heads, kv_heads = config.hidden_size, config.vocab_size, 4, 2
    head_dim = hidden // heads

    def weight(*shape):
        return torch.randn(*shape, generator=generator) * 0.2

    def norm():
        return 1 + 0.1 * torch.randn(hidden, generator=generator)

    layer = {
        "input_layernorm.weight": norm(),
        "hidden_norm.weight": norm(),
        "post_attention_layernorm.weight": norm(),
        "self_attn.q_proj.weight": weight(heads * head_dim, 2 * hidden),
        "self_attn.k_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "self_attn.v_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        "mlp.gate_proj.weight": weight(128, hidden),
        "mlp.up_proj.weight": weight(128, hidden),
        "mlp.down_proj.weight": weight(hidden, 128),
    }
    used = torch.randperm(vocab, generator=generator)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    prefix = "midlayer." if layout == "authors" else "layers.0."
    tensors = {
        "fc.weight": weight(hidden, 3 * hidden),
        **{prefix + name: tensor for name, tensor in layer.items()},
        "norm.weight": norm(),
        "lm_head.weight": weight(DRAFT_VOCAB, hidden) * 3,
        "d2t": used - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    layer_config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": 1024,
        "vocab_size": vocab,
    }
    if layout == "authors":
        written = {**layer_config, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB}
    else:
        tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
        written = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer_config,
            "draft_vocab_size": DRAFT_VOCAB,
            "norm_before_residual": False,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": list(default_aux_layers(config.num_hidden_layers)),
            "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}},
        }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(written))
    return directory
