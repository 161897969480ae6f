"""Regional compilation (runtime/compiled_layers.py) on the CPU under inductor: one compile shared
by every layer, the attention left out of the graphs, the same tokens as the eager model."""

from __future__ import annotations

import os

import pytest
import torch
from pydantic import ValidationError

from specdec_core import GenerationRequest, SpeculativeEngine
from specdec_core.models.loader import ModelSpec
from specdec_core.runtime.compiled_layers import compile_layers, layers_compiled

from helpers.tiny_models import perturbed_copy, repeating_prompt, tiny_llama, tiny_profile

LAYERS = 8


@pytest.fixture(scope="module")
def compiled_pair(tmp_path_factory):
    """An 8-layer target and its perturbed draft, both compiled by layer, and how many graphs
    dynamo made for them."""
    from torch._dynamo.utils import counters

    cache = tmp_path_factory.mktemp("specdec_cache")
    target = tiny_llama(num_layers=LAYERS)
    draft = perturbed_copy(target, 0.002)
    before = counters["stats"]["unique_graphs"]
    for model in (target, draft):
        compile_layers(model, cache)
    engine = SpeculativeEngine(target, None, draft, profile=lambda *_: tiny_profile())
    target_only = engine.complete(request("none")).token_ids
    return engine, target_only, lambda: counters["stats"]["unique_graphs"] - before


def request(drafter: str) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=repeating_prompt(5),
        policy={"name": "greedy"},
        drafter={"name": drafter},
        num_draft_tokens=5,
        sampling={"max_tokens": 24, "temperature": 0.0, "ignore_eos": True},
    )


@pytest.mark.parametrize("drafter", ["pld", "model", "mla"])
def test_greedy_speculation_with_compiled_layers_equals_target_only(compiled_pair, drafter):
    engine, target_only, _ = compiled_pair
    assert engine.complete(request(drafter)).token_ids == target_only


def test_every_layer_shares_one_compile_and_attention_stays_out(compiled_pair):
    engine, _, unique_graphs = compiled_pair
    engine.complete(request("model"))  # verify rows of K + 1 tokens beside the draft's single ones
    assert all(layers_compiled(model) for model in (engine.target_model, engine.draft_model))
    # each layer compiled on its own would make two graphs (before and after its attention) per
    # layer and shape: 16 and more for 8 layers, where shared compiles make a few for all
    assert 0 < unique_graphs() < 2 * LAYERS


@torch.no_grad()
def test_compiled_layers_score_as_the_eager_model(tmp_path):
    model, reference = tiny_llama(num_layers=2), tiny_llama(num_layers=2)
    compile_layers(model, tmp_path)
    tokens = torch.tensor([repeating_prompt(3)])
    assert torch.allclose(model(tokens).logits, reference(tokens).logits, atol=1e-4, rtol=1e-4)


def test_inductor_keeps_its_kernels_in_the_cache_unless_told_otherwise(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor's first use writes
    compile_layers(tiny_llama(num_layers=1), tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    compile_layers(tiny_llama(num_layers=1), tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_one_compilation_at_a_time_and_never_int4():
    with pytest.raises(ValidationError, match="not both"):
        ModelSpec(compile=True, compile_layers=True)
    with pytest.raises(ValidationError, match="int4 runs eager"):
        ModelSpec(dtype="int4", compile_layers=True)
