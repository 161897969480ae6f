"""Training an EAGLE-3 layer (specdec_core/tools/training/train_eagle3.py) on a tiny target's own greedy
continuations: the training-time test's steps learn the target's tokens, a rerun resumes, and the
head it writes loads and drafts greedy decoding's own tokens, more than one a step."""

from __future__ import annotations

import json

import torch

from specdec_core.heads.loading import load_heads_from
from specdec_core.tools.training.train_eagle3 import Eagle3TrainSettings, train_eagle3_heads, ttt_logits
from specdec_core.tools.training.train_heads import DistillSettings
from specdec_core.tools.training.training_state import STATE_FILE

from helpers.tiny_models import repeating_prompt, tiny_llama, tiny_profile

DISTILL = DistillSettings(continuation_tokens=24, batch_size=6)
SETTINGS = Eagle3TrainSettings(
    steps=60, draft_vocab=96, sequences_per_step=2, holdout=0.25, checkpoint_every=30, learning_rate=3e-3
)


def test_an_eagle3_layer_trained_on_the_targets_continuations_drafts_them(tmp_path):
    from specdec_core import GenerationRequest, SpeculativeEngine

    target = tiny_llama(seed=7, num_layers=8)
    prompts = [repeating_prompt(seed, length=16) for seed in range(12)]
    draft, log = train_eagle3_heads(target, prompts, tmp_path, DISTILL, SETTINGS)
    assert len(log["accuracy_after"]) == SETTINGS.ttt_steps
    assert all(after > before for before, after in zip(log["accuracy_before"], log["accuracy_after"]))
    assert torch.load(tmp_path / STATE_FILE, weights_only=False)["step"] == SETTINGS.steps
    _, again = train_eagle3_heads(target, prompts, tmp_path, DISTILL, SETTINGS)  # resumes: nothing left to train
    assert again["accuracy_after"] == log["accuracy_after"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]

    heads = load_heads_from(str(tmp_path), target)
    assert torch.equal(heads.d2t, draft.d2t)
    engine = SpeculativeEngine(target, None, None, profile=lambda *_: tiny_profile(), heads={"eagle3": heads})
    for seed in (0, 1):
        requests = [
            GenerationRequest(
                prompt_ids=repeating_prompt(seed, length=16), drafter=drafter, sampling={"max_tokens": 24}
            )
            for drafter in ({"name": "none"}, {"name": "eagle3"})
        ]
        reference, drafted = (engine.complete(request) for request in requests)
        assert drafted.token_ids == reference.token_ids
        assert drafted.metrics["mean_acceptance_length"] > 1.5


def test_a_later_step_reads_its_own_earlier_outputs_and_the_targets_positions_up_to_its_anchor():
    """Step 1's logits at anchor a do not change when a later position's states or tokens do."""
    from specdec_core.tools.measuring.eagle3_cost import random_eagle3

    target = tiny_llama(seed=8, num_layers=8)
    draft = random_eagle3(target)
    states = torch.randn(10, 3 * target.config.hidden_size)
    tokens = torch.randint(0, target.config.vocab_size, (10,))
    embed = target.get_input_embeddings()
    with torch.no_grad():
        first = ttt_logits(draft, embed, states, tokens, steps=2)
        changed_states, changed_tokens = states.clone(), tokens.clone()
        changed_states[6:] += 1.0
        changed_tokens[7:] = (changed_tokens[7:] + 1) % target.config.vocab_size
        second = ttt_logits(draft, embed, changed_states, changed_tokens, steps=2)
    # anchor a reads positions <= a, step 1 also token a + 2: anchors 0..4 are untouched
    for step in range(2):
        assert torch.allclose(first[step][:5], second[step][:5], atol=1e-5)
        assert not torch.allclose(first[step][5:], second[step][5:])


def test_training_sees_what_drafting_sees():
    """Fed a chain the layer drafted (as the true tokens), the training-time test's steps at the
    chain's anchor predict that chain: training and drafting run the same function."""
    from specdec_core.api.sampling import SamplingParams
    from specdec_core.policies import make_policy
    from specdec_core.target.aux_states import aux_states
    from specdec_core.target.scorer import TargetScorer
    from specdec_core.tools.measuring.eagle3_cost import random_eagle3

    target = tiny_llama(seed=9, num_layers=8)
    draft = random_eagle3(target)
    prompt = repeating_prompt(3, length=14)
    scorer = TargetScorer(target, {"eagle3": draft})
    scorer.reset(prompt, make_policy("greedy"), SamplingParams(temperature=0.0), "eagle3")
    chain = scorer.guess(prompt[-1], "chain_4").tokens.tolist()
    sequence = torch.tensor(prompt + chain[:3])
    with torch.no_grad():
        target(sequence[None])
        states = aux_states(target, len(sequence))[0]
        logits = ttt_logits(draft, target.get_input_embeddings(), states, sequence, steps=4)
    anchor = len(prompt) - 2  # the last committed position
    assert [int(draft.target_ids(step[anchor].argmax())) for step in logits] == chain


def test_given_answers_read_teacher_forced_are_labelled_with_the_targets_own_next_tokens(tmp_path):
    """Distilled over given answers, each position's label is the target's argmax there; given the
    target's own greedy continuations as the answers, the data is the self-distilled data."""
    from specdec_core.tools.training.train_eagle3 import distill_eagle3

    target = tiny_llama(seed=7, num_layers=8)
    prompts = [repeating_prompt(seed, length=16) for seed in range(4)]
    own = distill_eagle3(target, prompts, DISTILL, tmp_path / "own")
    continuations = [tokens[len(prompt) :] for tokens, prompt in zip(own["tokens"], prompts)]
    given = distill_eagle3(target, prompts, DISTILL, tmp_path / "given", answers=continuations)
    assert given["tokens"] == own["tokens"]
    for labels, tokens, prompt in zip(given["labels"], own["tokens"], prompts):
        assert labels[len(prompt) - 1 : -1].tolist() == tokens[len(prompt) :]  # greedy: its own next token

    answers = [
        torch.randint(0, target.config.vocab_size, (30,), generator=torch.Generator().manual_seed(seed)).tolist()
        for seed in range(4)
    ]
    text = distill_eagle3(target, prompts, DISTILL, tmp_path / "text", answers=answers)
    for tokens, labels in zip(text["tokens"], text["labels"]):
        assert len(tokens) == 16 + DISTILL.continuation_tokens  # answers cut to continuation_tokens
        with torch.no_grad():
            assert torch.equal(labels.long(), target(torch.tensor([tokens])).logits[0].argmax(-1))
    again = distill_eagle3(target, prompts, DISTILL, tmp_path / "text", answers=[answer[::-1] for answer in answers])
    assert again["tokens"] != text["tokens"]  # other answers: distilled again, not the stored data


def test_each_step_counts_the_predictions_of_the_answers_tokens_and_the_last_positions_next():
    """Step j at anchor a predicts the target's token after position a + j + 1: it counts where
    that is an answer token (a + j + 2 >= the prompt's length) or the one after the sequence."""
    from specdec_core.tools.measuring.eagle3_cost import random_eagle3
    from specdec_core.tools.training.train_eagle3 import ttt_loss

    target = tiny_llama(seed=8, num_layers=8)
    draft = random_eagle3(target)
    n, prompt_length, vocab = 12, 5, target.config.vocab_size
    states = torch.randn(n, 3 * target.config.hidden_size)
    tokens = torch.randint(0, vocab, (n,))
    labels = torch.randint(0, vocab, (n,))
    settings = Eagle3TrainSettings(ttt_steps=3)
    everything = torch.arange(vocab)  # every token in the draft vocabulary
    with torch.no_grad():
        _, _, counted = ttt_loss(
            draft, target.get_input_embeddings(), states, tokens, labels, prompt_length, everything, settings
        )
    # anchors a = 0 .. n - 2 with a + j + 1 <= n - 1 and a + j + 2 >= prompt_length
    assert counted == [(n - 2 - j) - max(0, prompt_length - 2 - j) + 1 for j in range(3)]
    outside = everything.clone()
    outside[labels[prompt_length - 1]] = -1  # a label outside the draft vocabulary is left out
    with torch.no_grad():
        _, _, fewer = ttt_loss(
            draft, target.get_input_embeddings(), states, tokens, labels, prompt_length, outside, settings
        )
    assert fewer[0] == counted[0] - int((labels[prompt_length - 1 :] == labels[prompt_length - 1]).sum())
