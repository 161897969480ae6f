"""EAGLE-3 checkpoints in the two published formats, read into an `Eagle3Draft` (eagle3_layer.py).

- **The EAGLE authors'** (`yuhuili/EAGLE3-*`): a flat Llama `config.json` of one layer
  (`architectures: ["LlamaForCausalLMEagle3"]`, `vocab_size` the target's, `draft_vocab_size`,
  optional `target_hidden_size`, the target layers as `eagle_aux_hidden_state_layer_ids` at the
  top or in `eagle_config`, else the default), weights `fc.weight`, `midlayer.*`, `norm.weight`,
  `lm_head.weight`, `d2t` (target id - draft id) and `t2d` (which target ids the draft has; not
  needed), and no embedding: the target's is used.
- **`speculators`** (`speculators_model_type: "eagle3"`, e.g. RedHatAI's): the layer's config in
  `transformer_layer_config`, the same fields beside it and `norm_before_residual`; the layer's
  weights under `layers.0.`, usually with `embed_tokens.weight`, a copy of the target's.

Layer ids name the input of that target layer (vLLM's and speculators' reading; SGLang's
configs name the output of the layer before). Normalizing the target features before `fc`
(`norm_before_fc`, `fc_norm`), feeding the normalized output back (`norm_output`) and drafts of
more than one layer are refused with a message; whether a head fits its target (the layers it
reads, its sizes) loading.py decides before loading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch
from transformers import LlamaConfig, PretrainedConfig

from .eagle3_layer import Eagle3Draft, default_aux_layers

CONFIG_FILE = "config.json"
AUTHORS_ARCHITECTURE = "LlamaForCausalLMEagle3"
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
LAYER_KEYS = (  # the layer's config as `save_eagle3` writes it
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
)


def save_eagle3(draft: Eagle3Draft, directory: Union[str, Path], base_model: str = "") -> None:
    """Write `draft` in the EAGLE authors' format (fp16 weights; its layer under `midlayer.`, the
    target layers it reads in `eagle_config`), which `load_eagle3` reads back."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in draft.state_dict().items():
        if name.startswith("rotary_emb."):
            continue
        name = "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
        tensors[name] = tensor.detach().cpu() if name == "d2t" else tensor.detach().cpu().half()
    draft_vocab = len(draft.d2t)
    t2d = torch.zeros(draft.config.vocab_size, dtype=torch.bool)
    t2d[torch.arange(draft_vocab) + draft.d2t.cpu()] = True
    save_file({**tensors, "t2d": t2d}, directory / "model.safetensors", metadata={"format": "pt"})
    config = draft.config
    written = {
        "architectures": [AUTHORS_ARCHITECTURE],
        "model_type": "llama",
        **{key: getattr(config, key) for key in LAYER_KEYS},
        "rope_theta": config.rope_parameters["rope_theta"],
        "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(draft.aux_layers)},
        "torch_dtype": "float16",
        "base_model_name_or_path": base_model,
    }
    (directory / CONFIG_FILE).write_text(json.dumps(written, indent=2) + "\n")


def is_eagle3(directory: Union[str, Path]) -> bool:
    """Whether `directory` holds an EAGLE-3 head in either format."""
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        return False
    config = json.loads(path.read_text())
    return config.get("speculators_model_type") == "eagle3" or AUTHORS_ARCHITECTURE in config.get("architectures", [])


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's weight files: its safetensors, else the authors' `pytorch_model.bin`."""
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    if (directory / "pytorch_model.bin").exists():
        return [directory / "pytorch_model.bin"]
    raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin in {directory}")


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in weight_files(directory):
        if file.suffix == ".safetensors":
            weights.update(load_file(file))
        else:
            weights.update(torch.load(file, map_location="cpu", weights_only=True))
    return weights


def read_config(directory: Path) -> tuple[dict, dict, Optional[tuple[int, ...]]]:
    """(the checkpoint's config, its layer's config, the target layers it reads or None for the
    default) in either format."""
    config = json.loads((directory / CONFIG_FILE).read_text())
    speculators = config.get("speculators_model_type") == "eagle3"
    layer_config = dict(config["transformer_layer_config"]) if speculators else dict(config)
    aux = config.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_config", {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return config, layer_config, tuple(aux) if aux else None


def load_eagle3(directory: Union[str, Path], target_config: PretrainedConfig) -> Eagle3Draft:
    """The EAGLE-3 head in `directory` for a target of `target_config` (ValueError, with the
    reason, where its format is one this loader does not read; whether it fits the target is
    loading.py's to say, before loading)."""
    directory = Path(directory)
    config, layer_config, aux = read_config(directory)
    for flag in UNSUPPORTED_FLAGS:
        if config.get(flag):
            raise ValueError(f"EAGLE-3 heads with {flag} are not supported")
    if layer_config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"EAGLE-3 drafts of {layer_config['num_hidden_layers']} layers are not supported (only 1)")
    if layer_config.get("model_type", "llama") != "llama":
        raise ValueError(f"EAGLE-3 layers of type {layer_config['model_type']!r} are not supported (only llama)")
    for key in ("architectures", "eagle_config", "draft_vocab_size", "base_model_name_or_path", "torch_dtype"):
        layer_config.pop(key, None)
    vocab = layer_config.get("vocab_size", target_config.vocab_size)
    draft_vocab = config.get("draft_vocab_size") or vocab
    aux_layers = aux or default_aux_layers(target_config.num_hidden_layers)
    weights = read_weights(directory)
    state = {}
    for name, tensor in weights.items():
        name = name.removeprefix("model.")
        if name == "t2d":
            continue  # the target ids in the draft vocabulary: d2t says it
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        state[name] = tensor
    state.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.long))  # no d2t: the whole vocabulary
    if "fc.weight" not in state:
        raise ValueError(f"{directory} is not an EAGLE-3 head: it has no fc.weight")
    draft = Eagle3Draft(
        LlamaConfig(**layer_config),
        state["fc.weight"].shape[1] // len(aux_layers),  # the target states it was trained on
        aux_layers,
        draft_vocab,
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        own_embedding="embed_tokens.weight" in state,
    )
    expected = {name for name in draft.state_dict() if not name.startswith("rotary_emb.")}
    unknown, missing = sorted(set(state) - expected), sorted(expected - set(state))
    if unknown or missing:
        raise ValueError(f"{directory} is not an EAGLE-3 head: unknown weights {unknown}, missing {missing}")
    draft.load_state_dict({name: tensor if name == "d2t" else tensor.float() for name, tensor in state.items()})
    if int((torch.arange(draft_vocab) + draft.d2t).max()) >= target_config.vocab_size:
        raise ValueError("the EAGLE-3 head's d2t maps draft tokens past the target's vocabulary")
    return draft.eval()
