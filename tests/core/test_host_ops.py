"""What a batched step costs the host between forwards: on a GPU each tensor operation is a kernel
launch and each read back a wait, so a loop over requests that dispatches them grows the step
with its sessions (20.7 ms at 64 sessions on an H100, docs/performance.md). Greedy requests'
verdicts come from one argmax over the whole step, read back once (target.forward_rows), and a
draft round's greedy tokens from one argmax over every session's rows (drafters/model.py)."""

from __future__ import annotations

import inspect
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specdec_core import SpeculativeEngine
from specdec_core.api.sampling import SamplingParams
from specdec_core.loop import lockstep
from specdec_core.loop.lockstep import StepTimes, complete_together
from specdec_core.loop.stage_types import DraftBlock, TargetBlock
from specdec_core.policies.greedy import GreedyPolicy
from specdec_core.tools.measuring.gpu_decode import requests

from helpers.tiny_models import perturbed_copy, tiny_llama, tiny_profile


class OutsideForwards(TorchDispatchMode):
    """Counts the operations dispatched while no forward or prefill runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["target", "greedy+model"])
def test_greedy_verdicts_dispatch_no_device_work_per_request(monkeypatch, method: str):
    """Between forwards a greedy step dispatches two host-side tensor operations per request
    (its accepted flags) and no read back: nothing that grows with the sessions on a device."""
    target = tiny_llama(seed=0)
    engine = SpeculativeEngine(target, None, perturbed_copy(target, 0.5), profile=lambda *_: tiny_profile())
    counter = OutsideForwards()

    def paused(function):
        async def run_async(*args, **kwargs):  # a reset: its prefill runs with no await inside
            counter.paused += 1
            try:
                return await function(*args, **kwargs)
            finally:
                counter.paused -= 1

        def run(*args, **kwargs):
            counter.paused += 1
            try:
                return function(*args, **kwargs)
            finally:
                counter.paused -= 1

        return run_async if inspect.iscoroutinefunction(function) else run

    monkeypatch.setattr(lockstep.Lockstep, "timed", paused(lockstep.Lockstep.timed))
    monkeypatch.setattr(lockstep.LockstepTarget, "reset", paused(lockstep.LockstepTarget.reset))
    monkeypatch.setattr(lockstep.LockstepDraft, "reset", paused(lockstep.LockstepDraft.reset))
    sessions, times = 8, StepTimes()
    batch = requests(method, sessions, 48, 12, 4, target.config.vocab_size)
    with counter:
        complete_together(engine, batch, times)
    per_request_step = sum(counter.ops.values()) / len(times.target_s) / sessions
    assert per_request_step <= 2.0 and not counter.ops["_local_scalar_dense"], counter.ops


def test_a_greedy_verdict_from_the_step_argmax_is_the_rows_own():
    """The host verdict (argmax_ids read back by the step) equals the one computed on the block's
    logits, for every number of agreeing drafts."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 64, generator=generator)  # [K + 1, V]
    best = logits.argmax(-1)
    for agreeing in range(5):
        tokens = best[:4].clone()
        tokens[agreeing:] = (tokens[agreeing:] + 1) % 64
        draft = DraftBlock(tokens=tokens)
        greedy = SamplingParams(temperature=0.0)
        on_device = GreedyPolicy().verify(draft, TargetBlock(logits=logits), greedy, None)
        on_host = GreedyPolicy().verify(draft, TargetBlock(logits=logits, argmax_ids=best.tolist()), greedy, None)
        assert (on_host.num_accepted, on_host.next_token) == (on_device.num_accepted, on_device.next_token)
        assert torch.equal(on_host.trace["accepted"], on_device.trace["accepted"]) and on_host.num_accepted == agreeing


def test_a_draft_round_reads_every_sessions_argmax_back_at_once(monkeypatch):
    """propose_together: one argmax per draft round over all sessions' rows (was one per session
    and round, each read back on its own)."""
    from specdec_core.drafters import model as model_drafters

    target = tiny_llama(seed=0)
    engine = SpeculativeEngine(target, None, perturbed_copy(target, 0.5), profile=lambda *_: tiny_profile())
    counter, rounds = OutsideForwards(), []
    original = model_drafters.propose_together

    def counted(model, proposals):
        before = counter.ops["argmax"]
        blocks = original(model, proposals)
        rounds.append(counter.ops["argmax"] - before)
        return blocks

    monkeypatch.setattr(model_drafters, "propose_together", counted)
    sessions, num_draft = 8, 4
    batch = requests("greedy+model", sessions, 48, 12, num_draft, target.config.vocab_size)
    with counter:
        complete_together(engine, batch)
    assert rounds and max(rounds) <= num_draft  # a step's K forwards, each one argmax for all 8 sessions
