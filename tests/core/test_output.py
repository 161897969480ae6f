"""output.py's stop rules and the prompt's log-probs, in process: what the loop emits under
stop tokens, stop strings and min_tokens (chains and trees), and the prefill's scores of a
prompt longer than one prefill chunk."""

from __future__ import annotations

import pytest
import torch

from specdec_core import GenerationRequest
from specdec_core.api.output import OutputTracker
from specdec_core.api.sampling import SamplingParams
from specdec_core.target.scorer import PREFILL_CHUNK

from helpers.reference_scores import target_rows
from helpers.tiny_models import repeating_prompt


class Letters:
    """A tokenizer whose token i is the letter chr(97 + i % 26)."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(97 + token % 26) for token in token_ids)


def tracker(**sampling) -> OutputTracker:
    return OutputTracker(Letters(), SamplingParams(max_tokens=20, **sampling), eos_ids={25})


def test_a_stop_string_counts_only_where_it_ends_past_min_tokens():
    early = tracker(stop=["bc"])
    assert early.append([0, 1, 2, 3]).text == "a" and early.stop_reason == "bc"
    late = tracker(stop=["bc"], min_tokens=3)
    chunk = late.append([0, 1, 2, 3, 1, 2])
    assert late.finish_reason == "stop" and late.text == "abcd" and chunk.token_ids == [0, 1, 2, 3, 1, 2]
    straddling = tracker(stop=["bc"], min_tokens=2)  # "bc" ends at the third token: past the first two
    straddling.append([0, 1, 2])
    assert straddling.text == "a" and straddling.finish_reason == "stop"


def test_stop_tokens_end_the_output_after_min_tokens_only():
    eos_early = tracker(min_tokens=2)
    eos_early.append([25, 3])
    assert eos_early.finish_reason is None and eos_early.token_ids == [25, 3]
    eos_early.append([4, 25, 5])
    assert eos_early.token_ids == [25, 3, 4, 25] and eos_early.text == "zd" + "e"
    ignoring = tracker(ignore_eos=True, stop_token_ids=[4])
    ignoring.append([25, 4, 9])
    assert ignoring.token_ids == [25, 4] and ignoring.stop_reason == 4 and ignoring.text == "z"


def test_the_rows_before_min_tokens_lose_their_stop_tokens_chains_and_trees():
    from specdec_core.loop.stage_types import TargetBlock
    from specdec_core.trees.topologies import default_bank

    output = tracker(min_tokens=3, stop_token_ids=[7])
    output.append([1])  # one token out: rows deciding tokens 2 and 3 (index 1, 2) are early
    chain = output.suppress_early_stops(TargetBlock(logits=torch.zeros(4, 26)), None).logits
    assert chain[:2, [7, 25]].isinf().all() and not chain[2:].isinf().any() and not chain[:, :7].isinf().any()
    tree = default_bank().get("medusa_16")
    rows = output.suppress_early_stops(TargetBlock(logits=torch.zeros(tree.num_nodes + 1, 26)), tree).logits
    assert rows[:, 7].isinf().tolist() == (tree.depths < 2).tolist()
    late = tracker(stop_token_ids=[7])
    block = TargetBlock(logits=torch.zeros(4, 26))
    assert late.suppress_early_stops(block, None) is block


@pytest.mark.needs_smollm2  # SmolLM2's tokenizer
def test_special_tokens_show_only_when_asked():
    from specdec_core import ModelSpec
    from specdec_core.models.loader import load_tokenizer

    tokenizer = load_tokenizer(ModelSpec())
    ids = tokenizer("<|im_start|>Hi", add_special_tokens=False).input_ids
    assert len(ids) == 2
    for skip, text in ((True, "Hi"), (False, "<|im_start|>Hi")):
        output = OutputTracker(tokenizer, SamplingParams(max_tokens=4, skip_special_tokens=skip), eos_ids=set())
        assert output.append(ids).text == text


@pytest.mark.parametrize("drafter", ["model", "model_tree"])
def test_min_tokens_keeps_stop_tokens_out_of_the_first_tokens(tiny_engine, drafter):
    prompt = repeating_prompt(4)
    sampling = {"max_tokens": 20, "ignore_eos": True}
    free = tiny_engine.complete(GenerationRequest(prompt_ids=prompt, sampling=sampling)).token_ids
    stop = free[2]
    request = GenerationRequest(
        prompt_ids=prompt,
        drafter={"name": drafter},
        sampling={**sampling, "stop_token_ids": [stop], "min_tokens": 10},
    )
    output = tiny_engine.complete(request).token_ids
    assert stop not in output[:10] and output[:2] == free[:2] and len(output) > 10


def test_prompt_log_probs_over_several_prefill_chunks_are_the_targets(tiny_engine):
    prompt = repeating_prompt(9, length=PREFILL_CHUNK + 100)
    request = GenerationRequest(prompt_ids=prompt, sampling={"max_tokens": 0, "prompt_logprobs": 3})
    completion = tiny_engine.complete(request)
    assert completion.token_ids == [] and completion.finish_reason == "length"
    tokens = completion.prompt_log_probs
    assert len(tokens) == len(prompt) and tokens[0].chosen.log_prob is None and tokens[0].top == []
    rows = target_rows(tiny_engine.target_model, prompt[:1], prompt[1:])
    chosen = torch.tensor([entry.chosen.log_prob for entry in tokens[1:]])
    assert torch.allclose(chosen, rows.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-4)
    top = torch.tensor([[item.log_prob for item in entry.top] for entry in tokens[1:]])
    assert torch.allclose(top, rows.topk(3).values, atol=1e-4)
