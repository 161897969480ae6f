"""Many sessions in one forward (specdec_core/batching.py, target.forward_rows): each row's
logits equal its own unbatched forward, through prompt chunks and rejections of different
lengths in the same step."""

from __future__ import annotations

import torch
from conftest import tiny_llama

from specdec_core.policies import make_policy
from specdec_core.sampling import SamplingParams
from specdec_core.target import Row, TargetScorer, forward_rows


@torch.inference_mode()
def plain_logits(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' own forward over the whole sequence (no cache), fp32 logits `[T, V]`."""
    return model(torch.tensor([token_ids])).logits[0].float()


def started(model, prompt: list[int]) -> TargetScorer:
    scorer = TargetScorer(model)
    scorer.start(prompt, make_policy("greedy"), SamplingParams())
    return scorer


def test_each_row_of_a_ragged_step_scores_as_it_would_alone():
    model = tiny_llama(seed=3)
    generator = torch.Generator().manual_seed(0)

    def random_tokens(count: int) -> list[int]:
        return torch.randint(0, model.config.vocab_size, (count,), generator=generator).tolist()

    prompts = [random_tokens(length) for length in (5, 23, 9, 2)]
    scorers = [started(model, prompt) for prompt in prompts]
    # prompts prefilled in chunks of 7 beside each other; one prompt still prefilling while the
    # others score their first blocks
    step = 7
    while any(scorer.committed_len < len(prompt) - 1 for scorer, prompt in zip(scorers, prompts)):
        forward_rows(
            [
                Row(scorer, prompt[scorer.committed_len : min(scorer.committed_len + step, len(prompt) - 1)], True)
                for scorer, prompt in zip(scorers, prompts)
                if scorer.committed_len < len(prompt) - 1
            ]
        )
    committed = [list(prompt[:-1]) for prompt in prompts]
    lasts = [prompt[-1] for prompt in prompts]
    for draft_counts, keeps in (((4, 1, 7, 0), (2, 0, 8, 1)), ((3, 6, 2, 5), (4, 7, 0, 2))):
        drafts = [random_tokens(count) for count in draft_counts]
        blocks = forward_rows([Row(scorer, [last, *draft]) for scorer, last, draft in zip(scorers, lasts, drafts)])
        for block, history, last, draft in zip(blocks, committed, lasts, drafts):
            reference = plain_logits(model, [*history, last, *draft])[len(history) :]
            torch.testing.assert_close(block.logits, reference, atol=1e-5, rtol=0)
        # rejections of different lengths in the same step: keep the last token and `keep - 1` drafts
        for index, (scorer, keep) in enumerate(zip(scorers, keeps)):
            block_tokens = [lasts[index], *drafts[index]]
            keep = min(keep, len(block_tokens))
            scorer.commit(keep)
            committed[index] += block_tokens[:keep]
            lasts[index] = random_tokens(1)[0] if keep == len(block_tokens) else block_tokens[keep]

    # a row alone and the same row beside another: bitwise equal
    alone, batched, other = (TargetScorer(model) for _ in range(3))
    for scorer, prompt in ((alone, prompts[1]), (batched, prompts[1]), (other, prompts[0])):
        scorer.reset(prompt, make_policy("greedy"), SamplingParams())
    block = [prompts[1][-1], *random_tokens(5)]
    by_itself = alone.score(block)
    beside = forward_rows([Row(other, [prompts[0][-1], *random_tokens(3)]), Row(batched, block)])[1]
    assert torch.equal(by_itself.logits, beside.logits)
