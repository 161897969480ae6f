"""EAGLE-3 layers (specdec_core/heads/eagle3_layer.py, eagle3_checkpoint.py, eagle3_session.py): a tiny random
head written by the test in the EAGLE authors' format and in `speculators`' loads; its guesses
after every commit (chains, trees, rollbacks) are a plain re-implementation's, computed from the
checkpoint's tensors by their published names over a fresh target forward; heads that do not fit
the target are refused; and greedy decoding over its drafts is target-only greedy decoding."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec_core.api.sampling import SamplingParams
from specdec_core.heads.loading import load_heads_from
from specdec_core.policies import make_policy
from specdec_core.target.scorer import TargetScorer
from specdec_core.trees.topologies import default_bank

from helpers.eagle3_heads import write_eagle3
from helpers.tiny_models import repeating_prompt, tiny_llama

NUM_LAYERS = 8  # the default target layers read: 2, 4 and 5


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=5, num_layers=NUM_LAYERS)


def rms_norm(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x, positions, theta=10000.0):
    """Llama's rotate-half RoPE of `x` `[heads, n, d]` at `positions` `[n]`."""
    half = x.shape[-1] // 2
    angles = positions[:, None].float() * theta ** (-torch.arange(half).float() / half)  # [n, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def reference_layer(w: dict, prefix: str, embeds, hidden, eps):
    """EAGLE-3's layer from its published tensors, causal over `n` positions from 0 (no cache)."""
    n = len(embeds)
    x = torch.cat(
        [
            rms_norm(embeds, w[prefix + "input_layernorm.weight"], eps),
            rms_norm(hidden, w[prefix + "hidden_norm.weight"], eps),
        ],
        -1,
    )
    q = (x @ w[prefix + "self_attn.q_proj.weight"].T).view(n, 4, -1).transpose(0, 1)
    k = (x @ w[prefix + "self_attn.k_proj.weight"].T).view(n, 2, -1).transpose(0, 1)
    v = (x @ w[prefix + "self_attn.v_proj.weight"].T).view(n, 2, -1).transpose(0, 1)
    positions = torch.arange(n)
    q, k = rotate(q, positions), rotate(k, positions)
    k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    scores = (q @ k.transpose(1, 2)) / q.shape[-1] ** 0.5 + torch.full((n, n), float("-inf")).triu(1)
    attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1) @ w[prefix + "self_attn.o_proj.weight"].T
    h = hidden + attended
    m = rms_norm(h, w[prefix + "post_attention_layernorm.weight"], eps)
    gate, up = m @ w[prefix + "mlp.gate_proj.weight"].T, m @ w[prefix + "mlp.up_proj.weight"].T
    return h + (torch.nn.functional.silu(gate) * up) @ w[prefix + "mlp.down_proj.weight"].T


@torch.no_grad()
def reference_chain(directory: Path, layout: str, target, committed: list[int], root: int, depth: int) -> list[int]:
    """The greedy chain an EAGLE-3 head drafts after `committed` tokens (positions 0..n-1) and the
    root token, recomputed from scratch: the target's states at its layers' inputs (2, 4, 5)."""
    w, eps = load_file(directory / "model.safetensors"), target.config.rms_norm_eps
    prefix = "midlayer." if layout == "authors" else "layers.0."
    states = target(torch.tensor([committed]), output_hidden_states=True).hidden_states
    g = torch.cat([states[2][0], states[4][0], states[5][0]], -1) @ w["fc.weight"].T  # [n, H]
    tokens, hidden = [*committed[1:], root], g
    embed = target.get_input_embeddings()
    chain = []
    for _ in range(depth):
        out = reference_layer(w, prefix, embed(torch.tensor(tokens)), hidden, eps)
        draft_id = int((rms_norm(out[-1], w["norm.weight"], eps) @ w["lm_head.weight"].T).argmax())
        token = draft_id + int(w["d2t"][draft_id])
        chain.append(token)
        tokens, hidden = [*tokens, token], torch.cat([hidden, out[-1:]])
    return chain


@pytest.mark.parametrize(("layout", "graphed"), [("authors", False), ("speculators", False), ("authors", True)])
def test_a_published_eagle3_head_guesses_what_its_reference_drafts_after_every_commit(
    tmp_path, target, layout, graphed
):
    """`graphed`: the layer on graphs and the paged kernel (the CPU's stand-in, the kernel under
    Triton's interpreter), so that each chain guess is one chained graph (chained_steps.py)."""
    from specdec_core.runtime.model_runner import runner_of

    directory = write_eagle3(tmp_path / layout, target, layout)
    draft = load_heads_from(str(directory), target)
    assert draft.aux_layers == (2, 4, 5) and (draft.embed_tokens is not None) == (layout == "speculators")
    if graphed:
        runner_of(draft).paged = True
        graphs = runner_of(draft).use_graphs(record=False)
    scorer = TargetScorer(target, {"eagle3": draft})
    prompt = repeating_prompt(0, length=12)
    scorer.reset(prompt, make_policy("greedy"), SamplingParams(temperature=0.0), "eagle3")
    committed, root = prompt[:-1], prompt[-1]
    for keep, block in ((3, [9, 40, 7, 88]), (1, [5, 6]), (4, [17, 2, 99, 31, 64])):
        guesses = scorer.guess(root, "chain_4")
        assert guesses.tokens.tolist() == reference_chain(directory, layout, target, committed, root, 4)
        # a chain's one-token forwards over the cache guess what the depth-by-depth tree path does
        by_depth = scorer.heads_session.guess_tree(root, default_bank().get("chain_4"))
        assert torch.equal(by_depth.tokens, guesses.tokens)
        assert torch.allclose(by_depth.node_probs, guesses.node_probs) and len(guesses.node_probs) == 4
        assert torch.allclose(by_depth.top_probs, guesses.top_probs) and by_depth.root_prob == guesses.root_prob
        scored = [root, *block]
        scorer.score(scored)
        scorer.commit_scored(keep, [])
        committed, root = committed + scored[:keep], 77 + keep  # the verifier's correction, any token
    for tree_name in ("mc_sim_7b_63", "dynamic_k4_d5_n12"):  # a fixed tree and EAGLE-2's
        guesses = scorer.guess(root, tree_name)
        tree = guesses.tree
        on_top1_path = guesses.tokens[[node - 1 for node in tree.top1_path[1:]]].tolist()
        assert len(on_top1_path) >= 3
        assert on_top1_path == reference_chain(directory, layout, target, committed, root, len(on_top1_path))
    assert tree.num_nodes == 12 and tree.max_depth <= 5
    if graphed:
        chained = [kind for kind, *_ in graphs.graphs if kind != "step"]  # one per width of the block tables
        assert chained and set(chained) == {("chain", "eagle3", 4)}


def test_an_eagle3_layer_runs_as_its_target_does():
    """On the paged kernel and graphs where its target is (`Eagle3Draft.run_as`)."""
    from specdec_core.runtime.model_runner import runner_of, use_paged_attention, use_step_graphs
    from specdec_core.tools.measuring.eagle3_cost import random_eagle3

    plain, on_graphs = tiny_llama(seed=5, num_layers=NUM_LAYERS), tiny_llama(seed=5, num_layers=NUM_LAYERS)
    use_paged_attention(on_graphs)
    use_step_graphs(on_graphs, record=False)
    eager, graphed = (runner_of(random_eagle3(target)) for target in (plain, on_graphs))
    assert not eager.paged and eager.graphs is None
    assert graphed.paged and graphed.graphs is not None and not graphed.graphs.record


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": 32}, "target states of size 64; the target's hidden size is 32"),
        ({"vocab_size": 200}, "the vocabulary of the EAGLE-3 layer is 512; the target's is 200"),
        ({"num_hidden_layers": 4}, r"reads target layers \[2, 4, 5\]; the target keeps 4 layers"),
    ],
)
def test_a_head_for_another_target_is_refused_with_the_reason(tmp_path, target, change, message):
    """From its files, before loading (heads/loading.py); loading onto such a target is refused too."""
    from specdec_core.heads.loading import TargetShape, refusal

    directory = write_eagle3(tmp_path, target, "speculators")
    other = copy.deepcopy(target.config)
    for name, value in change.items():
        setattr(other, name, value)
    assert refusal(str(directory), TargetShape.of_config(target.config)) is None
    assert re.search(message, refusal(str(directory), TargetShape.of_config(other)))
    shorter = tiny_llama(seed=5, num_layers=4)
    with pytest.raises(ValueError, match=r"reads target layers \[2, 4, 5\]; the target keeps 4 layers"):
        load_heads_from(str(directory), shorter)


def test_a_format_variant_it_does_not_read_is_refused(tmp_path, target):
    from specdec_core.heads.eagle3_checkpoint import load_eagle3

    directory = write_eagle3(tmp_path, target, "speculators")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "norm_before_fc": True}))
    with pytest.raises(ValueError, match="norm_before_fc are not supported"):
        load_eagle3(directory, target.config)
    directory = write_eagle3(tmp_path / "extra", target, "authors")
    tensors = load_file(directory / "model.safetensors")
    save_file({**tensors, "midlayer.extra.weight": torch.ones(2)}, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"is not an EAGLE-3 head: unknown weights \['layers.0.extra.weight'\]"):
        load_eagle3(directory, target.config)


@pytest.mark.parametrize(
    "drafter",
    [
        {"name": "eagle3"},
        {"name": "eagle3", "params": {"dynamic": True, "nodes": 24}},
        {"name": "eagle3", "params": {"tree": "mc_sim_7b_63"}},  # a fixed tree
    ],
)
def test_greedy_decoding_over_eagle3_drafts_is_target_only_greedy(eagle3_engine, drafter):
    from specdec_core import GenerationRequest

    for seed in (0, 1):
        requests = [
            GenerationRequest(prompt_ids=repeating_prompt(seed), drafter=chosen, sampling={"max_tokens": 24})
            for chosen in ({"name": "none"}, drafter)
        ]
        reference, drafted = (eagle3_engine.complete(request) for request in requests)
        assert drafted.token_ids == reference.token_ids
        assert drafted.metrics["mean_acceptance_length"] >= 1.0
        assert drafted.metrics["tree_steps"]


def test_the_eagle3_drafter_needs_an_eagle3_layer_on_the_target(tiny_engine, heads_engine):
    from specdec_core import GenerationRequest
    from specdec_core.api.errors import SpecdecError

    request = GenerationRequest(prompt_ids=repeating_prompt(0), drafter={"name": "eagle3"})
    for engine, has in ((tiny_engine, "none"), (heads_engine, "medusa")):
        with pytest.raises(SpecdecError, match=f"needs an EAGLE-3 layer on the target; it has {has}"):
            engine.complete(request)


def test_a_target_holds_medusa_heads_and_an_eagle3_layer_and_each_drafter_reads_its_own(eagle3_engine, tmp_path):
    """`heads` drafts from the Medusa heads, `eagle3` from the layer, on one target; both give
    target-only greedy output; two sets of one kind are refused."""
    from specdec_core import GenerationRequest
    from specdec_core.heads.loading import load_heads

    assert list(eagle3_engine.heads) == ["medusa", "eagle3"]
    prompt = repeating_prompt(2)
    none = GenerationRequest(prompt_ids=prompt, drafter={"name": "none"}, sampling={"max_tokens": 24})
    reference = eagle3_engine.complete(none).token_ids
    for drafter, kind in (("heads", "medusa"), ("eagle3", "eagle3")):
        request = GenerationRequest(prompt_ids=prompt, drafter={"name": drafter}, sampling={"max_tokens": 24})
        assert eagle3_engine.frontend.prepare(request).heads_kind == kind
        assert eagle3_engine.complete(request).token_ids == reference
    eagle3_engine.heads["medusa"].save(first := tmp_path / "first")
    eagle3_engine.heads["medusa"].save(second := tmp_path / "second")
    with pytest.raises(ValueError, match="one set of Medusa or Hydra heads and one EAGLE-3 layer"):
        load_heads(f"{first},{second}", "tiny", eagle3_engine.target_model)


@pytest.mark.parametrize("given", [False, True], ids=["its own layer", "the engine's layer"])
def test_the_eagle3_cost_report_times_each_call_at_its_size(given):
    from specdec_core.tools.measuring.eagle3_cost import eagle3_costs, random_eagle3

    target = tiny_llama(seed=6, num_layers=NUM_LAYERS)
    rows = eagle3_costs(target, random_eagle3(target) if given else None, prompt_tokens=32, repeats=1)
    sizes = {row["call"]: row["tokens"] for row in rows}
    tree = sizes["dynamic tree guess (k 10, depth 8)"]
    assert 10 < tree <= 59 and sizes["target verify, dynamic tree"] == tree + 1
    assert (sizes["draft step"], sizes["chain guess, 4 steps"], sizes["target verify, chain of 4"]) == (1, 4, 5)
    assert all(row["ms"] > 0 for row in rows)
