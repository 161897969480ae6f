"""Acceptance policies on hand-built distributions: base rules, neutral settings, and where each
lossy rule fires."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from specdec_core.api.errors import SpecdecError
from specdec_core.api.sampling import (
    SamplingParams,
    argmax,
    entropy,
    entropy_of_logits,
    entropy_of_probs,
    sample,
    sampling_probs,
    warp_logits,
)
from specdec_core.calibration.profile_types import CalibrationSettings, TargetProfile
from specdec_core.loop.stage_types import DraftBlock, TargetBlock
from specdec_core.policies import POLICIES, PolicyError, make_policy
from specdec_core.policies.easd import calibrate_tau_h
from specdec_core.policies.fly import top3_entropy
from specdec_core.policies.policy_base import base_decision, first_false, recover_token
from specdec_core.policies.sampled_chains import Check, decide_chains

from helpers.vocabulary_ops import VocabularyOps

GREEDY = SamplingParams(temperature=0.0)
SAMPLE = SamplingParams(temperature=1.0)
PROFILE = TargetProfile(easd_tau_h=2.0, num_entropies=1, settings=CalibrationSettings())  # a target's measured defaults


def rng(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def logits_of(probs: torch.Tensor) -> torch.Tensor:
    return probs.clamp_min(1e-12).log()


def sampled_draft(tokens: torch.Tensor, logits: torch.Tensor, sampling: SamplingParams) -> DraftBlock:
    """A block whose `tokens` were drawn from `sampling_probs(logits, sampling)`, as a model
    drafter builds it."""
    token_probs = sampling_probs(logits, sampling).gather(-1, tokens[:, None]).squeeze(-1)
    return DraftBlock(tokens=tokens, logits=logits, token_probs=token_probs)


def random_case(seed: int, num_draft: int = 6, vocab: int = 32, sharp: float = 3.0, sampling: SamplingParams = SAMPLE):
    """Random target/draft logits with draft tokens drawn from the draft (correlated pair); the
    block carries p_d under `sampling` unless that is greedy (then it is a deterministic draft)."""
    generator = rng(seed)
    target_logits = sharp * torch.randn(num_draft + 1, vocab, generator=generator)
    draft_logits = target_logits[:num_draft] + 0.7 * sharp * torch.randn(num_draft, vocab, generator=generator)
    tokens = torch.multinomial(draft_logits.softmax(-1), 1, generator=generator).squeeze(-1)
    if sampling.greedy:
        return DraftBlock(tokens=tokens, logits=draft_logits), TargetBlock(logits=target_logits)
    return sampled_draft(tokens, draft_logits, sampling), TargetBlock(logits=target_logits)


def greedy_case(target_argmax: list[int], draft_tokens: list[int], vocab: int = 16, confidence: float = 5.0):
    """Target rows peaked at the given argmax tokens; draft tokens as given (one-hot)."""
    logits = torch.zeros(len(target_argmax), vocab)
    logits[torch.arange(len(target_argmax)), torch.tensor(target_argmax)] = confidence
    return DraftBlock(tokens=torch.tensor(draft_tokens)), TargetBlock(logits=logits)


def verdict_tuple(verdict):
    return verdict.num_accepted, verdict.next_token


# ---------------------------------------------------------------- registry and base rules


def test_registry_lists_all_policies():
    assert set(POLICIES) == {"greedy", "rejection", "typical", "easd", "ears", "dropmatch", "fly"}


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("nope", {}, "unknown policy 'nope'; valid policies: dropmatch, ears, easd, fly, greedy, rejection, typical"),
        ("ears", {"beta": -1}, "beta"),
        ("ears", {"gamma": 1}, "gamma"),
        ("fly", {"window": "six"}, "window"),
        ("dropmatch", {"dropout": 1.0}, "dropout"),
        ("easd", {"tau_o": 2}, "tau_o"),
        ("typical", [1, 2], "must be an object"),
    ],
)
def test_bad_policy_names_and_params_raise_clear_errors(name, params, message):
    with pytest.raises(PolicyError, match=message):
        make_policy(name, params)


def test_greedy_accepts_matching_prefix_and_emits_target_argmax():
    draft, target = greedy_case([3, 4, 5, 6], [3, 4, 9])
    verdict = make_policy("greedy").verify(draft, target, GREEDY, rng())
    assert verdict_tuple(verdict) == (2, 5)
    assert verdict.trace["accepted"].tolist() == [True, True, False]
    all_match = make_policy("greedy").verify(*greedy_case([3, 4, 5, 6], [3, 4, 5]), GREEDY, rng())
    assert verdict_tuple(all_match) == (3, 6)  # bonus argmax


@pytest.mark.parametrize(
    "target_probs, draft_probs",
    [
        ([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.1, 0.1, 0.2, 0.2, 0.2, 0.2]),
        ([0.05, 0.05, 0.1, 0.1, 0.2, 0.5], [0.5, 0.2, 0.1, 0.1, 0.05, 0.05]),
        ([0.3, 0.3, 0.2, 0.1, 0.1, 0.0], [0.0, 0.1, 0.1, 0.2, 0.3, 0.3]),
        ([0.9, 0.02, 0.02, 0.02, 0.02, 0.02], [0.9, 0.02, 0.02, 0.02, 0.02, 0.02]),
    ],
)
def test_rejection_sampling_reproduces_target_distribution(target_probs, draft_probs):
    """Chi-square goodness of fit of the first emitted token against p_t: 20,000 draws with a
    fixed seed; the test fails if p < 1e-3 (a correct sampler fails this 0.1% of the time for a
    random seed; with the fixed seed the outcome is deterministic)."""
    target_probs, draft_probs = torch.tensor(target_probs), torch.tensor(draft_probs)
    policy = make_policy("rejection")
    generator = rng(1234)
    target = TargetBlock(logits=logits_of(torch.stack([target_probs, target_probs])))
    num_draws = 20_000
    draft_tokens = torch.multinomial(draft_probs, num_draws, replacement=True, generator=generator)
    counts = torch.zeros(6)
    for token in draft_tokens.tolist():
        draft = sampled_draft(torch.tensor([token]), logits_of(draft_probs)[None], SAMPLE)
        verdict = policy.verify(draft, target, SAMPLE, generator)
        counts[token if verdict.num_accepted == 1 else verdict.next_token] += 1
    support = target_probs > 0
    assert counts[~support].sum() == 0
    result = chisquare(counts[support].numpy(), (num_draws * target_probs[support]).numpy())
    assert result.pvalue > 1e-3, (counts, result)


def test_rejection_at_temperature_zero_is_greedy():
    for seed in range(20):
        draft, target = random_case(seed, sampling=GREEDY)
        draft.tokens = torch.where(torch.arange(6) < 3, target.logits[:6].argmax(-1), draft.tokens)
        assert verdict_tuple(make_policy("rejection").verify(draft, target, GREEDY, rng())) == verdict_tuple(
            make_policy("greedy").verify(draft, target, GREEDY, rng())
        )


# ---------------------------------------------------------------- neutral settings reduce exactly


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLE, SamplingParams(temperature=0.7, top_p=0.9, top_k=10)])
def test_ears_beta_zero_is_rejection(sampling):
    for seed in range(40):
        draft, target = random_case(seed, sampling=sampling)
        ears = make_policy("ears", {"beta": 0.0}).verify(draft, target, sampling, rng(seed))
        base = make_policy("rejection").verify(draft, target, sampling, rng(seed))
        assert verdict_tuple(ears) == verdict_tuple(base)
        assert not ears.trace["pardoned"].any()


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLE])
def test_easd_infinite_tau_is_base_rule(sampling):
    for seed in range(40):
        draft, target = random_case(seed, sharp=0.3, sampling=sampling)  # flat: high entropy, would be penalized
        easd = run_policy(make_policy("easd", {"tau_h": math.inf}), draft, target, sampling, seed)
        base = make_policy("rejection").verify(draft, target, sampling, rng(seed))
        assert verdict_tuple(easd) == verdict_tuple(base)


def test_typical_at_temperature_zero_is_greedy():
    for seed in range(40):
        draft, target = random_case(seed, sampling=GREEDY)
        draft.tokens[:2] = target.logits[:2].argmax(-1)
        assert verdict_tuple(make_policy("typical").verify(draft, target, GREEDY, rng())) == verdict_tuple(
            make_policy("greedy").verify(draft, target, GREEDY, rng())
        )


# ---------------------------------------------------------------- many sampled chains at once

WARPS = [SAMPLE, SamplingParams(temperature=0.7, top_p=0.9, top_k=10), SamplingParams(temperature=1.3, min_p=0.05)]


def mixed_checks(seed: int) -> list[Check]:
    """Rejection and typical requests of 0-5 drafts, sampled (a draft model's) and one-hot (prompt
    lookup's), under three warps: one batch as a step would gather it."""
    checks = []
    for index in range(12):
        case_seed, sampling = 100 * seed + index, WARPS[index % 3]
        draft, target = random_case(case_seed, num_draft=index % 6, sampling=sampling)
        if index % 4 == 1:
            draft = DraftBlock(tokens=draft.tokens)
        policy = make_policy("rejection" if index % 2 == 0 else "typical", {} if index % 2 == 0 else {"epsilon": 0.05})
        checks.append(Check(policy, draft, target, sampling, rng(case_seed)))
    return checks


def lone_reference(check: Check) -> tuple[int, int]:
    """The check's verdict by its rule's definition, alone: rejection by the base rule that the lossy
    policies build on (policy_base), typical by its threshold on the entropy's definition."""
    draft, target, sampling, generator = check.draft, check.target, check.sampling, check.generator
    if check.policy.name == "rejection":
        decision = base_decision(draft, target, sampling, generator)
        num_accepted = first_false(decision.accepted)
        return num_accepted, recover_token(num_accepted, draft, decision, sampling, generator)
    probs = sampling_probs(target.logits, sampling)  # [K + 1, V]
    token_probs = probs[: draft.num_tokens].gather(-1, draft.tokens[:, None]).squeeze(-1)
    params = check.policy.params
    threshold = torch.minimum(torch.tensor(params.epsilon), params.alpha * torch.exp(-entropy(probs)))
    num_accepted = first_false(token_probs > threshold[: draft.num_tokens])
    return num_accepted, int(sample(probs[num_accepted][None], generator)[0])


@pytest.mark.parametrize("seed", range(4))
def test_sampled_chains_decided_together_are_each_decided_as_alone(seed):
    verdicts = decide_chains(mixed_checks(seed))
    for check, verdict in zip(mixed_checks(seed), verdicts):  # fresh generators for the reference
        assert verdict_tuple(verdict) == lone_reference(check)
        assert verdict.trace["accepted"].tolist() == [i < verdict.num_accepted for i in range(check.draft.num_tokens)]


def test_many_chains_take_the_vocabulary_wide_operations_of_one():
    """On an accelerator every operation is a launch: a step's sampled chains (one rule, one warp)
    are decided by as many operations over vocabulary rows as two chains (one alone skips the
    concatenations)."""
    counts = []
    for num_chains in (2, 12):
        checks = []
        for seed in range(num_chains):
            draft, target = random_case(seed, num_draft=1 + seed % 4, vocab=97)
            checks.append(Check(make_policy("rejection"), draft, target, SAMPLE, rng(seed)))
        with VocabularyOps(97) as counter:
            decide_chains(checks)
        counts.append(counter.count)
    assert counts[0] == counts[1] and counts[0] > 0


def dropmatch_case(seed: int, num_draft: int = 6, vocab: int = 40, hidden: int = 16):
    generator = rng(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=generator))
    hidden_states = torch.randn(num_draft + 1, hidden, generator=generator)
    with torch.no_grad():
        logits = head(hidden_states)
    draft_logits = logits[:num_draft] + 2.0 * torch.randn(num_draft, vocab, generator=generator)
    tokens = draft_logits.argmax(-1)
    tokens[: num_draft // 2] = logits[: num_draft // 2].argmax(-1)
    draft = DraftBlock(tokens=tokens, logits=draft_logits)
    return draft, TargetBlock(logits=logits, hidden=hidden_states, lm_head=head)


def run_policy(policy, draft, target, sampling, seed=0):
    generator = rng(seed)
    with torch.no_grad():
        target.features = policy.target_features(target, draft.tokens, sampling, generator)
    return policy.verify(draft, target, sampling, generator)


def test_dropmatch_zero_dropout_is_greedy():
    for seed in range(30):
        draft, target = dropmatch_case(seed)
        verdict = run_policy(make_policy("dropmatch", {"dropout": 0.0}), draft, target, GREEDY, seed)
        assert verdict_tuple(verdict) == verdict_tuple(make_policy("greedy").verify(draft, target, GREEDY, rng()))
        naive = run_policy(make_policy("dropmatch", {"dropout": 0.0, "criteria": ["naive"]}), draft, target, GREEDY)
        assert verdict_tuple(naive) == verdict_tuple(verdict)


def test_fly_closed_gate_is_greedy():
    for seed in range(30):
        draft, target = random_case(seed, num_draft=15, vocab=8, sharp=0.5, sampling=GREEDY)
        verdict = make_policy("fly", {"theta": math.inf}).verify(draft, target, GREEDY, rng())
        assert verdict_tuple(verdict) == verdict_tuple(make_policy("greedy").verify(draft, target, GREEDY, rng()))


# ---------------------------------------------------------------- EARS pardon band


def ears_case(ratio: float, max_prob: float, vocab: int = 10):
    """One draft position, one-hot draft (p_d(c) = 1) so R = p_t(c) = ratio; token 1 holds max_prob."""
    probs = torch.full((vocab,), (1.0 - ratio - max_prob) / (vocab - 2))
    probs[0], probs[1] = ratio, max_prob
    return DraftBlock(tokens=torch.tensor([0])), TargetBlock(logits=logits_of(torch.stack([probs, probs])))


def test_ears_pardons_exactly_inside_the_tolerance_band():
    beta, max_prob = 0.5, 0.4
    tolerance = beta * (1 - max_prob)  # 0.3
    uniform = float(torch.rand(1, generator=rng(7))[0])  # the U the policy will draw
    policy = make_policy("ears", {"beta": beta})
    inside = policy.verify(*ears_case(max(uniform - tolerance / 2, 1e-4), max_prob), SAMPLE, rng(7))
    assert inside.num_accepted == 1 and inside.trace["pardoned"].tolist() == [True]
    if uniform - 2 * tolerance > 0:
        outside = policy.verify(*ears_case(uniform - 2 * tolerance, max_prob), SAMPLE, rng(7))
        assert outside.num_accepted == 0 and not outside.trace["pardoned"].any()
    plain = policy.verify(*ears_case(min(uniform + 0.05, 0.55), max_prob), SAMPLE, rng(7))
    assert plain.num_accepted == 1 and not plain.trace["pardoned"].any()  # R >= U: ordinary accept


def test_ears_clamps_threshold_at_zero():
    """U - tolerance < 0 makes the threshold 0: even a tiny ratio is pardoned."""
    beta = 1.0
    uniform = float(torch.rand(1, generator=rng(3))[0])
    max_prob = max(0.0, 1 - (uniform + 0.1))  # tolerance > U
    if max_prob > 0.05:
        verdict = make_policy("ears", {"beta": beta}).verify(*ears_case(1e-6, max_prob), SAMPLE, rng(3))
        assert verdict.trace["pardoned"].tolist() == [True]


# ---------------------------------------------------------------- EASD trigger


def easd_rows(vocab: int = 64, flat_tokens: int = 40, order=None):
    """A high-entropy row (mass spread over `flat_tokens` tokens, ordered by `order`)."""
    order = order if order is not None else list(range(flat_tokens))
    row = torch.full((vocab,), -30.0)
    for rank, token in enumerate(order):
        row[token] = 1.0 - 0.01 * rank
    return row


def test_easd_penalizes_when_both_entropies_high_and_top_n_overlap():
    target_row = easd_rows()
    draft_row = easd_rows(order=[0, 1, 2, 3, 50] + list(range(5, 40)))  # top-5 overlap 4/5 = 0.8
    target = TargetBlock(logits=torch.stack([target_row, target_row]))
    draft = DraftBlock(tokens=torch.tensor([0]), logits=draft_row[None])
    verdict = run_policy(make_policy("easd", {"tau_h": 2.0, "tau_o": 0.8}), draft, target, GREEDY)
    assert verdict.num_accepted == 0 and verdict.trace["penalized"].tolist() == [True]
    assert verdict.next_token == 1  # argmax of the penalized target distribution
    # overlap 0.8 < 0.9: no penalty, the draft token (the target argmax) is accepted
    relaxed = run_policy(make_policy("easd", {"tau_h": 2.0, "tau_o": 0.9}), draft, target, GREEDY)
    assert relaxed.num_accepted == 1 and not relaxed.trace["penalized"].any()


def test_easd_needs_both_entropies_high():
    high, low = easd_rows(), torch.zeros(64)
    low[0] = 30.0  # confident row, entropy ~0
    for target_row, draft_row in ((high, low), (low, high)):
        target = TargetBlock(logits=torch.stack([target_row, target_row]))
        draft = DraftBlock(tokens=torch.tensor([0]), logits=draft_row[None])
        verdict = run_policy(make_policy("easd", {"tau_h": 2.0, "tau_o": 0.0}), draft, target, GREEDY)
        assert verdict.num_accepted == 1 and not verdict.trace["penalized"].any()
    prompt_lookup_draft = DraftBlock(tokens=torch.tensor([0]))  # no distribution: entropy 0
    target = TargetBlock(logits=torch.stack([high, high]))
    assert (
        run_policy(make_policy("easd", {"tau_h": 2.0, "tau_o": 0.0}), prompt_lookup_draft, target, GREEDY).num_accepted
        == 1
    )


def test_easd_penalty_at_temperature_samples_from_penalized_target():
    target_row = easd_rows()
    target = TargetBlock(logits=torch.stack([target_row, target_row]))
    draft = sampled_draft(torch.tensor([0]), target_row[None], SAMPLE)
    policy = make_policy("easd", {"tau_h": 2.0, "tau_o": 0.8})
    emitted = {run_policy(policy, draft, target, SAMPLE, seed).next_token for seed in range(200)}
    assert 0 not in emitted and len(emitted) > 10


def test_easd_calibration_is_mean_of_top_fraction():
    entropies = torch.arange(1, 101, dtype=torch.float32)  # top 5% = 96..100
    assert calibrate_tau_h(entropies, 0.05) == pytest.approx(98.0)
    assert calibrate_tau_h(torch.tensor([1.0, 2.0, 3.0]), 0.05) == pytest.approx(3.0)  # ceil(0.15) = 1


def test_easd_takes_tau_h_from_the_target_profile_unless_given():
    assert make_policy("easd").needs_profile and not make_policy("easd", {"tau_h": 1.5}).needs_profile
    assert make_policy("easd").for_target(PROFILE).params.tau_h == 2.0
    assert make_policy("easd", {"tau_h": 1.5}).for_target(PROFILE).params.tau_h == 1.5
    with pytest.raises(SpecdecError, match="no calibrated tau_h") as raised:
        make_policy("easd").for_target(None)
    assert raised.value.param == "policy"
    assert not any(make_policy(name).needs_profile for name in POLICIES if name != "easd")


# ---------------------------------------------------------------- FLy gate and window


def fly_case(exact: list[bool], fuzzy: bool = True, vocab: int = 16):
    """Draft of len(exact) tokens matching the target argmax where `exact` says so. Target rows
    are fuzzy (top-3 entropy well above 0.3) or sharp (well below)."""
    num_draft = len(exact)
    argmax = torch.arange(num_draft) % 5
    logits = torch.full((num_draft + 1, vocab), -20.0 if not fuzzy else 0.0)
    logits[torch.arange(num_draft + 1), torch.arange(num_draft + 1) % 5] = 2.0 if fuzzy else 20.0
    if fuzzy:  # a clear runner-up so the top-3 entropy is well above 0.3
        logits[torch.arange(num_draft + 1), 10] = 1.5
    tokens = torch.where(torch.tensor(exact), argmax, torch.full_like(argmax, 10))
    return DraftBlock(tokens=tokens), TargetBlock(logits=logits)


def test_fly_top3_entropy_matches_reference_definition():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = logits.softmax(-1)[0]
    top3 = probs.topk(3).values
    assert float(top3_entropy(logits)[0]) == pytest.approx(float(-(top3 * top3.log()).sum()), rel=1e-6)


def test_fly_window_pass_accepts_the_mismatch_loosely():
    exact = [True, False] + [True] * 13  # K = 15, mismatch at 1, window 2..6 clean
    draft, target = fly_case(exact)
    verdict = make_policy("fly").verify(draft, target, GREEDY, rng())
    assert verdict.num_accepted == 15 and verdict.trace["loose"].tolist() == [i == 1 for i in range(15)]
    assert verdict.next_token == 15 % 5  # bonus argmax
    assert int(draft.tokens[1]) == 10  # the loosely accepted position keeps the draft token


def test_fly_window_broken_rejects():
    exact = [True, False, True, True, False] + [True] * 10  # second mismatch inside j=1's window
    draft, target = fly_case(exact)
    verdict = make_policy("fly").verify(draft, target, GREEDY, rng())
    assert verdict.num_accepted == 1 and verdict.next_token == 1  # target argmax at position 1
    assert not verdict.trace["loose"].any()


def test_fly_reference_window_counts_the_mismatch_itself():
    # W = 6: positions j+1..j+5 must match. A mismatch at j+6 does not break j's window.
    exact = [False, True, True, True, True, True, False] + [True] * 8
    verdict = make_policy("fly").verify(*fly_case(exact), GREEDY, rng())
    assert verdict.trace["loose"][0] and verdict.num_accepted == 15  # j=6 also has a clean window
    paper = make_policy("fly", {"window_convention": "paper"}).verify(*fly_case(exact), GREEDY, rng())
    assert paper.num_accepted == 0  # paper convention: j+1..j+6 must match, j+6 does not


def test_fly_last_w_positions_are_strict():
    # K = 15, W = 6: a mismatch at 9 (the first of the last 6) stays rejected even if 10.. match
    exact = [True] * 9 + [False] + [True] * 5
    verdict = make_policy("fly").verify(*fly_case(exact), GREEDY, rng())
    assert verdict.num_accepted == 9 and not verdict.trace["loose"].any()
    # a mismatch at 8 with 9..13 clean is the last loose-able position
    exact = [True] * 8 + [False] + [True] * 6
    assert make_policy("fly").verify(*fly_case(exact), GREEDY, rng()).num_accepted == 15
    # blocks shorter than or equal to W never loosen
    assert make_policy("fly").verify(*fly_case([False] + [True] * 5), GREEDY, rng()).num_accepted == 0


def test_fly_gate_keeps_deterministic_positions_strict():
    exact = [True, False] + [True] * 13
    verdict = make_policy("fly").verify(*fly_case(exact, fuzzy=False), GREEDY, rng())
    assert verdict.num_accepted == 1 and not verdict.trace["loose"].any()
    gate_off = make_policy("fly", {"theta": 0.0}).verify(*fly_case(exact, fuzzy=False), GREEDY, rng())
    assert gate_off.num_accepted == 15 and gate_off.trace["loose"].sum() == 1


def test_fly_window_zero_accepts_every_gated_mismatch():
    exact = [True, False, False, True, False] + [True] * 10
    no_window = make_policy("fly", {"window": 0}).verify(*fly_case(exact), GREEDY, rng())
    assert no_window.num_accepted == 15 and no_window.trace["loose"].sum() == 3
    still_gated = make_policy("fly", {"window": 0}).verify(*fly_case(exact, fuzzy=False), GREEDY, rng())
    assert still_gated.num_accepted == 1
    everything = make_policy("fly", {"window": 0, "theta": 0.0}).verify(*fly_case(exact, fuzzy=False), GREEDY, rng())
    assert everything.num_accepted == 15  # gate off and W = 0: every draft token is kept


# ---------------------------------------------------------------- DropMatch criteria


def test_dropmatch_majority_criterion_accepts_the_paths_majority_token():
    """The target argmax is token 0, but most dropout paths pick token 1 (a near tie): a draft
    of token 1 is accepted through the majority rule even though the JS rule rejects it."""
    policy = make_policy("dropmatch")
    target = TargetBlock(logits=torch.tensor([[2.0, 1.999, -3.0], [2.0, 1.999, -3.0]]))
    draft = DraftBlock(tokens=torch.tensor([1]))  # one-hot draft: JS to the centroid is large
    centroid = target.logits[:1].log_softmax(-1)
    target.features = {"rows": torch.tensor([0]), "centroid_log_probs": centroid, "max_path_js": torch.tensor([1e-4])}
    target.features["path_tokens"] = torch.tensor([[1], [1], [1], [0], [2]])
    verdict = policy.verify(draft, target, GREEDY, rng())
    assert verdict.num_accepted == 1 and verdict.trace["loose"].tolist() == [True]
    assert make_policy("dropmatch", {"criteria": ["js"]}).verify(draft, target, GREEDY, rng()).num_accepted == 0
    target.features["path_tokens"] = torch.tensor([[0], [0], [0], [1], [2]])
    assert policy.verify(draft, target, GREEDY, rng()).num_accepted == 0


def test_dropmatch_js_criterion_accepts_draft_inside_the_path_cloud():
    policy = make_policy("dropmatch")
    centroid = torch.tensor([[0.40, 0.35, 0.25]]).log()
    target = TargetBlock(logits=centroid.repeat(2, 1))
    target.features = {
        "rows": torch.tensor([0]),
        "path_tokens": torch.tensor([[0], [0], [0]]),
        "centroid_log_probs": centroid,
    }
    close = DraftBlock(tokens=torch.tensor([1]), logits=torch.tensor([[0.38, 0.37, 0.25]]).log())
    far = DraftBlock(tokens=torch.tensor([1]), logits=torch.tensor([[0.05, 0.90, 0.05]]).log())
    target.features["max_path_js"] = torch.tensor([0.01])
    assert policy.verify(close, target, GREEDY, rng()).num_accepted == 1
    assert policy.verify(far, target, GREEDY, rng()).num_accepted == 0
    assert make_policy("dropmatch", {"criteria": ["majority"]}).verify(close, target, GREEDY, rng()).num_accepted == 0
    with pytest.raises(PolicyError, match="at least one"):
        make_policy("dropmatch", {"criteria": []})


def test_dropmatch_naive_accepts_any_path_token():
    policy = make_policy("dropmatch", {"criteria": ["naive"]})
    target = TargetBlock(logits=torch.tensor([[3.0, 0.0, 0.0], [3.0, 0.0, 0.0]]))
    target.features = {"rows": torch.tensor([0]), "path_tokens": torch.tensor([[0], [0], [2]])}
    assert policy.verify(DraftBlock(tokens=torch.tensor([2])), target, GREEDY, rng()).num_accepted == 1
    assert policy.verify(DraftBlock(tokens=torch.tensor([1])), target, GREEDY, rng()).num_accepted == 0


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLE])
def test_dropmatch_paths_come_from_one_batched_head_call_over_the_rows_they_can_change(sampling):
    """At T = 0 a draft token equal to the target argmax is accepted whatever the paths say,
    so only the other positions get paths; at T > 0 every position does."""
    draft, target = dropmatch_case(0)
    mismatched = (draft.tokens != target.logits[:-1].argmax(-1)).nonzero().flatten()
    assert 0 < len(mismatched) < draft.num_tokens
    calls = []
    head = target.lm_head

    def counting_head(hidden):
        calls.append(hidden.shape)
        return head(hidden)

    target.lm_head = counting_head
    if not sampling.greedy:
        draft = sampled_draft(draft.tokens, draft.logits, sampling)
    run_policy(make_policy("dropmatch", {"num_paths": 7}), draft, target, sampling)
    rows = mismatched if sampling.greedy else torch.arange(draft.num_tokens)
    assert calls == [torch.Size([7, len(rows), 16])]
    assert target.features["rows"].tolist() == rows.tolist()


# ---------------------------------------------------------------- sampling helpers


@pytest.mark.parametrize("vocab", [7, 2048, 2049, 5000])
def test_argmax_matches_torch_with_first_maximum_on_ties(vocab):
    logits = torch.randn(6, vocab, generator=rng(vocab)).round(decimals=1)  # many ties
    logits[1] = 0.0
    logits[2, [3, vocab - 1]] = 99.0  # tie between the first chunk and the tail
    logits[3, vocab - 1] = 99.0  # the maximum only in the tail
    logits[4, [1030 % vocab, 1500 % vocab]] = 99.0  # tie inside one chunk
    assert torch.equal(argmax(logits), logits.argmax(-1))
    assert torch.equal(argmax(logits.view(2, 3, vocab)), logits.view(2, 3, vocab).argmax(-1))
    assert int(argmax(logits[0])) == int(logits[0].argmax())


def test_inverse_cdf_sampler_follows_unnormalized_weights_and_skips_zeros():
    """20,000 draws from weights with zero entries at both ends and inside; chi-square against
    the normalized weights with a fixed seed, failing if p < 1e-3."""
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 5.5, 0.0])
    generator = rng(7)
    draws = torch.cat([sample(weights.expand(1000, -1), generator) for _ in range(20)])
    counts = torch.bincount(draws, minlength=len(weights))
    support = weights > 0
    assert counts[~support].sum() == 0
    expected = len(draws) * weights[support] / weights.sum()
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3
    assert torch.equal(sample(weights[None], rng(3)), sample(weights[None], rng(3)))


@pytest.mark.parametrize(
    "sampling", [SAMPLE, SamplingParams(temperature=0.6, top_k=5), SamplingParams(temperature=1.3, top_p=0.5)]
)
def test_entropy_from_probs_and_log_weights_matches_the_definition(sampling):
    logits = 3.0 * torch.randn(4, 50, generator=rng(2))
    warped = warp_logits(logits, sampling)  # filtered entries are -inf
    probs = warped.softmax(-1)
    assert torch.allclose(entropy_of_probs(probs, warped), entropy(probs), atol=1e-5)
    assert torch.allclose(entropy_of_logits(logits), entropy(logits.softmax(-1)), atol=1e-5)


# ---------------------------------------------------------------- shared invariants


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLE])
def test_every_policy_is_deterministic_under_a_seed_and_handles_empty_drafts(name, sampling):
    policy = make_policy(name).for_target(PROFILE)
    if not sampling.greedy and not policy.supports_sampling:
        pytest.skip("greedy-only policy")
    draft, target = dropmatch_case(5)
    if not sampling.greedy:
        draft = sampled_draft(draft.tokens, draft.logits, sampling)
    first = run_policy(policy, draft, target, sampling, seed=9)
    second = run_policy(policy, draft, target, sampling, seed=9)
    assert verdict_tuple(first) == verdict_tuple(second)
    assert first.num_accepted == first_false(first.trace["accepted"])
    empty = DraftBlock.empty()
    target_one = TargetBlock(logits=target.logits[:1], hidden=target.hidden[:1], lm_head=target.lm_head)
    verdict = run_policy(policy, empty, target_one, sampling)
    assert verdict.num_accepted == 0 and 0 <= verdict.next_token < target.vocab_size


def test_compact_wire_rows_give_the_same_verdicts():
    """Policies that declare `wire_top_k` decide identically on the compact rows that travel
    (top-k log-probs + uniform tail) as on the full rows."""
    from specdec_core.target.compact import compact_rows, expand_rows

    variants = {"fly": ({}, {"theta": 0.0}), "easd": ({}, {"tau_h": 1.0, "tau_o": 0.2})}  # the second fires often
    penalized = 0
    for name in sorted(POLICIES):
        for params in variants.get(name, ({},)):
            policy = make_policy(name, params).for_target(PROFILE)
            top_k = policy.wire_top_k(GREEDY)
            if top_k is None:
                continue
            for seed in range(25):
                draft, target = random_case(seed, num_draft=15, vocab=64, sharp=1.0, sampling=GREEDY)
                draft.tokens[:8] = target.logits[:8].argmax(-1)
                target.features = policy.target_features(target, draft.tokens, GREEDY, rng(seed))
                compact = TargetBlock(
                    logits=expand_rows(*compact_rows(target.logits, top_k), 64), features=target.features
                )
                full_verdict = policy.verify(draft, target, GREEDY, rng(seed))
                assert verdict_tuple(policy.verify(draft, compact, GREEDY, rng(seed))) == verdict_tuple(full_verdict)
                penalized += int(full_verdict.trace.get("penalized", torch.zeros(1)).sum())
    assert penalized > 0
    assert make_policy("easd").wire_top_k(SAMPLE) is None and make_policy("rejection").wire_top_k(SAMPLE) is None
