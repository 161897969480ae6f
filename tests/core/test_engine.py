"""The speculative loop on tiny random Llama pairs: greedy identity, KV rollback, determinism,
stopping rules and input validation."""

from __future__ import annotations

import json

import pytest
import torch
from scipy.stats import chisquare

from specdec_core import GenerationRequest, SpecdecError, SpeculativeEngine
from specdec_core.api.request import ComponentSpec
from specdec_core.api.sampling import SamplingParams, sampling_probs
from specdec_core.drafters import DrafterError, make_drafter
from specdec_core.drafters.pld import PromptLookupParams, lookup_continuation
from specdec_core.policies import POLICIES, make_policy
from specdec_core.target.scorer import TargetScorer

from helpers.reference_scores import assert_target_log_probs
from helpers.tiny_models import TINY_VOCAB, perturbed_copy, repeating_prompt, tiny_llama


def greedy_scorer(model, prompt_ids) -> TargetScorer:
    scorer = TargetScorer(model)
    scorer.reset(prompt_ids, make_policy("greedy"), SamplingParams())
    return scorer


@torch.inference_mode()
def fresh_logits(model, token_ids) -> torch.Tensor:
    """Logits of a forward over `token_ids` with no cache: the reference for cached scoring."""
    return model(input_ids=torch.tensor([list(token_ids)])).logits[0].float()


def request(prompt_ids, policy="greedy", drafter="pld", k=6, **sampling):
    sampling.setdefault("max_tokens", 40)
    return GenerationRequest(
        prompt_ids=prompt_ids,
        policy={"name": policy},
        drafter={"name": drafter},
        num_draft_tokens=k,
        sampling=sampling,
    )


@pytest.mark.parametrize("drafter", ["pld", "model", "mla"])
@pytest.mark.parametrize("k", [1, 4, 15])
def test_greedy_speculation_is_token_identical_to_target_only(tiny_engine, drafter, k):
    for seed in range(3):
        prompt = repeating_prompt(seed)
        reference = tiny_engine.complete(request(prompt, drafter="none"))
        speculative = tiny_engine.complete(request(prompt, drafter=drafter, k=k))
        assert speculative.token_ids == reference.token_ids
        assert len(reference.token_ids) == 40 and reference.finish_reason == "length"


def test_speculation_actually_accepts_drafts(tiny_engine):
    """Guards the identity test against a drafter that never proposes anything."""
    metrics = tiny_engine.complete(request(repeating_prompt(0), drafter="model", k=4)).metrics
    assert metrics["spec_decode_num_drafts"] > 0
    assert metrics["mean_acceptance_length"] > 2.0
    assert metrics["num_steps"] < 40


def test_reference_decoding_matches_transformers_generate(tiny_engine):
    prompt = repeating_prompt(4)
    ours = tiny_engine.complete(request(prompt, drafter="none", max_tokens=20)).token_ids
    theirs = tiny_engine.target_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=20,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )[0, len(prompt) :].tolist()
    assert ours == theirs


def test_kv_rollback_matches_a_fresh_forward(tiny_target):
    prompt = repeating_prompt(1)
    scorer = greedy_scorer(tiny_target, prompt)
    committed = list(prompt)
    generator = torch.Generator().manual_seed(0)
    for num_keep in (3, 1, 5, 2):
        draft = torch.randint(0, TINY_VOCAB, (6,), generator=generator).tolist()
        block = scorer.score([committed[-1], *draft])
        fresh = fresh_logits(tiny_target, committed + draft)
        torch.testing.assert_close(block.logits, fresh[len(committed) - 1 :], atol=1e-5, rtol=1e-5)
        scorer.commit(num_keep)  # keep the last token + num_keep - 1 drafts, roll back the rest
        correction = int(block.logits[num_keep - 1].argmax())
        committed += draft[: num_keep - 1] + [correction]
        next_block = scorer.score([committed[-1]])
        torch.testing.assert_close(next_block.logits[0], fresh_logits(tiny_target, committed)[-1], atol=1e-5, rtol=1e-5)
        scorer.commit(0)


def test_draft_model_cache_rolls_back_to_committed_prefix(tiny_engine):
    prompt = repeating_prompt(2)
    sampling = SamplingParams()
    drafter = make_drafter("model", {"adaptive": False}, tiny_engine.draft_model)
    fresh = make_drafter("model", {"adaptive": False}, tiny_engine.draft_model)
    drafter.reset(prompt, sampling)
    first = drafter.propose(6).tokens.tolist()
    committed = first[:2] + [(first[2] + 1) % TINY_VOCAB]  # accept 2, then a correction
    drafter.commit(committed)
    fresh.reset(prompt + committed, sampling)
    second = drafter.propose(6)
    expected = fresh.propose(6)
    assert second.tokens.tolist() == expected.tokens.tolist()
    torch.testing.assert_close(second.logits, expected.logits, atol=1e-5, rtol=1e-5)


def test_model_drafter_block_length_follows_acceptance_and_draft_cost(tiny_engine):
    """The adaptive model drafter starts short, lengthens its blocks while they are accepted,
    shortens them after rejections, never drafts fewer than 1 token once it drafts, never drafts
    with a draft too dear to pay even at its prior, and drafts the full block when drafting and
    verifying are free (or adaptation is off)."""
    prompt = repeating_prompt(3)

    def block_lengths(params: dict, accepts: list[bool]) -> list[int]:
        drafter = make_drafter("model", params, tiny_engine.draft_model)
        drafter.reset(prompt, SamplingParams())
        lengths = []
        for accept in accepts:
            proposal = drafter.propose(15).tokens.tolist()
            lengths.append(len(proposal))
            # all drafts kept plus a bonus token, or the first draft replaced by a correction
            drafter.commit(proposal + [0] if accept or not proposal else [(proposal[0] + 1) % TINY_VOCAB])
        return lengths

    lengths = block_lengths({"draft_cost": 0.8}, [True] * 5 + [False] * 5)
    assert lengths[0] < 3 and lengths[:5] == sorted(lengths[:5]) and lengths[4] > lengths[0]
    assert lengths[5:] == sorted(lengths[5:], reverse=True) and lengths[-1] == 1 < lengths[5]
    assert block_lengths({"draft_cost": 5.0}, [True] * 6) == [0] * 6  # it cannot pay: not run at all
    assert block_lengths({"draft_cost": 0.8}, [False] * 6)[-1] == 1  # paying at first, then at least 1
    assert block_lengths({"draft_cost": 0.0, "verify_cost": [1.0]}, [False] * 6) == [15] * 6
    assert block_lengths({"adaptive": False}, [False] * 6) == [15] * 6


@pytest.mark.parametrize("drafter_name", ["model", "mla"])
def test_entropy_gated_chains_stop_where_the_path_value_falls_to_tau(tiny_engine, drafter_name):
    """With `path_threshold` tau a chain drafter stops after the first token at which the product
    of its top-1 probabilities is <= tau (EntMTP's score over a chain)."""
    prompt = repeating_prompt(3)

    def propose(params: dict):
        drafter = make_drafter(drafter_name, {"adaptive": False, **params}, tiny_engine.draft_model)
        drafter.reset(prompt, SamplingParams())
        return drafter.propose(15)

    full = propose({})
    values = full.logits.softmax(-1).amax(-1).double().cumprod(0)
    for depth in (1, 4, 9):
        gated = propose({"path_threshold": float(values[depth - 1] + values[depth]) / 2})
        assert gated.tokens.tolist() == full.tokens[: depth + 1].tolist()


def test_mla_uses_fewer_draft_forwards_than_the_plain_draft(tiny_engine):
    prompt = repeating_prompt(0, length=40)
    counts = {}
    for name in ("model", "mla"):
        drafter = make_drafter(name, {"adaptive": False}, tiny_engine.draft_model)
        drafter.reset(prompt, SamplingParams())
        tokens = drafter.propose(12).tokens.tolist()
        counts[name] = (drafter.forwards, tokens)
    assert counts["mla"][1] == counts["model"][1]
    assert counts["mla"][0] < counts["model"][0]


def test_prompt_lookup_matches_longest_ngram_first():
    params = PromptLookupParams(max_ngram=3, min_ngram=1, num_pred_tokens=4)
    context = [1, 2, 3, 9, 9, 7, 2, 3, 5, 6, 1, 2, 3]
    assert lookup_continuation(context, params, 10) == (3, [9, 9, 7, 2])  # earliest 3-gram match
    latest = params.model_copy(update={"match": "latest"})
    assert lookup_continuation(context + [9, 1, 2, 3], latest, 10) == (3, [9, 1, 2, 3])
    assert lookup_continuation(context + [9, 1, 2, 3], params, 10) == (3, [9, 9, 7, 2])
    assert lookup_continuation(context, params, 2) == (3, [9, 9])
    assert lookup_continuation([5, 6, 7, 8], params, 10) == (0, [])
    assert lookup_continuation([4, 8, 1, 4], params, 10) == (1, [8, 1, 4])  # falls back to a 1-gram
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupParams(max_ngram=1, min_ngram=2)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_sampled_generation_is_reproducible_under_a_seed(tiny_engine, policy):
    if not POLICIES[policy].supports_sampling:
        pytest.skip("greedy-only policy")
    prompt = repeating_prompt(3)
    runs = [
        tiny_engine.complete(
            request(prompt, policy=policy, drafter="model", temperature=0.8, top_p=0.95, seed=seed)
        ).token_ids
        for seed in (11, 11, 12)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_speculative_sampling_end_to_end_emits_the_target_distribution(tiny_target):
    """rejection with a sampled model draft that often disagrees: the first token of 1,500
    seeded requests follows the target's warped distribution (chi-square over the 12 likeliest
    tokens plus the rest, fixed seeds, fails if p < 1e-3). Exercises the drafter's p_d, the
    wire-free verify path, the residual and the sampler together."""
    engine = SpeculativeEngine(tiny_target, None, perturbed_copy(tiny_target, 0.02))
    prompt = repeating_prompt(4)
    sampling = {"temperature": 0.25, "top_k": 60, "max_tokens": 2}
    with torch.inference_mode():
        logits = tiny_target(torch.tensor([prompt])).logits[0, -1]
    target_probs = sampling_probs(logits[None], SamplingParams(**sampling))[0]
    likeliest = target_probs.topk(12).indices
    bins = torch.full((TINY_VOCAB,), len(likeliest), dtype=torch.long)
    bins[likeliest] = torch.arange(len(likeliest))
    counts = torch.zeros(len(likeliest) + 1)
    num_drafted = num_accepted = 0
    num_draws = 1500
    for seed in range(num_draws):
        body = request(prompt, policy="rejection", drafter="model", k=1, seed=seed, **sampling)
        # two tokens to emit cannot pay for the draft's prefill at its default price: priced free
        body.drafter.params["prefill_cost"] = 0.0
        completion = engine.complete(body)
        counts[bins[completion.token_ids[0]]] += 1
        num_drafted += completion.metrics["spec_decode_num_draft_tokens"]
        num_accepted += completion.metrics["spec_decode_num_accepted_tokens"]
    assert 0.2 < num_accepted / num_drafted < 0.9  # the draft is neither the target nor useless
    expected = torch.zeros(len(likeliest) + 1).index_add_(0, bins, target_probs) * num_draws
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3, (counts, expected)


def test_eos_and_max_tokens_finish_the_request():
    target = tiny_llama(seed=3)
    engine = SpeculativeEngine(target, None, None)
    prompt = repeating_prompt(5)
    free_run = engine.complete(request(prompt, drafter="pld", max_tokens=30)).token_ids
    eos = free_run[10]
    engine.frontend.eos_ids = {eos}
    stopped = engine.complete(request(prompt, drafter="pld", max_tokens=30))
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert stopped.token_ids == free_run[: free_run.index(eos) + 1]  # the stop token stays (vLLM)
    ignoring = engine.complete(request(prompt, drafter="pld", max_tokens=30, ignore_eos=True))
    assert ignoring.token_ids == free_run and ignoring.finish_reason == "length"


def test_bad_requests_raise_clear_errors(tiny_engine):
    prompt = repeating_prompt(0)
    cases = [
        (dict(prompt_ids=[]), "must not be empty"),
        (dict(prompt=""), "must not be empty"),
        (dict(), "exactly one of prompt"),
        (dict(prompt_ids=prompt, num_draft_tokens=0), "greater than or equal to 1"),
        (dict(prompt_ids=prompt, sampling={"temperature": -0.5}), "greater than or equal to 0"),
        (dict(prompt_ids=prompt, sampling={"top_p": 0.0}), "greater than 0"),
        (dict(prompt_ids=prompt, sampling={"max_tokens": -1}), "greater than or equal to 0"),
        (dict(prompt_ids=prompt, sampling={"max_tokens": 4, "min_tokens": 5}), "min_tokens must be <= max_tokens"),
        (dict(prompt_ids=prompt, sampling={"stop": [""]}), "stop strings must not be empty"),
        (dict(prompt_ids=prompt, sampling={"seed": 2**70}), "less than 9223372036854775808"),
        (dict(prompt_ids=prompt, sampling={"logprobs": 21}), "less than or equal to 20"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            GenerationRequest(**fields)
    engine_cases = [
        (request(prompt, policy="nope"), "unknown policy 'nope'"),
        (request(prompt, drafter="nope"), "unknown drafter 'nope'"),
        (request(prompt, policy="greedy", temperature=0.7), "needs temperature 0"),
        (request([TINY_VOCAB + 5]), r"prompt: token ids must lie in \[0, 512\)"),
        (request(prompt, max_tokens=2000), "prompt has 24 tokens"),
        (GenerationRequest(prompt="hi"), "this engine has no tokenizer"),
        (GenerationRequest(prompt_ids=prompt, sampling={"top_k": 3_000_000_000 % 2**31}), "top_k must be <= the voc"),
    ]
    for bad, message in engine_cases:
        with pytest.raises(SpecdecError, match=message) as raised:
            tiny_engine.complete(bad)
        assert raised.value.param in ("policy", "drafter", "prompt", "top_k")
    with pytest.raises(DrafterError, match="needs a draft model"):
        SpeculativeEngine(tiny_engine.target_model).complete(request(prompt, drafter="model"))
    with pytest.raises(DrafterError, match="num_pred_tokens"):
        tiny_engine.complete(
            GenerationRequest(prompt_ids=prompt, drafter={"name": "pld", "params": {"num_pred_tokens": 0}})
        )
    for verify_cost in ([], [1.1, -1.0], "cheap"):
        with pytest.raises(DrafterError, match="verify_cost"):
            tiny_engine.complete(
                GenerationRequest(prompt_ids=prompt, drafter={"name": "pld", "params": {"verify_cost": verify_cost}})
            )


LOOSE_FLY = {"name": "fly", "params": {"theta": 0.0, "window": 0}}  # accepts mismatches on the tiny pair


@pytest.mark.parametrize(
    "policy, temperature", [({"name": "greedy"}, 0.0), (LOOSE_FLY, 0.0), ({"name": "rejection"}, 0.8)]
)
def test_log_probs_are_the_targets_at_the_emitted_tokens(tiny_engine, policy, temperature):
    """Accepted drafts (loose ones too), corrections and bonus tokens alike: the target's own
    log-prob at T = 1."""
    prompt = repeating_prompt(3)
    completion = tiny_engine.complete(
        GenerationRequest(
            prompt_ids=prompt,
            policy=policy,
            drafter={"name": "model"},
            sampling={"max_tokens": 24, "temperature": temperature, "seed": 1, "logprobs": 3},
        )
    )
    assert completion.metrics["spec_decode_num_accepted_tokens"] > 0
    assert completion.metrics.get("loose", 1) > 0
    assert_target_log_probs(completion.log_probs, tiny_engine.target_model, prompt, completion.token_ids, 3)


def test_metrics_count_drafts_and_the_policys_own_counters(tiny_target):
    """The draft counters add up, and a policy reports exactly the counters it declares: FLy with
    its gate and window open (theta = 0, W = 0) accepts every drafted token and counts the ones
    the target disagreed with as loose; with the gate shut it is greedy, with no loose token."""
    engine = SpeculativeEngine(tiny_target, None, perturbed_copy(tiny_target, 0.02))
    prompt = repeating_prompt(0)

    def run(policy: str, **params):
        return engine.complete(
            GenerationRequest(
                prompt_ids=prompt,
                policy={"name": policy, "params": params},
                drafter={"name": "model"},
                num_draft_tokens=15,
                sampling={"max_tokens": 40},
            )
        )

    greedy = run("greedy")
    assert not {"loose", "pardoned", "penalized"} & set(greedy.metrics)
    open_gate = run("fly", theta=0.0, window=0).metrics
    assert open_gate["acceptance_rate"] == 1.0 and open_gate["completion_tokens"] == 40
    assert 0 < open_gate["loose"] <= open_gate["spec_decode_num_accepted_tokens"]
    assert not {"pardoned", "penalized"} & set(open_gate)
    shut_gate = run("fly", theta=float("inf"))
    assert shut_gate.metrics["loose"] == 0 and shut_gate.token_ids == greedy.token_ids
    for metrics in (greedy.metrics, open_gate):
        assert sum(metrics["spec_decode_num_accepted_tokens_per_pos"]) == metrics["spec_decode_num_accepted_tokens"]
        assert metrics["mean_acceptance_length"] == pytest.approx(
            1 + metrics["spec_decode_num_accepted_tokens"] / metrics["spec_decode_num_drafts"], abs=1e-3
        )


def test_defaults_fill_in_what_a_request_leaves_out(tiny_engine):
    """No policy: greedy at temperature 0 and rejection when sampling (the engine's
    RequestDefaults); no drafter or K: the defaults' pld and K."""
    prompt = repeating_prompt(2)
    prepared = tiny_engine.frontend.prepare(GenerationRequest(prompt_ids=prompt))
    assert (prepared.policy.name, prepared.drafter.name, prepared.num_draft_tokens) == ("greedy", "pld", 8)
    sampled = GenerationRequest(prompt_ids=prompt, sampling={"temperature": 0.8, "seed": 3, "max_tokens": 20})
    assert tiny_engine.frontend.prepare(sampled).policy.name == "rejection"
    explicit = GenerationRequest(
        **{**sampled.model_dump(), "policy": {"name": "rejection"}, "drafter": {"name": "pld"}}
    )
    assert tiny_engine.complete(sampled).token_ids == tiny_engine.complete(explicit).token_ids


def test_block_length_follows_acceptance_and_cost():
    from specdec_core.drafters.block_length import best_block, block_cost

    def linear(per_token: float) -> list[float]:
        return [1.0 + per_token * k for k in range(1, 4)]

    assert block_cost(linear(0.1), 0) == 1.0 and block_cost(linear(0.1), 6) == pytest.approx(1.6)  # mean slope
    assert best_block(0.95, 10, linear(0.03)).length == 10  # cheap verify, reliable lookups: full block
    assert best_block(0.05, 10, linear(0.1)).length == 0  # unreliable lookups do not pay for a verify
    assert best_block(0.6, 10, [1.0]).length == 10  # free verification: always the longest block
    assert 0 < best_block(0.6, 10, linear(0.2)).length < 10
    # a step-shaped curve (memory-bound up to 3 drafts): stop just before the step
    assert best_block(0.6, 10, [1.05, 1.08, 1.1, 1.6, 1.7, 1.8]).length == 3


def test_block_length_shrinks_with_the_target_batch_and_stops_where_drafting_stops_paying(tiny_engine):
    """Under load a step holds B sessions' blocks: the same curve prices B (k + 1) tokens against
    B, so k falls as B grows, to 0 for lookups; one session is the unbatched rule."""
    from specdec_core.drafters.block_length import DEFAULT_VERIFY_COST, best_block

    lengths = [best_block(0.6, 15, DEFAULT_VERIFY_COST, batch_rows=rows).length for rows in (1, 2, 4, 8, 16, 64)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1] == 0
    assert lengths[0] == best_block(0.6, 15, DEFAULT_VERIFY_COST).length
    # a curve flat up to 64 tokens (a GPU's memory-bound regime): batching costs drafting nothing
    flat = [1.0] * 63 + [2.0]
    assert best_block(0.6, 15, flat, batch_rows=4).length == 15
    # draft forwards are paid per session: model drafting shrinks faster than lookups
    assert best_block(0.8, 15, flat, 0.3, batch_rows=4).length < best_block(0.8, 15, flat, batch_rows=4).length
    # a model drafter drafts at least a token alone (to keep learning), none where load makes it a loss
    drafter = make_drafter("mla", {}, tiny_engine.draft_model)
    drafter.reset(repeating_prompt(2), SamplingParams())
    assert drafter.propose(15, batch_rows=1).num_tokens >= 1
    assert drafter.propose(15, batch_rows=64).num_tokens == 0
    # under load mla's levels compete: with draft forwards too dear to pay, it proposes what its
    # lookup level finds, as pld would, with no draft forward; alone it still checks with the draft
    dear_drafts = {"verify_cost": flat, "draft_cost": 0.5}  # alone a draft pays, beside 7 others not
    loaded = make_drafter("mla", dear_drafts, tiny_engine.draft_model)
    lookups = make_drafter("pld", {"verify_cost": flat, "match": "earliest"})  # mla's lookup rule
    for session in (loaded, lookups):
        session.reset(repeating_prompt(2), SamplingParams())
    block = loaded.propose(15, batch_rows=8)
    assert loaded.forwards == 0 and block.num_tokens > 0
    assert block.tokens.tolist() == lookups.propose(15, batch_rows=8).tokens.tolist()
    ngram, model_estimate = loaded.lookups.last_proposal[0], loaded.estimate.accepted
    lookup_estimate = loaded.lookups.estimates[ngram].accepted
    loaded.commit(block.tokens.tolist()[:2])  # one draft kept, then a correction
    assert loaded.lookups.estimates[ngram].accepted == lookup_estimate + 1  # the level that proposed learns
    assert loaded.estimate.accepted == model_estimate
    assert loaded.propose(15, batch_rows=1).num_tokens >= 1 and loaded.forwards >= 1


def test_a_draft_that_cannot_earn_back_its_prefill_is_left_out_of_the_request(tiny_engine):
    """draft_pays weighs the target steps a draft saves over the tokens a request may still emit
    against the draft's prefill of its prompt; where it loses, `model` drafts nothing and `mla`
    proposes what pld would, with no draft forward, for the whole request; the output stays
    target-only greedy's."""
    from specdec_core.drafters.block_length import draft_pays

    assert draft_pays(1.5, 96, 1000, 0.03) and not draft_pays(1.5, 96, 1000, 0.04)  # saves 32 steps
    assert not draft_pays(1.0, 10**6, 1, 0.0)  # no saving without value
    prompt = repeating_prompt(2, length=40)
    lookups = make_drafter("pld", {"match": "earliest"})  # mla's lookup rule
    lookups.reset(prompt, SamplingParams(max_tokens=40))
    outcomes = {}
    for name in ("model", "mla"):
        for prefill_cost in (0.0, 1.0):  # 40 prompt tokens: 0 or 40 target steps, against 40 tokens to emit
            drafter = make_drafter(name, {"prefill_cost": prefill_cost}, tiny_engine.draft_model)
            drafter.reset(prompt, SamplingParams(max_tokens=40))
            block = drafter.propose(15)
            outcomes[name, prefill_cost] = (drafter.forwards, block.tokens.tolist())
    assert outcomes["model", 0.0][0] > 0 and outcomes["mla", 0.0][0] > 0
    assert outcomes["model", 1.0] == (0, [])
    assert outcomes["mla", 1.0] == (0, lookups.propose(15).tokens.tolist()) and outcomes["mla", 1.0][1]
    reference = tiny_engine.complete(request(prompt, drafter="none", max_tokens=40)).token_ids
    for name in ("model", "mla"):
        left_out = {"name": name, "params": {"prefill_cost": 1.0}}
        sampling = {"max_tokens": 40}
        assert (
            tiny_engine.complete(GenerationRequest(prompt_ids=prompt, drafter=left_out, sampling=sampling)).token_ids
            == reference
        )


def test_measured_draft_costs_price_the_model_drafters_unless_a_request_names_its_own(tiny_target, tiny_engine):
    """The engine's draft costs (draft_costs.py) become the model drafters' defaults; the eagle3
    layer's own draft_cost and drafters without a draft model keep theirs; a request's own
    values win. Measured, they are positive ratios, cached per machine and pair."""
    from specdec_core.calibration.draft_costs import DraftCosts, measure_draft_costs

    costs = DraftCosts(draft_cost=0.7, prefill_cost=0.05)
    engine = SpeculativeEngine(tiny_target, None, tiny_engine.draft_model, draft_costs=costs)

    def priced(name, params=None):
        return engine.frontend.priced(ComponentSpec(name=name, params=params or {})).params

    assert {key: priced("mla")[key] for key in ("draft_cost", "prefill_cost")} == costs.model_dump()
    assert priced("model_tree")["draft_cost"] == 0.7 and "prefill_cost" not in priced("model_tree")
    assert "draft_cost" not in priced("eagle3") and "draft_cost" not in priced("pld")
    assert priced("model", {"draft_cost": 0.2})["draft_cost"] == 0.2
    assert "draft_cost" not in tiny_engine.frontend.priced(ComponentSpec(name="model")).params
    measured = measure_draft_costs(tiny_target, tiny_engine.draft_model)
    assert measured.draft_cost > 0 and measured.prefill_cost > 0
    assert "target steps" in measured.verdict()


def test_only_exact_greedy_requests_follow_the_targets_load(tiny_engine):
    """The loop hands the target's batch size to the drafter for greedy decoding with a lossless
    policy only: a sampled or lossy request's tokens depend on its blocks."""
    from specdec_core.drafters import NoDrafter
    from specdec_core.loop.engine import speculative_loop
    from specdec_core.loop.sessions import Immediate, run_immediately

    class Recording(NoDrafter):
        def propose(self, max_tokens, batch_rows=1):
            self.seen.append(batch_rows)
            return super().propose(max_tokens, batch_rows)

    class Loaded(TargetScorer):  # a target whose every step held 7 sessions
        def score(self, tokens):
            block = super().score(tokens)
            block.batch_rows = 7
            return block

    seen = {}
    for policy, temperature in (("greedy", 0.0), ("rejection", 0.0), ("fly", 0.0), ("rejection", 0.8)):
        sampling = {"max_tokens": 4, "temperature": temperature}
        request = GenerationRequest(prompt_ids=repeating_prompt(3), policy={"name": policy}, sampling=sampling)
        drafter = Recording()
        drafter.seen = []
        prepared = tiny_engine.frontend.prepare(request)
        target = Loaded(tiny_engine.target_model)
        output = tiny_engine.frontend.output(prepared)
        list(run_immediately(speculative_loop(prepared, Immediate(drafter), Immediate(target), output)))
        seen[policy, temperature] = set(drafter.seen[1:])
    assert seen == {("greedy", 0.0): {7}, ("rejection", 0.0): {7}, ("fly", 0.0): {1}, ("rejection", 0.8): {1}}


def test_the_loop_runs_without_an_event_loop_only_over_sessions_that_never_wait(tiny_engine):
    """`run_immediately` drives the async loop over local sessions; a session whose call really
    waits (a remote one) is refused with a message instead of being silently skipped."""
    import asyncio

    from specdec_core.drafters import NoDrafter
    from specdec_core.loop.engine import speculative_loop
    from specdec_core.loop.sessions import Immediate, run_immediately

    class Waits(Immediate):
        async def score(self, tokens, draft=None):
            await asyncio.sleep(0)
            return await super().score(tokens, draft)

    request = GenerationRequest(prompt_ids=repeating_prompt(3), drafter={"name": "none"}, sampling={"max_tokens": 4})
    prepared = tiny_engine.frontend.prepare(request)
    output = tiny_engine.frontend.output(prepared)
    target = Waits(TargetScorer(tiny_engine.target_model))
    with pytest.raises(RuntimeError, match="waited"):
        list(run_immediately(speculative_loop(prepared, Immediate(NoDrafter()), target, output)))


def test_adaptive_prompt_lookup_learns_from_commits():
    drafter = make_drafter("pld", {"verify_cost": [1.3, 1.6]})
    drafter.reset([1, 2, 3, 1], SamplingParams())
    assert drafter.propose(10).tokens.tolist() == [2]  # 1-gram match; prior a = 1/2 pays for k = 1
    drafter.commit([3])  # rejected at its first token: a = 1/3
    assert drafter.propose(10).tokens.tolist() == [1]
    drafter.commit([2])  # rejected again: a = 1/4 no longer pays for a verify at this cost
    assert drafter.propose(10).num_tokens == 0
    fixed = make_drafter("pld", {"adaptive": False})
    fixed.reset([1, 2, 3, 1, 3, 2], SamplingParams())
    assert fixed.propose(10).tokens.tolist() == [3, 1, 3, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_is_batch_invariant_and_matches_linear(dtype):
    """Each row of an n-row PackedLinear call is bitwise the row computed alone (so a token's
    logits do not depend on the verify block it sits in), it matches F.linear, and the packed
    copy follows in-place weight changes. bf16 (the draft) is packed where oneDNN supports it."""
    from specdec_core.models.kernels.linear import PackedLinear, packable_dtypes

    if dtype not in packable_dtypes():
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40).to(dtype)
    packed = torch.nn.Linear(24, 40).to(dtype)
    packed.load_state_dict(linear.state_dict())
    packed.__class__ = PackedLinear
    assert packed._packed_weight() is not None
    x = torch.randn(1, 40, 24).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([packed(x[:, row : row + 1]) for row in range(40)], dim=1)
        for num_rows in (1, 2, 3, 5, 8, 16, 17, 40):
            out = packed(x[:, :num_rows])
            assert out.shape == (1, num_rows, 40) and out.is_contiguous() and out.dtype == dtype
            assert torch.equal(out, alone[:, :num_rows])
            torch.testing.assert_close(out, linear(x[:, :num_rows]), **tolerance)
    with torch.no_grad():
        packed.weight.mul_(2.0)
        linear.weight.mul_(2.0)
        torch.testing.assert_close(packed(x), linear(x), **tolerance)
    trained = packed(x)  # autograd needs F.linear's backward
    assert trained.grad_fn is not None
    torch.testing.assert_close(trained, linear(x), **tolerance)


def test_grouped_sdpa_equals_transformers_sdpa():
    """The grouped-head attention gives transformers' sdpa logits on a prefill (causal flag, no
    mask) and on verify blocks after it (masked, cache longer than the block), and the model
    really runs it."""
    plain = tiny_llama(seed=5, prepared=False)
    grouped = tiny_llama(seed=5)
    assert grouped.config._attn_implementation == "sdpa_grouped" and plain.config._attn_implementation == "sdpa"
    prompt = repeating_prompt(5, length=40)
    scorers = [greedy_scorer(model, prompt) for model in (plain, grouped)]
    reference, result = (fresh_logits(model, prompt) for model in (plain, grouped))
    torch.testing.assert_close(result, reference, atol=1e-6, rtol=1e-6)
    for block in ([7], [7, 8, 9], list(range(20, 36))):
        reference, result = (scorer.score(block).logits for scorer in scorers)
        torch.testing.assert_close(result, reference, atol=1e-6, rtol=1e-6)
        for scorer in scorers:
            scorer.commit(1)


def test_grouped_low_precision_attention_matches_sdpa_and_runs_for_low_precision_steps(monkeypatch):
    """The low-precision attention equals SDPA (float64 reference, bf16 tolerance) with no mask, a
    boolean mask and an additive one, each query head reading its own KV group, for one query and
    several; a bf16 model's steps run it and give transformers' sdpa logits within bf16 rounding."""
    from specdec_core.models.kernels import attention

    generator = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 2, 2, 30, 16, generator=generator)
    for num_queries in (1, 3):
        query = torch.randn(2, 6, num_queries, 16, generator=generator)
        keep = torch.rand(2, 1, num_queries, 30, generator=generator) > 0.3
        keep[..., 0] = True  # every query sees a key
        additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
        for mask in (None, keep, additive):
            reference = torch.nn.functional.scaled_dot_product_attention(
                query.double(), key.double(), value.double(), attn_mask=mask, enable_gqa=True
            ).transpose(1, 2)
            low = (query.bfloat16(), key.bfloat16(), value.bfloat16())
            result = attention.grouped_low_precision_attention(*low, mask)
            torch.testing.assert_close(result.double(), reference, atol=3e-2, rtol=0)

    from specdec_core.runtime import ragged_attention

    calls = []
    original = ragged_attention.grouped_low_precision_attention
    monkeypatch.setattr(
        ragged_attention, "grouped_low_precision_attention", lambda *args: calls.append(1) or original(*args)
    )
    plain, grouped = (tiny_llama(seed=5, prepared=prepared).to(torch.bfloat16) for prepared in (False, True))
    prompt = repeating_prompt(5, length=40)
    scorer = greedy_scorer(grouped, prompt)
    calls.clear()  # the prompt's prefill ran it too
    fed = prompt[:-1]  # the scorer holds all but the prompt's last token; each score feeds one
    for token in (7, 8, 9):
        fed = [*fed, token]
        with torch.inference_mode():  # transformers' own sdpa over the whole sequence
            reference = plain(torch.tensor([fed])).logits[0, -1:].float()
        torch.testing.assert_close(scorer.score([token]).logits, reference, atol=3e-2, rtol=0)
        scorer.commit(1)
    assert len(calls) == 3 * grouped.config.num_hidden_layers


def test_lookup_replay_reproduces_the_engine_and_the_oracle_bounds_it(tiny_engine):
    """Replaying a target-only greedy output through the pld drafter proposes exactly what the
    engine proposed; the copy oracle is never costlier than the replay."""
    from specdec_core.drafters.block_length import block_cost
    from specdec_core.drafters.pld import AdaptiveLookupParams
    from specdec_core.tools.benchmarks.lookup_ceiling import (
        cheapest_cost,
        copyable_lengths,
        lookup_lengths,
        replay_drafter,
    )

    params = AdaptiveLookupParams()
    for seed in range(3):
        prompt = repeating_prompt(seed)
        reference = tiny_engine.complete(request(prompt, drafter="none")).token_ids
        metrics = tiny_engine.complete(request(prompt, drafter="pld", k=6)).metrics
        proposed = replay_drafter(prompt, reference, params, max_draft=6)
        assert len(proposed) == metrics["num_steps"]
        assert sum(proposed) == metrics["spec_decode_num_draft_tokens"] > 0
        replayed = sum(block_cost(params.verify_cost, k) for k in proposed)
        # each oracle sees every proposal the one before it could make
        length_oracle = cheapest_cost(lookup_lengths(prompt, reference, params, 6), params.verify_cost)
        ngram_oracle = cheapest_cost(copyable_lengths(prompt, reference, 6, key_length=1), params.verify_cost)
        copy_oracle = cheapest_cost(copyable_lengths(prompt, reference, 6), params.verify_cost)
        assert copy_oracle <= ngram_oracle <= length_oracle <= replayed + 1e-9
        assert length_oracle < len(reference)


def test_copy_oracle_on_a_hand_built_output():
    from specdec_core.tools.benchmarks.lookup_ceiling import cheapest_cost, copyable_lengths

    # the longest upcoming run found in prompt + output so far; the last token is the target's
    assert copyable_lengths([1, 2, 3, 4], [1, 2, 3, 9, 1, 2], 10) == [3, 2, 1, 0, 1, 0]
    assert copyable_lengths([1, 2, 3, 4], [1, 2, 3, 9, 1, 2], 2) == [2, 2, 1, 0, 1, 0]
    # keyed by the last token: a continuation must follow an earlier copy of it
    assert copyable_lengths([5, 1, 2, 3, 4], [1, 2, 3, 9, 1, 2], 10, key_length=1) == [0, 2, 1, 0, 0, 0]
    assert cheapest_cost([3, 2, 1, 0, 1, 0], [1.0] * 10) == 2.0  # free verify: 4 + 2 tokens in 2 steps
    assert cheapest_cost([3, 2, 1, 0, 1, 0], [2.0] * 10) == 4.0  # one 3-draft step (2.0) beats 4 plain steps
    assert cheapest_cost([0, 0, 0], [1.1]) == 3.0


def test_random_weights_of_a_config_load_the_same_twice_and_decode_from_token_ids(tmp_path):
    """`random:<config>` (timing real shapes without a checkpoint): seed-0 weights, equal on every
    load, no tokenizer; the engine serves token-id prompts with it."""
    from specdec_core import ModelSpec
    from specdec_core.models.loader import load_model, load_tokenizer

    config = {
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = ModelSpec(source=f"random:{tmp_path / 'config.json'}")
    first, second = load_model(spec), load_model(spec)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert load_tokenizer(spec) is None and first.config.hidden_size == 64
    engine = SpeculativeEngine.from_specs(spec, spec)
    speculative, target_only = (
        GenerationRequest(prompt_ids=[1, 2, 3, 4, 5, 6], drafter={"name": drafter}, sampling={"max_tokens": 8})
        for drafter in ("model", "none")
    )
    assert engine.complete(speculative).token_ids == engine.complete(target_only).token_ids


def test_an_unseeded_request_gets_one_fresh_seed_for_all_its_parts(tiny_engine):
    """Drawn once in prepare: the verifier, the drafter, the target's features and every
    tensor-parallel rank (which receive the prepared sampling) draw from streams of one seed."""
    prepare = tiny_engine.frontend.prepare
    unseeded = GenerationRequest(prompt_ids=repeating_prompt(1), sampling={"temperature": 1.0, "max_tokens": 4})
    seeds = {prepare(unseeded).sampling.seed for _ in range(3)}
    assert None not in seeds and len(seeds) == 3
    seeded = GenerationRequest(
        prompt_ids=repeating_prompt(1), sampling={"temperature": 1.0, "seed": 9, "max_tokens": 4}
    )
    assert prepare(seeded).sampling.seed == 9
