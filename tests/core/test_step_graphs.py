"""Graphed steps (specdec_core/runtime/step_graphs.py) on the CPU: a "replay" runs the forward over the
graph's static buffers, so these tests check the buffers' bookkeeping (every input copied in, one
graph per shape, graphs dropped when the pool moves); tests/core/test_gpu.py records real CUDA
graphs."""

from __future__ import annotations

import pytest
import torch

from specdec_core import GenerationRequest, SpeculativeEngine
from specdec_core.runtime.kv_pool import KVPool
from specdec_core.runtime.model_runner import runner_of, use_step_graphs
from specdec_core.runtime.ragged_attention import LONG_ROW

from helpers.tiny_models import perturbed_copy, repeating_prompt, tiny_llama, tiny_profile


def request(drafter: str, max_tokens: int = 40) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=repeating_prompt(7),
        policy={"name": "greedy"},
        drafter={"name": drafter},
        num_draft_tokens=5,
        sampling={"max_tokens": max_tokens, "temperature": 0.0},
    )


def engines(initial_blocks: int = 64):
    """The same pair eager and graphed (the graphed pair's target pool of `initial_blocks`)."""
    target = tiny_llama(seed=5)
    draft = perturbed_copy(target, 0.002)
    eager = SpeculativeEngine(target, None, draft, profile=lambda *_: tiny_profile())
    graphed_target, graphed_draft = tiny_llama(seed=5), perturbed_copy(target, 0.002)
    runner_of(graphed_target.model).pool = KVPool(len(graphed_target.model.layers), num_blocks=initial_blocks)
    graphs = [use_step_graphs(model, record=False) for model in (graphed_target, graphed_draft)]
    graphed = SpeculativeEngine(graphed_target, None, graphed_draft, profile=lambda *_: tiny_profile())
    return eager, graphed, graphs


@pytest.mark.parametrize("drafter", ["none", "pld", "model"])
def test_graphed_steps_decode_as_eager_ones(drafter: str):
    """Greedy output with every step graphed equals eager target-only output; once a request
    has run (its first forward, eager, allocated the pool), one of the same shapes records no
    graph more."""
    eager, graphed, graphs = engines()
    target_only = eager.complete(request("none")).token_ids
    for _ in range(2):
        assert graphed.complete(request(drafter)).token_ids == target_only
    recorded = [len(step_graphs.graphs) for step_graphs in graphs]
    assert recorded[0] > 0 and (recorded[1] > 0) == (drafter == "model")
    assert graphed.complete(request(drafter)).token_ids == target_only
    assert [len(step_graphs.graphs) for step_graphs in graphs] == recorded


def test_a_pool_that_grows_drops_its_graphs_and_records_again():
    """A growable pool's storage moves when it grows (here: a second request reaching further
    than the first): the graphs written for the old storage are dropped, and decoding goes on
    right."""
    eager, graphed, graphs = engines(initial_blocks=3)
    pool = runner_of(graphed.target_model.model).pool
    for max_tokens in (16, 80):
        target_only = eager.complete(request("none", max_tokens)).token_ids
        assert graphed.complete(request("pld", max_tokens)).token_ids == target_only
    assert pool.num_blocks > 3 and graphs[0].storage == (pool.serial, pool.storage_version) and pool.storage_version > 1
    assert graphs[0].recorded > len(graphs[0].graphs)  # some were dropped


def test_prompt_chunks_run_eagerly():
    """A row longer than LONG_ROW (a prompt chunk) is not graphed."""
    _, _, graphs = engines()
    assert graphs[0].covers([LONG_ROW, 1]) and not graphs[0].covers([LONG_ROW + 1])
    assert not graphs[0].covers([16] * 65)


def test_a_replay_copies_every_input_in():
    """Two steps of the same shapes and different tokens, positions and histories: the second
    replays the first's graph and gives its own rows' states, not the first's."""
    from specdec_core.runtime.batching import forward_ragged
    from specdec_core.runtime.kv_pool import PagedKV

    model, reference = tiny_llama(seed=6), tiny_llama(seed=6)
    graphs = use_step_graphs(model, record=False)
    outputs = []
    for prompt_length, tokens in ((9, [3, 4, 5]), (12, [7, 8, 9])):  # both pad to 16 keys, 4 queries
        prompt = repeating_prompt(prompt_length, length=prompt_length)
        states = []
        for each in (model, reference):
            cache = PagedKV()
            with torch.inference_mode():
                forward_ragged(each, [cache], [prompt])
                states.append(forward_ragged(each, [cache], [tokens])[0])
        outputs.append(states)
    assert (
        len(graphs.graphs) == 2
    )  # the first forward runs eagerly (it allocates the pool); the second prompt, then both steps
    for graphed_states, eager_states in outputs:
        torch.testing.assert_close(graphed_states, eager_states, atol=1e-5, rtol=0)
