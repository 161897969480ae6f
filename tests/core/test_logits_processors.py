"""Penalties, logit_bias and min_p in the target's distribution (target/logits_processors.py):
each row counts the drafts on its path, greedy speculation with them equals target-only decoding
with them (and a plain reference loop), rejection sampling reproduces the processed distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec_core import GenerationRequest, SpecdecError
from specdec_core.api.sampling import SamplingParams, sampling_probs, warp_logits
from specdec_core.loop.stage_types import DraftBlock, TargetBlock
from specdec_core.policies import make_policy
from specdec_core.target.logits_processors import processed_block
from specdec_core.trees.topologies import default_bank
from specdec_core.trees.tree import listed_name

from helpers.tiny_models import repeating_prompt

# at the tiny target's scale (logits of std 0.16): each changes its greedy output, and the draft,
# which knows nothing of them, still agrees often enough that speculation keeps drafts
PROCESSORS = {
    "presence": {"presence_penalty": 0.2},
    "frequency": {"frequency_penalty": 0.15},
    "repetition": {"repetition_penalty": 1.8},
    "logit_bias": {"logit_bias": {7: 0.3, 11: -100.0, 200: 0.25}},
    "all": {
        "presence_penalty": 0.1,
        "frequency_penalty": -0.05,
        "repetition_penalty": 1.3,
        "logit_bias": {7: 0.2, 300: 0.1},
    },
}


def reference_row(logits: torch.Tensor, prompt: list[int], generated: list[int], sampling: SamplingParams):
    """One row processed token by token, as the rules read (OpenAI, vLLM): bias, then repetition
    over prompt and generated tokens, then frequency and presence over the generated ones."""
    row = logits.clone()
    for token, bias in sampling.logit_bias.items():
        row[token] += bias
    for token in set(prompt) | set(generated):
        penalty = sampling.repetition_penalty
        row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    for token in set(generated):
        row[token] -= sampling.frequency_penalty * generated.count(token) + sampling.presence_penalty
    return row


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_each_row_counts_the_drafts_on_its_path(name):
    sampling = SamplingParams(**PROCESSORS[name])
    generator = torch.Generator().manual_seed(0)
    prompt, generated = [3, 9, 7, 3], [5, 9, 5]
    chain = DraftBlock(tokens=torch.tensor([5, 7, 12, 5]))
    tree = default_bank().get(listed_name([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]))
    branched = DraftBlock(tokens=torch.tensor([7, 5, 5, 12, 7]), tree=tree)
    for draft, paths in (
        (chain, [[], [5], [5, 7], [5, 7, 12], [5, 7, 12, 5]]),
        (branched, [[], [7], [5], [7, 5], [7, 12], [7, 5, 7]]),
    ):
        logits = torch.randn(draft.num_tokens + 1, 400, generator=generator) * 3  # [1 + K, V]
        block = processed_block(
            TargetBlock(logits=logits, argmax_ids=[0] * len(paths)), draft, sampling, prompt, generated
        )
        assert block.argmax_ids is None  # a host argmax of the raw rows no longer holds
        for row, path in enumerate(paths):
            expected = reference_row(logits[row], prompt, generated + path, sampling)
            torch.testing.assert_close(block.logits[row], expected, rtol=0, atol=1e-5)
    neutral = TargetBlock(logits=torch.randn(2, 400))
    assert (
        processed_block(neutral, DraftBlock(tokens=torch.tensor([1])), SamplingParams(), prompt, generated) is neutral
    )


def test_min_p_keeps_the_tokens_near_the_top_one_after_temperature():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0, 1.0]])
    probs = (logits / 0.5).softmax(-1)[0]
    kept = warp_logits(logits, SamplingParams(temperature=0.5, min_p=0.2))[0].isfinite()
    assert kept.tolist() == (probs >= 0.2 * probs.max()).tolist() == [True, True, False, False, False]
    assert warp_logits(logits, SamplingParams(temperature=0.5, min_p=1.0))[0].isfinite().sum() == 1


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_tokens: int, sampling: SamplingParams) -> list[int]:
    """Target-only greedy decoding with the processors, one full forward per token."""
    generated: list[int] = []
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([prompt + generated])).logits[0, -1].float()
        generated.append(int(reference_row(logits, prompt, generated, sampling).argmax()))
    return generated


def complete(engine, prompt, drafter, processors, max_tokens=24):
    request = GenerationRequest(
        prompt_ids=prompt,
        policy={"name": "greedy"},
        drafter={"name": drafter},
        num_draft_tokens=6,
        sampling={"max_tokens": max_tokens, **processors},
    )
    return engine.complete(request)


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_greedy_speculation_with_processors_equals_target_only_with_them(tiny_engine, name):
    processors, changed = PROCESSORS[name], 0
    for seed in range(3):
        prompt = repeating_prompt(seed)
        target_only = complete(tiny_engine, prompt, "none", processors)
        assert target_only.token_ids == reference_greedy(
            tiny_engine.target_model, prompt, 24, SamplingParams(**processors)
        )
        changed += target_only.token_ids != complete(tiny_engine, prompt, "none", {}).token_ids
        for drafter in ("pld", "model", "mla"):
            speculative = complete(tiny_engine, prompt, drafter, processors)
            assert speculative.token_ids == target_only.token_ids, (drafter, seed)
            assert speculative.metrics["mean_acceptance_length"] > 1.0 or drafter == "pld"
    assert changed  # the processors reach the output


def test_rejection_sampling_reproduces_the_processed_distribution():
    """A sampled 2-token chain against rows whose penalties count the first draft: 20,000 verifies
    with a fixed seed. The first emitted token follows row 0's processed, warped distribution; the
    second, after the first draft was accepted, row 1's, which penalizes that draft too (chi-square,
    fails if p < 1e-3)."""
    vocab, first_draft = 6, 2
    sampling = SamplingParams(
        temperature=0.9, presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.5, logit_bias={4: 0.8}
    )
    prompt, generated = [1, 5], [0, 0, 3]
    rows = torch.tensor([[0.5, 0.3, 1.2, 0.1, -0.2, 0.4], [0.2, 0.6, 1.5, 0.3, 0.1, -0.5], [0.0] * vocab])
    draft_logits = torch.tensor([[0.1, 0.1, 0.4, 0.2, 0.1, 0.1], [0.3, 0.1, 0.1, 0.1, 0.3, 0.1]]).log()
    draft_probs = sampling_probs(draft_logits, sampling)  # what the draft samples from, warped as the target
    policy, generator = make_policy("rejection"), torch.Generator().manual_seed(7)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(20_000):
        tokens = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]
        draft = DraftBlock(tokens=tokens, logits=draft_logits, token_probs=draft_probs[[0, 1], tokens])
        target = processed_block(TargetBlock(logits=rows), draft, sampling, prompt, generated)
        verdict = policy.verify(draft, target, sampling, generator)
        emitted = [*verdict.kept_tokens(draft), verdict.next_token]
        first[emitted[0]] += 1
        if verdict.num_accepted >= 1 and emitted[0] == first_draft:
            second[emitted[1]] += 1
    for counts, row, path in ((first, 0, []), (second, 1, [first_draft])):
        processed = reference_row(rows[row], prompt, generated + path, sampling)
        expected = sampling_probs(processed[None], sampling)[0]
        result = chisquare(counts.numpy(), (counts.sum() * expected).numpy())
        assert result.pvalue > 1e-3, (row, counts, result)
    # the same row without the first draft in its counts: the rule the test tells apart
    unpenalized = sampling_probs(reference_row(rows[1], prompt, generated, sampling)[None], sampling)[0]
    assert chisquare(second.numpy(), (second.sum() * unpenalized).numpy()).pvalue < 1e-6


def test_bad_processor_settings_are_refused(tiny_engine):
    for sampling, field in (
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**sampling)
    with pytest.raises(SpecdecError, match="logit_bias"):
        complete(tiny_engine, [1, 2, 3], "none", {"logit_bias": {10**6: 1.0}})
    with pytest.raises(SpecdecError, match="dropmatch"):
        tiny_engine.complete(
            GenerationRequest(prompt_ids=[1, 2, 3], policy={"name": "dropmatch"}, sampling={"presence_penalty": 0.5})
        )
