"""`specdec calibrate-easd`: the target's entropies over its own greedy outputs, from which
`policies.easd.calibrate_tau_h` takes EASD's threshold."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..engine import SpeculativeEngine
from ..request import ComponentSpec, GenerationRequest
from .bench import score_continuation
from .questions import first_turn


def target_entropies(
    engine: SpeculativeEngine, questions: list[dict], max_new_tokens: int, progress: Callable[[Any], Any] = iter
) -> torch.Tensor:
    """T = 1 target entropy (nats) at every position of target-only greedy answers to `questions`."""
    entropies = []
    for question in progress(questions):
        request = GenerationRequest(
            messages=first_turn(question), sampling={"max_tokens": max_new_tokens}, drafter=ComponentSpec(name="pld")
        )
        completion = engine.complete(request)
        _, step_entropies = score_continuation(
            engine.target_model, engine.frontend.encode(request), completion.token_ids
        )
        entropies.append(step_entropies)
    return torch.cat(entropies)
