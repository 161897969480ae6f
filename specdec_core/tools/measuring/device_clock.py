"""One clock for the measurement tools: seconds per call, timed to the device's end (CUDA runs
asynchronously: without a synchronize a timer measures the launches, not the work)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds_per_call(call: Callable[[], Any], repeats: int = 1, warm_up: bool = True) -> float:
    """Mean seconds of `call` over `repeats` back-to-back calls, after one unmeasured call unless
    not `warm_up` (a first call's own cost is then the measure)."""
    if warm_up:
        call()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    synchronize()
    return (time.perf_counter() - start) / repeats
