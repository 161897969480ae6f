"""Tiny random-weight Llamas with fixed seeds, drafts perturbed from them, the profile a tiny target
cannot measure, and prompts with repeats for prompt lookup."""

from __future__ import annotations

import torch

TINY_VOCAB = 512


def tiny_llama(seed: int = 0, vocab_size: int = TINY_VOCAB, num_layers: int = 2, prepared: bool = True):
    """A tiny random Llama with grouped KV heads, on the kernels `load_model` sets up (unless not
    `prepared`: transformers' own)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec_core.models.kernels import prepare_model

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    return prepare_model(model) if prepared else model


def perturbed_copy(model, scale: float, seed: int = 1):
    """A draft made by adding seeded Gaussian noise to the target's weights: `scale` sets how
    often the two agree."""
    from specdec_core.models.kernels import prepare_model

    draft = type(model)(model.config).eval()
    draft.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return prepare_model(draft)


def tiny_profile():
    """What a tiny target without tokenizer cannot measure (calibration/target_profile.py): a fixed EASD tau_h."""
    from specdec_core.calibration.profile_types import CalibrationSettings, TargetProfile

    return TargetProfile(easd_tau_h=2.0, num_entropies=1, settings=CalibrationSettings())


HEADS_PROMPTS = 12


def repeating_prompt(seed: int, length: int = 24, vocab_size: int = TINY_VOCAB) -> list[int]:
    """A prompt with repeats, so prompt lookup finds matches."""
    generator = torch.Generator().manual_seed(seed)
    block = torch.randint(0, vocab_size, (length // 2,), generator=generator).tolist()
    return block + block
