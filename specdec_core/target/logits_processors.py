"""The request's logits processors on the target's rows (vLLM's and OpenAI's): `logit_bias`, then
the repetition, frequency and presence penalties, in vLLM's order. They change the distribution
every policy verifies against and samples from, so greedy output with them equals target-only
output with them, and rejection sampling reproduces the processed distribution.

Row r of a verify block decides the token after the committed tokens and the drafts on its path
(a chain's d_1..d_r; a tree node's ancestors and itself), so its penalties count those drafts too,
as `min_tokens`' suppression counts their positions (api/output.py). Penalties count the
request's generated tokens; the repetition penalty also its prompt's (vLLM's rule)."""

from __future__ import annotations

from typing import Sequence

import torch

from ..api.sampling import SamplingParams
from ..loop.stage_types import DraftBlock, TargetBlock


def draft_paths(draft: DraftBlock) -> torch.Tensor:
    """`[1 + K, K]` bool: whether row r's context holds draft token j (the root row holds none)."""
    if draft.tree is not None:
        return draft.tree.attention_mask[:, 1:]  # a node attends to its ancestors and itself
    size = draft.num_tokens + 1
    return torch.ones(size, size, dtype=torch.bool).tril()[:, 1:]


def generated_counts(
    output_ids: Sequence[int], draft: DraftBlock, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """`[1 + K, V]` float32: how often each token occurs in each row's generated context."""
    counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab_size)  # [V]
    counts = counts.to(device, torch.float32).expand(draft.num_tokens + 1, -1).clone()  # [1 + K, V]
    rows, drafts = draft_paths(draft).nonzero(as_tuple=True)  # each (row, draft position) on a path
    if len(rows):
        tokens = draft.tokens.to(device)[drafts.to(device)]
        counts.index_put_((rows.to(device), tokens), torch.ones(len(rows), device=device), accumulate=True)
    return counts


def processed_block(
    block: TargetBlock,
    draft: DraftBlock,
    sampling: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
) -> TargetBlock:
    """`block` with the request's processors applied to every row (`block` itself when none; a
    grammar's mask is grammar_state.py's)."""
    if not (sampling.logit_bias or sampling.penalizes):
        return block
    logits = block.logits.float().clone()  # [1 + K, V]
    vocab_size, device = logits.shape[-1], logits.device
    if sampling.logit_bias:
        ids = torch.tensor(list(sampling.logit_bias), dtype=torch.long, device=device)
        logits[:, ids] += torch.tensor(list(sampling.logit_bias.values()), device=device)
    if not sampling.penalizes:
        return block.with_logits(logits)
    counts = generated_counts(output_ids, draft, vocab_size, device)  # [1 + K, V]
    if sampling.repetition_penalty != 1.0:
        prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        prompt[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        seen = (counts > 0) | prompt  # [1 + K, V]
        penalized = torch.where(logits > 0, logits / sampling.repetition_penalty, logits * sampling.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    logits -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0).float()
    return block.with_logits(logits)
