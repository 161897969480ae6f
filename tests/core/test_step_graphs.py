"""Graphed steps (specdec_core/runtime/step_graphs.py) on the CPU: a "replay" runs the forward over the
graph's static buffers, so these tests check the buffers' bookkeeping (every input copied in, one
graph per shape, graphs dropped when the pool moves); tests/core/test_gpu.py records real CUDA
graphs."""

from __future__ import annotations

import functools

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


def test_a_greedy_draft_chain_runs_its_followed_forwards_as_one_graph(monkeypatch):
    """A graphed paged draft (here under Triton's interpreter) runs each round's followed forwards,
    up to the nearest chain's end, as one chained graph (runtime/chained_steps.py), its later
    layouts advanced on the device. Requests of different block lengths decoded together and
    alone propose what the same draft proposes eagerly, round by round: the same tokens, so the
    same acceptance, and the target-only output."""
    from specdec_core.drafters import draft_rounds
    from specdec_core.loop.lockstep import complete_together
    from specdec_core.runtime.model_runner import use_paged_attention

    target = tiny_llama(seed=5)
    drafts = [perturbed_copy(target, 0.002) for _ in range(2)]
    for draft in drafts:
        use_paged_attention(draft)
    graphs = use_step_graphs(drafts[1], record=False)
    eager, chained = (SpeculativeEngine(target, None, draft, profile=lambda *_: tiny_profile()) for draft in drafts)
    steps_run = []
    run_chain = draft_rounds.run_chain
    monkeypatch.setattr(
        draft_rounds, "run_chain", lambda *arguments: steps_run.append(arguments[-1]) or run_chain(*arguments)
    )
    requests = [
        GenerationRequest(
            prompt_ids=repeating_prompt(seed, length=10 + 3 * seed),
            drafter={"name": "model", "params": {"adaptive": False}},
            num_draft_tokens=draft_tokens,
            sampling={"max_tokens": 7, "temperature": 0.0},
        )
        for seed, draft_tokens in enumerate((5, 3))
    ]
    alone = lambda engine, requests: [engine.complete(requests[0])]  # noqa: E731
    for decode in (alone, complete_together):
        steps_before = len(steps_run)
        expected = decode(eager, requests)
        assert len(steps_run) == steps_before  # the eager draft runs rounds
        for got, want in zip(decode(chained, requests), expected):
            assert got.token_ids == want.token_ids
            accepted = "spec_decode_num_accepted_tokens_per_pos"
            assert got.metrics[accepted] == want.metrics[accepted]
        # alone, after its first forward a chain of 5 drafts runs its other 4 as one graph;
        # together with a chain of 3, up to that one's end
        assert steps_run[steps_before] == (4 if decode is alone else 2)
    assert any(kind == ("chain", "argmax", 4) for kind, *_ in graphs.graphs)


def test_a_chained_graph_advances_each_rows_layout_on_the_device():
    """Three rows of different histories (one crossing a block boundary inside the chain): four
    chained forwards over the graph's buffers give the logits of four eager forwards, each fed
    the argmax of the one before, and leave the same KV entries behind."""
    from specdec_core.api.sampling import argmax
    from specdec_core.drafters import draft_rounds
    from specdec_core.runtime.batching import forward_ids, forward_ragged
    from specdec_core.runtime.chained_steps import chains_in_one_graph, run_chain
    from specdec_core.runtime.kv_pool import BLOCK_SIZE, PagedKV
    from specdec_core.runtime.model_runner import use_paged_attention

    models = [tiny_llama(seed=8), tiny_llama(seed=8)]
    for model in models:
        use_paged_attention(model)
    use_step_graphs(models[1], record=False)
    prompts = [
        repeating_prompt(seed, length=length) for seed, length in enumerate((BLOCK_SIZE - 2, 5, 2 * BLOCK_SIZE - 2))
    ]
    results = []
    with torch.inference_mode():
        for chained, model in enumerate(models):
            caches = [PagedKV() for _ in prompts]
            for cache, prompt in zip(caches, prompts):
                forward_ragged(model, [cache], [prompt])
            first = torch.tensor([[11, 12, 13]])
            if chained:
                assert chains_in_one_graph(model.model, 3)
                step = functools.partial(draft_rounds.argmax_step, model)
                logits, _ = run_chain(model.model, caches, {"tokens": first[0]}, step, "argmax", 4)
            else:
                assert not chains_in_one_graph(model.model, 3)
                rows, ids = [], first
                for _ in range(4):
                    hidden, _ = forward_ids(model, caches, [1, 1, 1], ids)
                    rows.append(model.lm_head(hidden[0]).float())
                    ids = argmax(rows[-1])[None]
                logits = torch.stack(rows)
            last = torch.tensor([[1, 2, 3]])  # one more forward reads every entry the chain wrote
            hidden, _ = forward_ids(model, caches, [1, 1, 1], last)
            results.append((logits, hidden, [cache.length for cache in caches]))
    (logits, hidden, lengths), (chained_logits, chained_hidden, chained_lengths) = results
    torch.testing.assert_close(chained_logits, logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chained_hidden, hidden, atol=1e-4, rtol=1e-4)
    assert chained_lengths == lengths == [len(prompt) + 5 for prompt in prompts]
