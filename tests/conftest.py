"""Shared fixtures: tiny random Llama pairs (fixed seeds) and the real SmolLM2 target."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY_VOCAB = 512


def tiny_llama(seed: int = 0, vocab_size: int = TINY_VOCAB, num_layers: int = 2, prepared: bool = True):
    """A tiny random Llama with grouped KV heads, on the kernels `load_model` sets up (unless not
    `prepared`: transformers' own)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec_core.kernels import prepare_model

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
    from specdec_core.kernels import prepare_model

    draft = type(model)(model.config).eval()
    draft.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return prepare_model(draft)


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama()


def tiny_profile():
    """What a tiny target without tokenizer cannot measure (profile.py): a fixed EASD tau_h."""
    from specdec_core.profile import CalibrationSettings, TargetProfile

    return TargetProfile(easd_tau_h=2.0, num_entropies=1, settings=CalibrationSettings())


@pytest.fixture(scope="session")
def tiny_engine(tiny_target):
    from specdec_core import SpeculativeEngine

    return SpeculativeEngine(tiny_target, None, perturbed_copy(tiny_target, 0.002), profile=lambda *_: tiny_profile())


@pytest.fixture(scope="session")
def smol_engine():
    """SmolLM2-135M-Instruct target (fp32) with the default int4 draft; converted once per
    machine into the specdec cache."""
    from specdec_core import DEFAULT_DRAFT, ModelSpec, SpeculativeEngine

    return SpeculativeEngine.from_specs(ModelSpec(), DEFAULT_DRAFT)


HEADS_PROMPTS = 12


@pytest.fixture(scope="session")
def trained_heads(tmp_path_factory, tiny_target):
    """Heads for the tiny target, trained on its own continuations of the prompts the tests ask
    (`train-heads` on a tiny random model), and their training log."""
    from specdec_core.train_heads import DistillSettings, TrainSettings, train_heads

    out = tmp_path_factory.mktemp("heads")
    prompts = [repeating_prompt(seed) for seed in range(HEADS_PROMPTS)]
    settings = TrainSettings(
        num_heads=3, own_lm_head=True, steps=80, batch_positions=64, learning_rate=1e-2, holdout=0.0, warmup_steps=5
    )
    heads, log = train_heads(tiny_target, prompts, out, DistillSettings(continuation_tokens=40, batch_size=5), settings)
    return heads.eval(), log, out, settings


@pytest.fixture(scope="session")
def heads_engine(trained_heads, tiny_target):
    from specdec_core import SpeculativeEngine

    draft = perturbed_copy(tiny_target, 0.002)
    return SpeculativeEngine(tiny_target, None, draft, profile=lambda *_: tiny_profile(), heads=trained_heads[0])


def repeating_prompt(seed: int, length: int = 24, vocab_size: int = TINY_VOCAB) -> list[int]:
    """A prompt with repeats, so prompt lookup finds matches."""
    generator = torch.Generator().manual_seed(seed)
    block = torch.randint(0, vocab_size, (length // 2,), generator=generator).tolist()
    return block + block


def target_rows(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """The target's log-softmax rows that scored each emitted token, from one plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0].float()
    return logits[len(prompt_ids) - 1 : -1].log_softmax(-1)


def assert_target_log_probs(log_probs, model, prompt_ids: list[int], token_ids: list[int], num_top: int) -> None:
    """`log_probs` (TokenLogProbs per emitted token) equal the target's log-softmax at each
    emitted token and its top `num_top` (1e-4)."""
    rows = target_rows(model, prompt_ids, token_ids)
    assert len(log_probs) == len(token_ids)
    for row, token, entry in zip(rows, token_ids, log_probs):
        assert entry.chosen.token_id == token
        assert abs(entry.chosen.log_prob - row[token].item()) < 1e-4
        top_values, top_ids = row.topk(num_top)
        assert [alt.token_id for alt in entry.top] == top_ids.tolist()
        assert all(abs(alt.log_prob - value) < 1e-4 for alt, value in zip(entry.top, top_values.tolist()))
