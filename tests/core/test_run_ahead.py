"""run_ahead.py: a draft model's next block drafted while the target verifies. In process the
proposals run one after the other (the same tokens as served, where they overlap): greedy
output stays target-only output, a seed reproduces a sampled output, and tokens verified from
a used ahead proposal follow the target's distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec_core import GenerationRequest
from specdec_core.api.sampling import SamplingParams, sampling_probs
from specdec_core.drafters import make_drafter

from helpers.tiny_models import repeating_prompt


@pytest.fixture(scope="module")
def engine(sharp_engine):
    return sharp_engine


def request(drafter: str, run_ahead: bool, policy: str = "greedy", k: int = 4, **sampling) -> GenerationRequest:
    sampling.setdefault("max_tokens", 40)
    return GenerationRequest(
        prompt_ids=repeating_prompt(6),
        policy={"name": policy},
        drafter={"name": drafter},
        num_draft_tokens=k,
        run_ahead=run_ahead,
        sampling=sampling,
    )


@pytest.mark.parametrize("drafter", ["model", "mla", "model_tree", "mla_tree"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_with_run_ahead_is_target_only_output(engine, drafter, k):
    target_only = engine.complete(request("none", False)).token_ids
    completion = engine.complete(request(drafter, True, k=k))
    assert completion.token_ids == target_only
    counts = completion.metrics["run_ahead"]
    # every drafted block but the last started an ahead proposal, used or not
    assert (
        counts["used"] > 0 and counts["used"] + counts["discarded"] >= completion.metrics["spec_decode_num_drafts"] - 1
    )
    assert engine.complete(request(drafter, False, k=k)).token_ids == target_only


def test_lookups_draft_inline(engine):
    assert "run_ahead" not in engine.complete(request("pld", True, max_tokens=8)).metrics


@pytest.mark.parametrize("drafter", ["model_tree", "mla_tree"])
def test_a_used_ahead_tree_is_the_tree_drafted_after_its_outcome(engine, drafter):
    """A tree's ahead proposal assumes its top-1 path kept and then the draft's likeliest token:
    past that guess it is the tree a fresh drafter proposes after that outcome, node for node,
    and cut to a shallower depth it keeps that depth's nodes."""
    from specdec_core.loop.run_ahead import assumed_tokens, next_block

    prompt = repeating_prompt(6)
    ahead, fresh = (make_drafter(drafter, {}, engine.draft_model) for _ in range(2))
    ahead.reset(prompt, SamplingParams())
    block = ahead.propose(4)
    path = assumed_tokens(block)
    assert len(path) == block.tree.max_depth
    proposal = ahead.propose(4, after=path)
    fresh.reset([*prompt, *path, int(proposal.tokens[0])], SamplingParams())
    expected = fresh.propose(4)
    assert next_block(proposal, 4).tokens.tolist() == expected.tokens.tolist()
    assert next_block(proposal, 4).tree is expected.tree
    shallow = next_block(proposal, 2)
    assert shallow.tree.max_depth == 2 and shallow.tokens.tolist() == fresh.propose(2).tokens.tolist()
    assert next_block(proposal, 0).num_tokens == 0  # the request's last token: a plain step


def test_a_seed_reproduces_sampled_output_with_run_ahead(engine):
    sampling = {"temperature": 0.7, "top_k": 60}
    runs = [engine.complete(request("model", True, "rejection", seed=seed, **sampling)) for seed in (3, 3, 4)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].metrics["run_ahead"] == runs[1].metrics["run_ahead"]
    assert runs[0].token_ids != runs[2].token_ids
    assert runs[0].metrics["run_ahead"]["used"] > 0


def test_an_ahead_block_carries_the_draft_rows_of_the_positions_it_is_verified_at(engine):
    """What rejection sampling needs of a draft: each ahead token sampled from the draft's warped
    distribution where the target verifies it (after block t and the guess), and its logits row
    and p_d from that position; the guess is the draft's likeliest token after block t."""
    drafter = make_drafter("model", {}, engine.draft_model)
    sampling = SamplingParams(temperature=0.7, top_k=60, seed=1)
    prompt = repeating_prompt(6)
    drafter.reset(prompt, sampling)
    block = drafter.propose(4).tokens.tolist()
    ahead = drafter.propose(4, 1, block)
    guess, tokens = int(ahead.tokens[0]), ahead.tokens[1:]
    with torch.inference_mode():
        logits = engine.draft_model(torch.tensor([[*prompt, *block, guess, *tokens[:-1].tolist()]])).logits[0]
    assert guess == int(logits[-len(tokens) - 1].argmax())
    rows = logits[-len(tokens) :].float()
    torch.testing.assert_close(ahead.logits[1:], rows, atol=1e-4, rtol=1e-4)
    expected = sampling_probs(rows, sampling).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(ahead.token_probs[1:], expected, atol=1e-5, rtol=1e-4)


def test_tokens_verified_from_ahead_proposals_follow_the_target(engine):
    """rejection, K = 1, 4 tokens, 1,500 seeds: the third token is verified from the ahead
    proposal whenever the first step kept its draft and the target's bonus was the draft's guess
    (about a third of the runs here). Each third token's randomized probability integral transform
    under the target's warped distribution after its own first two tokens is uniform when the
    tokens follow the target (chi-square over 10 bins, fixed seeds, fails if p < 1e-3)."""
    sampling = {"temperature": 0.7, "top_k": 60, "max_tokens": 4}
    completions = [
        engine.complete(request("model", True, "rejection", k=1, seed=seed, **sampling)) for seed in range(1500)
    ]
    assert sum(completion.metrics["run_ahead"]["used"] for completion in completions) > 450
    generator = torch.Generator().manual_seed(0)
    transforms = []
    with torch.inference_mode():
        for completion in completions:
            first_two, third = completion.token_ids[:2], completion.token_ids[2]
            logits = engine.target_model(torch.tensor([repeating_prompt(6) + first_two])).logits[0, -1]
            probs = sampling_probs(logits[None], SamplingParams(**sampling))[0].double()
            transforms.append(float(probs[:third].sum() + torch.rand((), generator=generator) * probs[third]))
    counts = torch.histc(torch.tensor(transforms), bins=10, min=0.0, max=1.0)
    assert chisquare(counts.numpy()).pvalue > 1e-3, counts


@pytest.mark.parametrize("run_ahead", [None, True, False])
def test_the_bench_asks_each_request_to_run_ahead_as_told(run_ahead):
    """`specdec bench --run-ahead` (or `--no-run-ahead`) sets every request's; unset, the engine's
    or the service's default holds."""
    from specdec_core.tools.benchmarks.bench import Runner, parse_specdec_method
    from specdec_core.tools.benchmarks.bench_records import BenchConfig

    config = BenchConfig("q", [], ["all"], 1, 8, 0.0, 0, 4, {}, run_ahead=run_ahead)
    request = Runner(None, config).request([1, 2], parse_specdec_method("endpoint:rejection+model"))
    assert request.run_ahead is run_ahead
