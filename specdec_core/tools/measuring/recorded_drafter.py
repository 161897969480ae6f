"""A measurement tool, not a drafter users can ask for: gpu-report's way to decode at a fixed
acceptance length over random weights, which accept nothing on their own. It runs the draft
model's forwards as the `model` drafter does (their cost is paid), then discards their tokens
and proposes the target's own greedy continuation, as an earlier run of the `model` drafter over
the same prompts recorded it (its verify rows have K + 1 tokens, as these do, so bf16 rounding
decides the target's argmax the same way), with the `accept_length`-th token corrupted: every
lockstep step of greedy verification then keeps `accept_length - 1` drafts and the target's
correction. `eagle3` requests get the same over the target's EAGLE-3 layer: its chain's guess is
paid, its tokens replaced."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ...drafters import make_drafter, validate_drafter
from ...drafters.eagle3 import Eagle3Drafter
from ...drafters.model import ModelDrafter
from ...loop.stage_types import DraftBlock


@dataclass
class Recording:
    """Each prompt's greedy output in the recording run, keyed by the prompt, and what a block
    proposing it keeps: `accept_length - 1` tokens, the next one wrong."""

    outputs: dict[tuple, list[int]]
    accept_length: int
    vocab: int  # the target's vocabulary size

    def replaced(self, block: DraftBlock, continuation: Sequence[int]) -> DraftBlock:
        """`block` (its rows and tree kept) proposing the continuation's next tokens instead."""
        tokens = list(continuation[: len(block.tokens)])
        tokens += [0] * (len(block.tokens) - len(tokens))  # past the recorded end: nothing is verified there
        if self.accept_length <= len(tokens):  # the first draft the target must reject
            tokens[self.accept_length - 1] = (tokens[self.accept_length - 1] + 1) % self.vocab
        device = block.tokens.device
        return DraftBlock(tokens=torch.tensor(tokens, device=device), logits=block.logits, tree=block.tree, ids=tokens)


class RecordedContinuation(ModelDrafter):
    """The `model` drafter's forwards, the recording's tokens."""

    def __init__(self, model: torch.nn.Module, params: Any, recording: Recording):
        super().__init__(model, params)
        self.recording = recording

    def reset(self, prompt_ids: Sequence[int], sampling: Any) -> None:
        super().reset(prompt_ids, sampling)
        self.continuation = self.recording.outputs[tuple(prompt_ids)]

    def drafting_after(self, after, max_tokens: int, batch_rows: int = 1):
        if after:  # a run-ahead proposal's guess would shift the corrupted position by one
            raise ValueError("the recorded continuation measures lockstep steps, without run-ahead")
        return (yield from self.drafting(max_tokens, batch_rows))

    def drafting(self, max_tokens: int, batch_rows: int = 1):
        block = yield from super().drafting(max_tokens, batch_rows)
        if not len(block.tokens):
            return block
        block = self.recording.replaced(block, self.continuation[len(self.context) - self.prompt_tokens :])
        self.last_proposal = block.ids
        return block


class RecordedEagle3Chain(Eagle3Drafter):
    """The `eagle3` drafter's guesses (chains), the recording's tokens."""

    def __init__(self, source: Any, params: Any, recording: Recording):
        super().__init__(source, params)
        self.recording = recording

    async def reset(self, prompt_ids: Sequence[int], sampling: Any) -> None:
        await super().reset(prompt_ids, sampling)
        self.continuation, self.done = self.recording.outputs[tuple(prompt_ids)], 0

    async def propose(self, max_tokens: int, batch_rows: int = 1) -> DraftBlock:
        block = await super().propose(max_tokens, batch_rows)
        if not len(block.tokens):
            return block
        if block.tree.num_nodes != block.tree.max_depth:
            raise ValueError("the recorded continuation replaces chains; this eagle3 request drafts trees")
        return self.recording.replaced(block, self.continuation[self.done :])

    def commit(self, new_tokens: Sequence[int]) -> None:
        super().commit(new_tokens)
        self.done += len(new_tokens)


def recorded_drafters(draft_model: torch.nn.Module, recording: Recording):
    """An engine's `make_drafter` that gives `model` requests a RecordedContinuation, `eagle3`
    requests a RecordedEagle3Chain, and every other request its usual drafter."""

    def make(
        name: str,
        params: Optional[dict] = None,
        model: Optional[torch.nn.Module] = None,
        target: Any = None,
        suffixes: Any = None,
    ):
        if name == "model":
            return RecordedContinuation(draft_model, validate_drafter(name, params), recording)
        if name == "eagle3":
            return RecordedEagle3Chain(target, validate_drafter(name, params), recording)
        return make_drafter(name, params, model, target, suffixes)

    return make
