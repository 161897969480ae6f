"""The target's own log-probs from one plain forward: what emitted tokens' `logprobs` must equal."""

from __future__ import annotations

import torch


def target_rows(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """The target's log-softmax rows that scored each emitted token, from one plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0].float()
    return logits[len(prompt_ids) - 1 : -1].log_softmax(-1)


def assert_target_log_probs(log_probs, model, prompt_ids: list[int], token_ids: list[int], num_top: int) -> None:
    """`log_probs` (TokenLogProbs per emitted token) equal the target's log-softmax at each
    emitted token and its top `num_top` (1e-4)."""
    rows = target_rows(model, prompt_ids, token_ids)
    assert len(log_probs) == len(token_ids)
    for row, token, entry in zip(rows, token_ids, log_probs):
        assert entry.chosen.token_id == token
        assert abs(entry.chosen.log_prob - row[token].item()) < 1e-4
        top_values, top_ids = row.topk(num_top)
        assert [alt.token_id for alt in entry.top] == top_ids.tolist()
        assert all(abs(alt.log_prob - value) < 1e-4 for alt, value in zip(entry.top, top_values.tolist()))
