"""Candidate trees (specdec_core/trees/tree.py): the buffers of a small hand-checked tree, validation,
and the shipped topologies' internal consistency."""

from __future__ import annotations

import re

import pytest
import torch

from specdec_core.api.errors import SpecdecError
from specdec_core.api.sampling import SamplingParams
from specdec_core.loop.stage_types import DraftBlock, TargetBlock
from specdec_core.policies import make_policy
from specdec_core.trees.topologies import DEFAULT_TREE, NAMED_TREES, default_bank
from specdec_core.trees.tree import Topology, TopologyBank
from specdec_core.trees.tree_verify import kept_chain


def test_buffers_of_a_small_tree_equal_the_hand_computed_ones():
    # root 0; nodes in (depth, ranks) order: 1 (0,), 2 (1,), 3 (2,), 4 (0, 0), 5 (0, 1), 6 (1, 0)
    tree = Topology.build("small", [[0], [1], [0, 0], [0, 1], [1, 0], [2]])
    assert tree.paths == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0))
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2]
    sees = {node: set(torch.nonzero(row).flatten().tolist()) for node, row in enumerate(tree.attention_mask)}
    assert sees == {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 3}, 4: {0, 1, 4}, 5: {0, 1, 5}, 6: {0, 2, 6}}
    assert tree.top_k == 3
    assert tree.candidate_index.tolist() == [0, 1, 2, 3, 4, 3]  # (depth - 1) * top_k + last rank
    # one row per leaf, root first, padded with -1
    assert tree.retrieve_indices.tolist() == [[0, 3, -1], [0, 1, 4], [0, 1, 5], [0, 2, 6]]
    assert (tree.num_nodes, tree.max_depth) == (6, 2)


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([[0], [0, 0], [1, 0]], "no parent"),
        ([[0], [0]], "twice"),
        ([[0], [-1]], "ranks >= 0"),
        ([[0], []], "non-empty"),
        ([], "at least one path"),
    ],
)
def test_a_malformed_tree_is_refused_with_a_message(paths, message):
    with pytest.raises(ValueError, match=message):
        Topology.build("bad", paths)


@pytest.mark.parametrize("name", sorted(NAMED_TREES))
def test_shipped_trees_are_consistent(name):
    """Every buffer agrees with the parent links: a node sees exactly its ancestors and itself,
    its depth is its parent's + 1, retrieve rows walk parent to child, and every node lies on
    some row."""
    tree = default_bank().get(name)
    for node in range(tree.num_nodes + 1):
        ancestors, walk = {node}, node
        while tree.parents[walk] >= 0:
            walk = int(tree.parents[walk])
            ancestors.add(walk)
        assert set(torch.nonzero(tree.attention_mask[node]).flatten().tolist()) == ancestors
        if node:
            assert tree.depths[node] == tree.depths[tree.parents[node]] + 1
    on_rows = set()
    for row in tree.retrieve_indices.tolist():
        nodes = [node for node in row if node >= 0]
        assert nodes[0] == 0 and all(tree.parents[child] == parent for parent, child in zip(nodes, nodes[1:]))
        on_rows.update(nodes)
    assert on_rows == set(range(tree.num_nodes + 1))


def test_the_published_default_tree_and_the_bank():
    tree = default_bank().get(DEFAULT_TREE)
    assert (tree.num_nodes, tree.max_depth, tree.top_k) == (63, 4, 10)
    assert tuple(tree.retrieve_indices.shape) == (42, 5)  # Medusa's 42 leaves for this tree
    assert default_bank().get(DEFAULT_TREE) is tree  # switching is a lookup, built once
    assert NAMED_TREES["medusa_16"] == NAMED_TREES["mc_sim_7b_63"][:16]
    with pytest.raises(SpecdecError, match="unknown tree 'nope'; known: chain_2"):
        TopologyBank({"chain_2": NAMED_TREES["chain_2"]}).get("nope")
    # NAME@D: the nodes of depth <= D, what a drafter proposes near a request's last tokens
    shallow = default_bank().limited(DEFAULT_TREE, 2)
    assert shallow.name == "mc_sim_7b_63@2" and shallow.max_depth == 2
    assert shallow.paths == tuple(path for path in tree.paths if len(path) <= 2)
    assert default_bank().limited("mc_sim_7b_63@3", 2) is shallow and default_bank().limited(DEFAULT_TREE, 9) is tree
    for bad in ("mc_sim_7b_63@x", "mc_sim_7b_63@0", "nope@2", "chain_2+nope"):
        with pytest.raises(SpecdecError, match="unknown tree"):
            default_bank().get(bad)
    with pytest.raises(SpecdecError, match="unknown tree 'medusa_8@2'; known: .*medusa_8"):
        default_bank().get("medusa_8@2", named_only=True)  # a request names a registered tree
    # A+B: the union of trees (every node a schedule may verify); a tree's nodes gather from it
    union = default_bank().get("chain_4+medusa_8")
    assert set(union.paths) == set(NAMED_TREES["chain_4"]) | set(NAMED_TREES["medusa_8"])
    assert default_bank().limited("chain_4+medusa_8", 2).name == "chain_4+medusa_8@2"
    index = default_bank().node_index("chain_4", "chain_4+medusa_8")
    assert [union.paths[i] for i in index.tolist()] == list(default_bank().get("chain_4").paths)
    with pytest.raises(ValueError, match="may not hold '@' or '\\+'"):
        default_bank().add("a+b", [[0]])


def test_requests_name_named_trees_and_derived_ones_are_kept_least_recently_used():
    """Derived names come off the wire: a process keeps at most `max_derived` of them, so names
    that differ per request cannot grow it; requests may only pick named trees."""
    bank = TopologyBank({name: NAMED_TREES[name] for name in ("chain_4", "medusa_8", "medusa_16")}, max_derived=2)
    first = bank.get("chain_4+medusa_8")
    assert bank.get("chain_4+medusa_8") is first  # a lookup while kept
    bank.get("medusa_16@2"), bank.get("chain_4+medusa_8"), bank.get("medusa_8@1")
    assert list(bank.derived) == ["chain_4+medusa_8", "medusa_8@1"]  # medusa_16@2 was used least recently
    for within in ("chain_4+medusa_8", "medusa_8+chain_4", "chain_4+medusa_16"):
        bank.node_index("chain_4", within)
    assert len(bank.indices) == 2 and len(bank.derived) == 2
    rebuilt = bank.get("medusa_16@2")  # on demand, the same
    assert set(rebuilt.paths) == {tuple(path) for path in NAMED_TREES["medusa_16"] if len(path) <= 2}
    assert bank.get("medusa_8", named_only=True) is bank.named["medusa_8"]
    for derived in ("medusa_8@1", "chain_4+medusa_8"):
        with pytest.raises(SpecdecError, match=f"unknown tree '{re.escape(derived)}'; known: chain_4, medusa_16"):
            bank.get(derived, named_only=True)


def test_levels_list_each_depths_nodes_with_their_parents_and_ranks():
    tree = Topology.build("small", [[0], [1], [0, 0], [0, 1], [1, 0], [2]])  # nodes 1..6 by (depth, ranks)
    assert [[part.tolist() for part in level] for level in tree.levels] == [
        [[1, 2, 3], [0, 0, 0], [0, 1, 2]],
        [[4, 5, 6], [1, 1, 2], [0, 1, 0]],
    ]


def test_greedy_tree_verification_keeps_the_longest_matching_path():
    tree = Topology.build("small", [[0], [1], [0, 0], [0, 1], [1, 0], [2]])
    tokens = torch.tensor([7, 1, 2, 3, 4, 5, 6])  # root, then nodes 1..6
    logits = torch.zeros(7, 8)
    logits[0, 1] = 5.0  # at the root the target picks 1: node 1 (0,) matches, nodes 2 and 3 do not
    logits[1, 5] = 5.0  # after node 1 it picks 5: node 5 (0, 1) matches, node 4 (0, 0) does not
    logits[5, 2] = 5.0  # after node 5: the next token
    logits[2, 6] = 5.0  # node 6 (1, 0) would match its parent, but node 2 itself was rejected
    greedy, draft = make_policy("greedy", {}), DraftBlock(tokens=tokens[1:], tree=tree)
    verdict = greedy.verify_tree(draft, TargetBlock(logits=logits), SamplingParams(), torch.Generator())
    assert verdict.path == [0, 1, 5] and verdict.num_accepted == 2 and verdict.next_token == 2
    assert verdict.kept_tokens(draft) == [1, 5]
    logits[0, 1] = -5.0  # nothing matches at the root: the target's own token, no node kept
    verdict = greedy.verify_tree(draft, TargetBlock(logits=logits), SamplingParams(), torch.Generator())
    assert verdict.path == [0] and verdict.next_token == int(logits[0].argmax())


def test_greedy_trees_decided_from_the_steps_argmax_on_the_host_equal_the_device_rule():
    """With the step's argmax read back (`TargetBlock.argmax_ids`, forward_rows) a greedy tree is
    decided on the host, no device work: the same path and token as the rule over the logits, on
    random trees whose nodes often match, some siblings proposing one token twice."""
    generator = torch.Generator().manual_seed(0)
    greedy, sampling = make_policy("greedy", {}), SamplingParams()
    trees = [Topology.build("small", [[0], [1], [0, 0], [0, 1], [1, 0], [2]]), Topology.build("chain", [[0], [0, 0]])]
    decided_on_the_host = 0
    for case in range(60):
        tree = trees[case % 2]
        logits = torch.randn(tree.num_nodes + 1, 6, generator=generator)
        argmax = logits.argmax(-1)
        tokens = torch.randint(0, 6, (tree.num_nodes,), generator=generator)
        matching = torch.rand(tree.num_nodes, generator=generator) < 0.6
        tokens = torch.where(matching, argmax[tree.parents[1:]], tokens)  # siblings may both match
        draft = DraftBlock(tokens=tokens, tree=tree)
        on_device = greedy.verify_tree(draft, TargetBlock(logits=logits), sampling, generator)
        on_host = greedy.verify_tree(draft, TargetBlock(logits=logits, argmax_ids=argmax.tolist()), sampling, generator)
        assert (on_host.path, on_host.next_token) == (on_device.path, on_device.next_token)
        passing = (tokens == argmax[tree.parents[1:]]).tolist()
        # else two siblings passed: the device's rule
        decided_on_the_host += kept_chain(tree.parents.tolist(), passing) is not None
    assert 30 < decided_on_the_host < 60


def test_tree_decoding_is_greedy_decoding_and_keeps_the_cache_consistent_across_tree_switches():
    """Trees from a perturbed draft's top-k (switching topology every step), verified greedily
    against the target: the tokens equal target-only greedy decoding, some nodes are accepted,
    and after the accepted paths were moved into place the next step's logits equal a fresh
    forward over the committed tokens (1e-5)."""
    from specdec_core.drafters.model_tree import draft_together, tree_drafting
    from specdec_core.runtime.kv_pool import PagedKV
    from specdec_core.target.scorer import TargetScorer

    from helpers.tiny_models import perturbed_copy, repeating_prompt, tiny_llama

    target = tiny_llama()
    draft_model = perturbed_copy(target, 0.002)
    prompt = repeating_prompt(3)
    scorer = TargetScorer(target)
    greedy = make_policy("greedy", {})
    scorer.reset(prompt, greedy, SamplingParams())
    draft_cache, draft_cached, committed, accepted = PagedKV(), [], list(prompt), 0
    for name in ("medusa_8", "chain_4", "mc_sim_7b_63", "medusa_16", "chain_2", "mc_sim_7b_63", "medusa_32"):
        tree = default_bank().get(name)
        drafting = tree_drafting(draft_cache, draft_cached, committed, tree)
        nodes = draft_together(draft_model, [drafting])[0].tokens
        draft = DraftBlock(tokens=torch.tensor(nodes), tree=tree)
        block = scorer.score_tree([committed[-1], *nodes], tree)
        verdict = greedy.verify_tree(draft, block, SamplingParams(), torch.Generator())
        scorer.commit_path(verdict.path)
        committed += [*verdict.kept_tokens(draft), verdict.next_token]
        accepted += verdict.num_accepted
    with torch.inference_mode():
        fresh = target(torch.tensor([committed])).logits[0, -1].float()
        reference = list(prompt)
        while len(reference) < len(committed):
            reference.append(int(target(torch.tensor([reference])).logits[0, -1].argmax()))
    assert committed == reference
    assert accepted > 7  # the trees earned more than one token per step
    next_logits = scorer.score([committed[-1]]).logits[0]
    assert torch.allclose(next_logits, fresh, atol=1e-5), (next_logits - fresh).abs().max()


@pytest.mark.parametrize("tree_name", ["spine_6x2", "mc_sim_7b_63"])
def test_mla_trees_hold_the_draft_models_tokens_in_fewer_forwards(tree_name, monkeypatch):
    """mla_tree drafts the top-1 path as mla drafts a chain: whatever the lookup guesses, the
    tree's tokens are the draft's own top-k; a guess of the whole path fills a spine in one
    forward, a guess right for k tokens saves k forwards."""
    from specdec_core.drafters import model_tree
    from specdec_core.runtime.kv_pool import PagedKV

    from helpers.tiny_models import repeating_prompt, tiny_llama

    draft_model, context, tree = tiny_llama(seed=1), repeating_prompt(3), default_bank().get(tree_name)
    cache, cached = PagedKV(), []
    # also caches the context
    reference, probs, _ = model_tree.draft_together(
        draft_model, [model_tree.tree_drafting(cache, cached, context, tree)]
    )[0]
    forwards = []

    def counted(*args, **kwargs):
        forwards.append(1)
        return real_forward(*args, **kwargs)

    real_forward = model_tree.forward_ragged
    monkeypatch.setattr(model_tree, "forward_ragged", counted)
    path = [reference[node - 1] for node in tree.top1_path[1:]]
    wrong = [(token + 1) % draft_model.config.vocab_size for token in path]
    for guess, matched in [(path, len(path)), (path[:2] + wrong[2:], 2), (wrong, 0), ([], 0)]:
        forwards.clear()
        lookup = lambda sequence, limit: guess[len(sequence) - len(context) :][:limit]  # noqa: E731
        drafting = model_tree.tree_drafting(cache, cached, context, tree, lookup)
        tokens, tokens_probs, counted_forwards = model_tree.draft_together(draft_model, [drafting])[0]
        assert tokens == reference and torch.allclose(tokens_probs, probs, atol=1e-6)
        assert counted_forwards == len(forwards)
        assert cache.length == len(cached) and cached[: len(context) - 1] == context[:-1]
        if tree_name.startswith("spine"):  # the path's forwards: one, then one per node after a wrong guess
            assert len(forwards) == 1 + max(tree.max_depth - 1 - matched, 0), (guess, forwards)
    # each node is its parent's rank-th likeliest next token, with its probability: a fresh forward
    tokens_of = {(): context[-1], **dict(zip(tree.paths, reference))}
    with torch.inference_mode():
        for node, node_path in enumerate(tree.paths):
            sequence = [*context, *(tokens_of[node_path[:depth]] for depth in range(1, len(node_path)))]
            top = draft_model(torch.tensor([sequence])).logits[0, -1].softmax(-1).topk(node_path[-1] + 1)
            assert reference[node] == int(top.indices[-1])
            assert float(probs[node]) == pytest.approx(float(top.values[-1]), abs=1e-5)


@pytest.mark.parametrize(
    ("drafter", "tree"),
    [("model_tree", t) for t in ("medusa_8", "mc_sim_7b_63", "chain_4")] + [("mla_tree", "spine_6x2")],
)
def test_the_engine_decodes_draft_model_trees_as_target_only_greedy(tiny_engine, drafter, tree):
    from specdec_core import GenerationRequest

    from helpers.tiny_models import repeating_prompt

    def request(drafter: dict, policy: str = "greedy", temperature: float = 0.0) -> GenerationRequest:
        sampling = {"max_tokens": 30, "temperature": temperature, "seed": 4}
        return GenerationRequest(
            prompt_ids=repeating_prompt(5), drafter=drafter, policy={"name": policy}, sampling=sampling
        )

    reference = tiny_engine.complete(request({"name": "none"}))
    # the whole tree: the tiny draft's near-flat probabilities would keep no node in the budget
    trees = tiny_engine.complete(request({"name": drafter, "params": {"tree": tree, "adaptive": False}}))
    assert trees.token_ids == reference.token_ids
    assert trees.metrics["mean_acceptance_length"] > 1.5
    assert len(trees.metrics["spec_decode_num_accepted_tokens_per_pos"]) == default_bank().get(tree).max_depth
    # typical acceptance samples: seeded, a request's tokens repeat exactly
    sampled = [tiny_engine.complete(request({"name": drafter}, "typical", 0.8)).token_ids for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 30


def test_a_tree_drafter_needs_a_policy_with_a_tree_rule_and_a_known_tree(tiny_engine):
    from specdec_core import GenerationRequest, SpecdecError

    with pytest.raises(SpecdecError, match="policy 'easd' has no tree rule.*greedy, rejection, typical"):
        tiny_engine.frontend.prepare(
            GenerationRequest(prompt_ids=[1, 2, 3], drafter={"name": "model_tree"}, policy={"name": "easd"})
        )
    with pytest.raises(SpecdecError, match="unknown tree 'nope'"):
        tiny_engine.frontend.prepare(
            GenerationRequest(prompt_ids=[1, 2, 3], drafter={"name": "model_tree", "params": {"tree": "nope"}})
        )


def test_trees_drafted_together_are_each_drafted_as_alone_in_the_rounds_of_the_longest(monkeypatch):
    """draft_together over four sessions' tree draftings (three shapes, contexts of their own, one
    with a lookup guessing part of its path), on an int4 draft whose linears, its LM head among
    them, run a kernel by their chunk's length: each tree is the one its drafting gives alone, its
    probabilities within 1e-6 (the ragged attention's padding moves their last bits, 2e-10 here;
    the LM head's kernel picked by the step's rows, not the drafting's, moved them by 6e-6), and
    the forwards run in as many rounds as the drafting that takes most."""
    from specdec_core.drafters import model_tree
    from specdec_core.models.kernels.int4 import quantize_int4
    from specdec_core.runtime.kv_pool import PagedKV

    from helpers.tiny_models import repeating_prompt, tiny_llama

    draft_model = tiny_llama(seed=1)  # float32 activations: a kernel's last bits reach the probabilities
    # three kernels by chunk length; the LM head (dense kernels only): fp32 up to 2 rows, bf16 beyond
    table = ((1, "int4"), (2, "fp32"), (12, "int4"), (256, "bf16"))
    quantize_int4(draft_model, lambda linear, candidates: tuple(entry for entry in table if entry[1] in candidates))
    shapes = ["mc_sim_7b_63", "spine_6x2", "medusa_16", "mc_sim_7b_63"]
    contexts = [repeating_prompt(seed) for seed in range(4)]

    def draftings(alone: bool) -> list:
        made = []
        for index, (shape, context) in enumerate(zip(shapes, contexts)):
            lookup = (lambda sequence, limit: context[2 : 2 + limit]) if index == 3 else model_tree.no_guess
            made.append(model_tree.tree_drafting(PagedKV(), [], context, default_bank().get(shape), lookup))
        return [[each] for each in made] if alone else [made]

    alone = [model_tree.draft_together(draft_model, one)[0] for one in draftings(alone=True)]
    rounds = []
    real_forward = model_tree.forward_ragged
    monkeypatch.setattr(model_tree, "forward_ragged", lambda *args: rounds.append(len(args[1])) or real_forward(*args))
    together = model_tree.draft_together(draft_model, draftings(alone=False)[0])
    for one, both in zip(alone, together):
        assert one.tokens == both.tokens and torch.allclose(one.probs, both.probs, atol=1e-6)
        assert one.forwards == both.forwards
    assert len(rounds) == max(one.forwards for one in alone) and rounds[0] == 4
