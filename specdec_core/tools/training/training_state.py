"""What the trainers share (train_heads.py, train_eagle3.py): the learning-rate schedule and the
resumable state, written every few steps and read back when a rerun has the same settings."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

import torch

STATE_FILE = "train_state.pt"


def warmup_cosine(warmup_steps: int, steps: int) -> Callable[[int], float]:
    """The learning rate's factor at each step: a linear warmup, then a cosine to zero."""

    def rate(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return rate


def save_state(
    path: Path, settings: dict, parts: dict, generator: torch.Generator, step: int, elapsed_s: float, log: dict
):
    """Write the training's state (`parts`: what has a state_dict, by name) atomically."""
    state = {
        "settings": settings,
        **{name: part.state_dict() for name, part in parts.items()},
        "generator": generator.get_state(),
        "step": step,
        "elapsed_s": elapsed_s,
        "log": log,
    }
    torch.save(state, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def resume_state(
    path: Path, settings: dict, parts: dict, generator: torch.Generator
) -> Optional[tuple[int, float, dict]]:
    """Load `path`'s state into `parts` and `generator` when it was saved with `settings`; its
    (step, elapsed seconds, log), or None (a fresh start)."""
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)
    if state["settings"] != settings:
        return None
    for name, part in parts.items():
        part.load_state_dict(state[name])
    generator.set_state(state["generator"])
    return state["step"], state["elapsed_s"], state["log"]
