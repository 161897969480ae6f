"""A measurement tool, not a drafter users can ask for: gpu-report's way to decode at a fixed
acceptance length over random weights, which accept nothing on their own. It runs the draft
model's forwards as the `model` drafter does (their cost is paid), then discards their tokens
and proposes the target's own greedy continuation, as an earlier run of the `model` drafter over
the same prompts recorded it (its verify rows have K + 1 tokens, as these do, so bf16 rounding
decides the target's argmax the same way), with the `accept_length`-th token corrupted: every
lockstep step of greedy verification then keeps `accept_length - 1` drafts and the target's
correction."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ...drafters import make_drafter, validate_drafter
from ...drafters.model import ModelDrafter
from ...loop.stage_types import DraftBlock


class RecordedContinuation(ModelDrafter):
    """The `model` drafter's forwards, the recorded continuation's tokens (`recorded`: each
    prompt's greedy output in the recording run, keyed by the prompt)."""

    def __init__(self, model: torch.nn.Module, params: Any, recorded: dict[tuple, list[int]], accept_length: int):
        super().__init__(model, params)
        self.recorded, self.accept_length = recorded, accept_length

    def reset(self, prompt_ids: Sequence[int], sampling: Any) -> None:
        super().reset(prompt_ids, sampling)
        self.continuation = self.recorded[tuple(prompt_ids)]

    def drafting_after(self, after, max_tokens: int, batch_rows: int = 1):
        if after:  # a run-ahead proposal's guess would shift the corrupted position by one
            raise ValueError("the recorded continuation measures lockstep steps, without run-ahead")
        return (yield from self.drafting(max_tokens, batch_rows))

    def drafting(self, max_tokens: int, batch_rows: int = 1):
        block = yield from super().drafting(max_tokens, batch_rows)
        if not len(block.tokens):
            return block
        done = len(self.context) - self.prompt_tokens
        tokens = self.continuation[done : done + len(block.tokens)]
        tokens += [0] * (len(block.tokens) - len(tokens))  # past the recorded end: nothing is verified there
        if self.accept_length <= len(tokens):  # the first draft the target must reject
            tokens[self.accept_length - 1] = (tokens[self.accept_length - 1] + 1) % self.model.config.vocab_size
        self.last_proposal = tokens
        return DraftBlock(tokens=torch.tensor(tokens, device=block.tokens.device), logits=block.logits, ids=tokens)


def recorded_drafters(draft_model: torch.nn.Module, recorded: dict[tuple, list[int]], accept_length: int):
    """An engine's `make_drafter` that gives `model` requests a RecordedContinuation and every
    other request its usual drafter."""

    def make(
        name: str,
        params: Optional[dict] = None,
        model: Optional[torch.nn.Module] = None,
        target: Any = None,
        suffixes: Any = None,
    ):
        if name != "model":
            return make_drafter(name, params, model, target, suffixes)
        return RecordedContinuation(draft_model, validate_drafter(name, params), recorded, accept_length)

    return make
