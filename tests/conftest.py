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
def sharp_engine():
    """A tiny target whose next-token distributions are peaked, as a trained LM's are (random
    weights' are near uniform: a sampled token would almost never be the draft's guess, and a
    tree's top-1 path seldom the branch kept), with a draft close to it."""
    from specdec_core import SpeculativeEngine

    target = tiny_llama(seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)
    return SpeculativeEngine(target, None, perturbed_copy(target, 0.002))


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
    from specdec_core.tools.train_heads import DistillSettings, TrainSettings, train_heads

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
    return SpeculativeEngine(
        tiny_target, None, draft, profile=lambda *_: tiny_profile(), heads={"medusa": trained_heads[0]}
    )


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


class PublishedHydraBlock(torch.nn.Module):
    """Hydra's block as its checkpoints were made (hydra/model/hydra_heads): R x + SiLU(W x + b),
    R linear where the input carries `num_condition` token embeddings beside the state."""

    def __init__(self, hidden_size: int, num_condition: int = 0):
        super().__init__()
        in_features = hidden_size * (num_condition + 1)
        self.linear = torch.nn.Linear(in_features, hidden_size)
        self.res_connection = torch.nn.Linear(in_features, hidden_size) if num_condition else torch.nn.Identity()
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return self.res_connection(x) + self.act(self.linear(x))


class PublishedHydra(torch.nn.Module):
    """Hydra's grounded head module, whose state dict is its checkpoint (`hydra_lm_head.pt`): per
    head a first block over the state and the path's embeddings, then one block object repeated
    (shared weights), and a projection with a bias; Hydra++ (`prefix`, a one-layer base model)
    puts a dropout before each block and projection."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, prefix=None):
        super().__init__()
        if prefix is not None:
            self.prefix_embeding_layer = prefix  # sic, as Hydra names it
        drop = [torch.nn.Dropout(0.0)] if prefix is not None else []

        def head_blocks(head: int) -> list:
            later = PublishedHydraBlock(hidden_size)
            return [*drop, PublishedHydraBlock(hidden_size, head + 1), *([*drop, later] * (num_layers - 1))]

        self.hydra_mlp = torch.nn.ModuleList(torch.nn.Sequential(*head_blocks(head)) for head in range(num_heads))
        self.hydra_lm_head = torch.nn.ModuleList(
            torch.nn.Sequential(*drop, torch.nn.Linear(hidden_size, vocab_size))
            if drop
            else torch.nn.Linear(hidden_size, vocab_size)
            for _ in range(num_heads)
        )

    def save(self, directory, architecture: str) -> None:
        import json

        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), directory / "hydra_lm_head.pt")
        config = {"hydra_num_heads": len(self.hydra_mlp), "hydra_head_arch": architecture, "grounded_heads": True}
        (directory / "config.json").write_text(json.dumps({**config, "hidden_state_offset": 0}))


def hydra_from_medusa(heads, path_weight: float, seed: int = 0) -> PublishedHydra:
    """Hydra heads that compute Medusa `heads` (own projections, one block) from the state, plus
    `path_weight` times random weights on the path's embeddings (0: they ignore the path)."""
    hidden = heads.hidden_size
    hydra = PublishedHydra(hidden, heads.vocab_size, heads.num_heads, 1)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for head, (medusa, block, projection) in enumerate(zip(heads.heads, hydra.hydra_mlp, hydra.hydra_lm_head)):
            first = block[0]
            first.linear.weight.copy_(path_weight * torch.randn(first.linear.weight.shape, generator=generator))
            first.linear.weight[:, :hidden] = medusa[0].linear.weight
            first.linear.bias.copy_(medusa[0].linear.bias)
            first.res_connection.weight.zero_()
            first.res_connection.weight[:, :hidden] = torch.eye(hidden)
            first.res_connection.bias.zero_()
            projection.weight.copy_(medusa[1].weight)
            projection.bias.zero_()
    return hydra


@pytest.fixture(scope="session")
def hydra_engine(trained_heads, tiny_target, tmp_path_factory):
    """The tiny target with Hydra heads read from Hydra's format: the trained Medusa heads, each
    also reading the path it extends a little."""
    from specdec_core import SpeculativeEngine
    from specdec_core.target_heads import load_heads

    directory = tmp_path_factory.mktemp("hydra")
    hydra_from_medusa(trained_heads[0], path_weight=0.05).save(directory, "mlp")
    heads = load_heads(str(directory), "tiny", tiny_target)
    draft = perturbed_copy(tiny_target, 0.002)
    return SpeculativeEngine(tiny_target, None, draft, profile=lambda *_: tiny_profile(), heads=heads)


@pytest.fixture(scope="session")
def eagle3_engine(tmp_path_factory):
    """A tiny 8-layer target (its layers 2, 4 and 5 read) holding a random EAGLE-3 head in the
    authors' format beside random Medusa heads (`heads` drafts from those, `eagle3` from the
    layer), and a perturbed copy as draft model."""
    from eagle3_heads import write_eagle3

    from specdec_core import SpeculativeEngine
    from specdec_core.heads import MedusaHeads
    from specdec_core.target_heads import load_heads

    target = tiny_llama(seed=5, num_layers=8)
    medusa = MedusaHeads(target.config.hidden_size, target.config.vocab_size, 3, own_lm_head=False)
    with torch.no_grad():
        for parameter in medusa.parameters():
            parameter.normal_(0, 0.05, generator=torch.Generator().manual_seed(parameter.numel()))
    medusa.save(medusa_dir := tmp_path_factory.mktemp("medusa"))
    eagle3_dir = write_eagle3(tmp_path_factory.mktemp("eagle3"), target, "authors")
    heads = load_heads(f"{medusa_dir},{eagle3_dir}", "tiny", target)
    return SpeculativeEngine(
        target, None, perturbed_copy(target, 0.002), profile=lambda *_: tiny_profile(), heads=heads
    )
