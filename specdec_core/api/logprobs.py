"""Log-probs of emitted tokens under the target's distribution (OpenAI `logprobs`): the raw
model distribution at T = 1, before temperature, top-k or top-p, as vLLM reports them."""

from __future__ import annotations

from typing import Sequence

import torch

from ..loop.stage_types import PromptScores, TargetBlock


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits[i])[tokens[i]]` for each row, `[N]`."""
    return logits.float().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)


def score_prompt_tokens(logits: torch.Tensor, next_tokens: torch.Tensor, num_top: int) -> PromptScores:
    """The log-probs of `next_tokens [T]` under the prefill rows `logits [T, V]` that predict
    them, and the top `num_top` at each."""
    rows = logits.float().log_softmax(-1)  # [T, V]
    top_log_probs, top_ids = rows.topk(num_top, dim=-1)  # [T, n]
    chosen = rows.gather(-1, next_tokens[:, None]).squeeze(-1)  # [T]
    return PromptScores(chosen.cpu(), top_ids.cpu(), top_log_probs.cpu())


def emitted_log_probs(
    block: TargetBlock, new_tokens: Sequence[int], num_accepted: int, num_top: int
) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(token id, log-prob, top `num_top` (id, log-prob)) for each token a step emits: the
    accepted draft tokens (their exact `block.token_log_probs`), then the correction or bonus
    token, which the policy took from the target row itself (so a compact row holds it)."""
    rows = block.logits[: len(new_tokens)].float().log_softmax(-1)
    tokens = torch.tensor(list(new_tokens), dtype=torch.long, device=rows.device)
    chosen = rows.gather(-1, tokens[:, None]).squeeze(-1)
    if block.token_log_probs is not None:
        chosen[:num_accepted] = block.token_log_probs[:num_accepted]
    top_log_probs, top_ids = rows.topk(num_top, dim=-1)
    return [
        (token, log_prob, list(zip(ids, values)))
        for token, log_prob, ids, values in zip(
            tokens.tolist(), chosen.tolist(), top_ids.tolist(), top_log_probs.tolist()
        )
    ]
