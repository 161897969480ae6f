"""Shared fixtures: tiny random Llama pairs (fixed seeds) and the real SmolLM2 target."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from helpers.published_hydra import hydra_from_medusa
from helpers.tiny_models import HEADS_PROMPTS, perturbed_copy, repeating_prompt, tiny_llama, tiny_profile

torch.set_num_threads(min(2, os.cpu_count() or 1))
# without CUDA, Triton kernels (kernels/paged_attention.py) run under Triton's interpreter; it must
# be on before triton is first imported, which decides at import and at each kernel's decoration
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[EXIT_STATUS] = int(exitstatus)


def pytest_unconfigure(config):
    """Leave with pytest's own status once it has reported, without the interpreter's
    finalization: there native threads of the serving stack (gRPC, Ray) have crashed the process
    after a passing session (a segfault, exit 139 in place of 0). A failing or empty session
    still exits 1 or 5."""
    if EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[EXIT_STATUS])


EXIT_STATUS = pytest.StashKey[int]()


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama()


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


@pytest.fixture(scope="session")
def trained_heads(tmp_path_factory, tiny_target):
    """Heads for the tiny target, trained on its own continuations of the prompts the tests ask
    (`train-heads` on a tiny random model), and their training log."""
    from specdec_core.tools.training.train_heads import DistillSettings, TrainSettings, train_heads

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


@pytest.fixture(scope="session")
def hydra_engine(trained_heads, tiny_target, tmp_path_factory):
    """The tiny target with Hydra heads read from Hydra's format: the trained Medusa heads, each
    also reading the path it extends a little."""
    from specdec_core import SpeculativeEngine
    from specdec_core.heads.loading import load_heads

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
    from specdec_core import SpeculativeEngine
    from specdec_core.heads.loading import load_heads
    from specdec_core.heads.medusa import MedusaHeads

    from helpers.eagle3_heads import write_eagle3

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
