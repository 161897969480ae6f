"""policies/sampled_trees.py: many requests' sampled trees decided at once. Rejection sampling's
walk takes the sequential rule's path for the same draws and follows the target's distribution;
typical acceptance takes the best kept path of its per-node rule (tree_verify.best_path); a tree is
decided alike in a batch or alone; 12 trees launch as many vocabulary-wide operations as 2; and a
step's chains and trees share one read back."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from specdec_core.api.sampling import (
    SamplingParams,
    entropy_of_probs,
    sample_draws,
    sample_with,
    sampling_probs,
    warp_logits,
)
from specdec_core.loop.stage_types import DraftBlock, TargetBlock
from specdec_core.policies import make_policy, step_verdicts
from specdec_core.policies.sampled_chains import Check, decide_chains
from specdec_core.policies.sampled_trees import decide_trees, stacked_rows
from specdec_core.policies.step_verdicts import decide_together
from specdec_core.policies.typical import clears
from specdec_core.trees.topologies import default_bank
from specdec_core.trees.tree import listed_name
from specdec_core.trees.tree_verify import best_path

from helpers.vocabulary_ops import VocabularyOps

BANK = default_bank()
TREES = [
    listed_name([(0,), (1,), (2,), (0, 0), (0, 1)]),
    listed_name([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)]),
    listed_name([(0,)]),
    "mc_sim_7b_63",
    "medusa_16",
]
WARPS = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=1.2, top_p=0.9)]


def sequential_path(check: Check) -> tuple[list[int], int]:
    """The rule's definition, walked from the root: children tried in rank order, child c (with
    its own uniform u_c) accepted when u_c |r| < r(c), r losing each rejected child's token; the
    next token drawn from r, or from p where r has no mass. The draws are the rule's: a uniform
    for every node in node order, then one for the next token."""
    generator, tree, tokens = check.generator, check.draft.tree, check.draft.token_ids
    uniform = torch.rand(check.draft.num_tokens, generator=generator, dtype=torch.float64).tolist()
    next_draw = torch.rand(1, 1, generator=generator, dtype=torch.float64)
    parents = tree.parents.tolist()
    path = [0]
    while True:
        probs = sampling_probs(check.target.logits[path[-1]][None], check.sampling)[0].double()  # [V]
        residual = probs.clone()
        for child in (node for node in range(1, len(parents)) if parents[node] == path[-1]):
            token = tokens[child - 1]
            if uniform[child - 1] * float(residual.sum()) < float(residual[token]):
                path.append(child)
                break
            residual[token] = 0.0
        else:
            weights = residual if float(residual.sum()) > 0 else probs
            return path, int(sample_with(weights[None], next_draw)[0])


def typical_reference(check: Check) -> tuple[list[int], int]:
    """Typical acceptance's tree rule on one tree: a node passes when p at its parent clears the
    threshold; the best path of passing nodes (tree_verify.best_path); the next token drawn from p
    at its last node."""
    tree, sampling, params = check.draft.tree, check.sampling, check.policy.params
    warped = warp_logits(check.target.logits, sampling)  # [N + 1, V]
    probs = warped.softmax(-1)
    node_probs = probs[tree.parents[1:], check.draft.tokens]  # [N]
    node_entropy = entropy_of_probs(probs, warped)[tree.parents[1:]]  # [N]
    passes = clears(node_probs, node_entropy, params.epsilon, params.alpha)
    next_draw = sample_draws(check.generator)
    return best_path(
        tree, passes, node_probs.clamp_min(1e-30).log(), lambda node: sample_with(probs[node][None], next_draw)[0]
    )


def tree_check(
    seed: int, tree_name: str, sampling: SamplingParams, vocab: int = 24, policy: str = "rejection"
) -> Check:
    """A tree whose node tokens a draft chose from rows near the target's (a sibling may repeat
    an earlier sibling's token), under `policy` (typical: at settings of its own, by seed)."""
    generator = torch.Generator().manual_seed(seed)
    tree = BANK.get(tree_name)
    target_logits = 2.0 * torch.randn(tree.num_nodes + 1, vocab, generator=generator)  # [N + 1, V]
    near = target_logits[tree.parents[1:]] + torch.randn(tree.num_nodes, vocab, generator=generator)
    tokens = torch.multinomial(near.softmax(-1), 1, generator=generator).squeeze(-1)  # [N]
    params = {"epsilon": 0.05 + 0.4 * (seed % 3), "alpha": 0.1 + 0.6 * (seed % 2)} if policy == "typical" else None
    return Check(
        make_policy(policy, params),
        DraftBlock(tokens=tokens, tree=tree),
        TargetBlock(logits=target_logits),
        sampling,
        torch.Generator().manual_seed(1000 + seed),
    )


def checks(count: int, policy: str = "rejection", vocab: int = 24) -> list[Check]:
    return [tree_check(seed, TREES[seed % len(TREES)], WARPS[seed % 3 % 2], vocab, policy) for seed in range(count)]


@pytest.mark.parametrize("vocab", [24, 3])
def test_trees_decided_together_take_the_sequential_rules_path(vocab):
    """30 trees of 5 shapes under two warps (over 3 tokens: siblings repeat tokens, and top-k or
    top-p leave some none): each verdict is the walk's for the same uniforms."""
    verdicts = decide_trees(checks(30, vocab=vocab))
    for check, verdict in zip(checks(30, vocab=vocab), verdicts):  # fresh generators for the reference
        path, next_token = sequential_path(check)
        assert (verdict.path, verdict.next_token) == (path, next_token)
        assert verdict.num_accepted == len(path) - 1


@pytest.mark.parametrize("vocab", [24, 3])
def test_typical_trees_decided_together_take_the_best_kept_path(vocab):
    """30 trees of 5 shapes under two warps and three settings (over 3 tokens: many paths tie):
    each verdict is the per-tree rule's for the same draw, and some paths go past the root."""
    verdicts = decide_trees(checks(30, "typical", vocab))
    for check, verdict in zip(checks(30, "typical", vocab), verdicts):
        assert (verdict.path, verdict.next_token) == typical_reference(check)
    assert sum(len(verdict.path) > 1 for verdict in verdicts) > 5


def test_typical_ties_go_to_the_first_leafs_path_and_no_pass_to_the_root():
    """Root children 1 and 2 of the same token, equally likely; node 3 (under 1) fails: the paths
    [0, 1] and [0, 2] tie in length and log-probability, and the first leaf's, node 2's (leaves in
    (depth, ranks) order), is taken, as tree_verify.best_path takes it. Where no node passes, the
    path is the root alone and the next token is drawn from the root's row."""
    tree = BANK.get(listed_name([(0,), (1,), (0, 0)]))
    rows = torch.full((4, 8), -4.0)
    rows[:, 3] = 2.0  # every row: token 3 likely, the rest unlikely

    def check(tokens: list[int]) -> Check:
        policy = make_policy("typical", {"epsilon": 0.05, "alpha": 0.3})
        sampling, generator = SamplingParams(temperature=1.0), torch.Generator().manual_seed(0)
        return Check(policy, DraftBlock(torch.tensor(tokens), tree=tree), TargetBlock(rows), sampling, generator)

    for tokens, path in (([3, 3, 0], [0, 2]), ([0, 1, 3], [0])):
        verdict = decide_trees([check(tokens)])[0]
        assert verdict.path == path and (verdict.path, verdict.next_token) == typical_reference(check(tokens))


@pytest.mark.parametrize("policy", ["rejection", "typical"])
def test_a_tree_is_decided_alike_in_a_batch_or_alone(policy):
    together = decide_trees(checks(12, policy))
    alone = [c.policy.verify_tree(c.draft, c.target, c.sampling, c.generator) for c in checks(12, policy)]
    assert [(v.path, v.next_token) for v in together] == [(v.path, v.next_token) for v in alone]


@pytest.mark.parametrize("root_tokens", [[4, 0, 5], [4, 4, 0]])
def test_the_emitted_tokens_follow_the_target(root_tokens):
    """Root children of the given tokens (5: no mass; a repeated 4: sure to be rejected), the first
    with two children 2 and 3, warped by temperature and top-k: 20,000 trees decided in batches of
    2,000, each on its own generator. The first emitted token follows the root's warped row, and
    after the first child the next token that child's row (chi-square, fails if p < 1e-3)."""
    tree = BANK.get(listed_name([(0,), (1,), (2,), (0, 0), (0, 1)]))
    tokens = torch.tensor([*root_tokens, 2, 3])
    root = torch.tensor([0.25, 0.2, 0.15, 0.1, 0.3, 0.0])
    under_first = torch.tensor([0.1, 0.3, 0.05, 0.35, 0.1, 0.1])
    rows = torch.stack([root, under_first, *[torch.full((6,), 1 / 6)] * 4]).clamp_min(1e-12).log()  # [N + 1, V]
    sampling = SamplingParams(temperature=0.8, top_k=5)
    first, second = torch.zeros(6), torch.zeros(6)
    for batch in range(10):
        made = [
            Check(
                make_policy("rejection"),
                DraftBlock(tokens=tokens, tree=tree),
                TargetBlock(logits=rows),
                sampling,
                torch.Generator().manual_seed(batch * 2000 + index),
            )
            for index in range(2000)
        ]
        for check, verdict in zip(made, decide_trees(made)):
            emitted = [*verdict.kept_tokens(check.draft), verdict.next_token]
            first[emitted[0]] += 1
            if emitted[0] == 4:
                second[emitted[1]] += 1
    for counts, row in ((first, rows[0]), (second, rows[1])):
        expected = sampling_probs(row[None], sampling)[0]
        support = expected > 0
        assert counts[~support].sum() == 0
        result = chisquare(counts[support].numpy(), (counts.sum() * expected[support]).numpy())
        assert result.pvalue > 1e-3, (counts, result)


@pytest.mark.parametrize("policy", ["rejection", "typical"])
def test_many_trees_take_the_vocabulary_wide_operations_of_two(policy):
    """On an accelerator every operation is a launch: a step's sampled trees (one rule, one warp)
    are decided by as many operations over vocabulary rows whatever their number and shapes, for a
    given depth (rejection's walk takes a round a depth)."""
    counts = []
    for num_trees in (2, 12):
        shapes = ["mc_sim_7b_63", *(TREES[seed % len(TREES)] for seed in range(num_trees - 1))]  # depth 4
        made = [tree_check(seed, shape, WARPS[0], 97, policy) for seed, shape in enumerate(shapes)]
        with VocabularyOps(97) as counter:
            decide_trees(made)
        counts.append(counter.count)
    assert counts[0] == counts[1] and counts[0] > 0


def test_trees_scored_in_one_forward_are_read_in_place():
    """A step's trees are row ranges of its one LM head output (forward_rows splits it): their rows
    are read where they lie, whatever the order of the checks, and decide as copies of them do;
    where one lies elsewhere, all are copied together."""
    copies = checks(6)
    step_rows = torch.cat([torch.zeros(3, 24), *(check.target.logits for check in reversed(copies))])  # [R, V]
    in_place = checks(6)
    parts = step_rows[3:].split([len(check.target.logits) for check in reversed(copies)])
    for check, part in zip(in_place, reversed(parts)):
        check.target = TargetBlock(logits=part)
    rows, roots = stacked_rows([check.target.logits for check in in_place])
    assert rows.data_ptr() == parts[0].data_ptr()  # the lowest block's first row: no copy
    assert all(torch.equal(rows[root], check.target.logits[0]) for root, check in zip(roots, in_place))
    expected = [(v.path, v.next_token) for v in decide_trees(copies)]
    assert [(v.path, v.next_token) for v in decide_trees(in_place)] == expected
    mixed = checks(6)
    for check, part in zip(mixed[1:], reversed(parts[:-1])):
        check.target = TargetBlock(logits=part)
    rows, roots = stacked_rows([check.target.logits for check in mixed])
    assert rows.data_ptr() != parts[0].data_ptr() and roots == [
        0,
        *itertools.accumulate(len(c.target.logits) for c in mixed[:-1]),
    ]
    assert [(v.path, v.next_token) for v in decide_trees(mixed)] == expected


def test_a_steps_chains_and_trees_are_read_back_at_once(monkeypatch):
    """step_verdicts.decide_together over a step's sampled chains and trees, interleaved: one read
    back for all, and each verdict as its kind's decision alone gives it."""

    def chain_check(seed: int) -> Check:
        generator = torch.Generator().manual_seed(seed)
        target_logits = 2.0 * torch.randn(5, 24, generator=generator)  # [K + 1, V]
        tokens = torch.multinomial(target_logits[:4].softmax(-1), 1, generator=generator).squeeze(-1)  # [K]
        policy = make_policy("rejection" if seed % 2 else "typical")
        return Check(
            policy, DraftBlock(tokens), TargetBlock(target_logits), WARPS[0], torch.Generator().manual_seed(seed)
        )

    def step() -> list[Check]:
        trees = checks(6, "rejection") + checks(4, "typical")
        return [check for pair in zip([chain_check(seed) for seed in range(10)], trees) for check in pair]

    alone = decide_chains(step()[0::2]), decide_trees(step()[1::2])
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda tensor: reads.append(tensor.shape) or tolist(tensor))
    together = decide_together(step())
    assert len(reads) == 1
    outcome = [(verdict.num_accepted, verdict.next_token, verdict.path) for verdict in together]
    assert outcome[0::2] == [(verdict.num_accepted, verdict.next_token, verdict.path) for verdict in alone[0]]
    assert outcome[1::2] == [(verdict.num_accepted, verdict.next_token, verdict.path) for verdict in alone[1]]
    # on the CPU a step goes in parts of bounded rows (step_verdicts.CPU_ENTRIES): the same verdicts
    monkeypatch.setattr(step_verdicts, "CPU_ENTRIES", 3 * 5 * 24)  # three chains' rows a part, a tree alone
    reads.clear()
    parted = decide_together(step())
    assert len(reads) > 1
    assert [(verdict.num_accepted, verdict.next_token, verdict.path) for verdict in parted] == outcome
