"""`specdec step-ops`: how many operations one target verify step dispatches over n sessions.
On a GPU every operation is at least one kernel launch, so a step whose count grows with its
sessions is launch-bound long before it is bandwidth-bound (issue 33 measures this)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Optional

import torch
import typer
from torch.utils._python_dispatch import TorchDispatchMode

from ...api.sampling import SamplingParams
from ...models.loader import ModelSpec, load_model
from ...models.sources import EMBEDDED
from ...policies import make_policy
from ...runtime.batching import step_layout
from ...runtime.model_runner import runner_of
from ...target.scorer import Row, TargetScorer, forward_rows
from .device_clock import seconds_per_call


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def attention_ops(self) -> int:
        return sum(count for name, count in self.ops.items() if "attention" in name or "scaled_dot_product" in name)


@torch.inference_mode()
def count_step_ops(model: torch.nn.Module, num_rows: int, tokens_per_row: int, history: int, seed: int = 0) -> dict:
    """The operations of one verify step of `num_rows` sessions, each scoring `tokens_per_row`
    tokens (K + 1) after a prefilled random prompt of `history` tokens."""
    rows = verify_rows(model, num_rows, tokens_per_row, history, seed)
    with OpCounter() as counter:
        forward_rows(rows)
    counts = {"rows": num_rows, "ops": sum(counter.ops.values()), "attention_ops": counter.attention_ops}
    layouts = {f"{kind} layout ms": layout_ms(rows, kind == "paged") for kind in ("paged", "sdpa")}
    return {**counts, **layouts, **step_times(rows)}


def layout_ms(rows: list[Row], paged: bool, repeats: int = 100) -> float:
    """The host's milliseconds to lay out the step padded as a graph's (batching.step_layout, its
    copies to the device queued), for the paged kernel or SDPA, whatever the model attends with:
    the layout is the host's work before every step, which the device waits for."""
    model = rows[0].scorer.model
    caches, lengths = [row.scorer.cache for row in rows], [len(row.tokens) for row in rows]
    pool = runner_of(model.model).kv_pool()

    def call():
        return step_layout(pool, caches, lengths, [None] * len(rows), model.device, padded=True, paged=paged)

    return round(seconds_per_call(call, repeats) * 1e3, 3)


def verify_rows(model: torch.nn.Module, num_rows: int, tokens_per_row: int, history: int, seed: int = 0) -> list[Row]:
    """A verify step of `num_rows` sessions, each scoring the same random `tokens_per_row` tokens
    after a prefilled random prompt of `history` tokens; each forward_rows of them scores them
    again (nothing is committed)."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size = model.config.vocab_size
    scorers = []
    for _ in range(num_rows):
        scorer = TargetScorer(model)
        prompt = torch.randint(0, vocab_size, (history + 1,), generator=generator).tolist()
        scorer.reset(prompt, make_policy("greedy"), SamplingParams(max_tokens=tokens_per_row))
        scorers.append(scorer)
    block = torch.randint(0, vocab_size, (tokens_per_row,), generator=generator).tolist()
    return [Row(scorer, block) for scorer in scorers]


def step_times(rows: list[Row], repeats: int = 3) -> dict:
    """The step's wall time and, on CUDA, the time its kernels keep the device busy (ms per step):
    where wall is far above busy, the host's launches bound the step."""
    model = rows[0].scorer.model
    if model.device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    wall_s = seconds_per_call(lambda: forward_rows(rows), repeats)
    with profile(activities=[ProfilerActivity.CUDA]) as profiled:  # apart: the profiler slows the host
        seconds_per_call(lambda: forward_rows(rows), repeats, warm_up=False)
    busy_us = sum(event.self_device_time_total for event in profiled.key_averages()) / repeats
    return {"wall ms": round(wall_s * 1e3, 2), "device busy ms": round(busy_us / 1e3, 2)}


def step_ops_command(
    rows: str = typer.Option("1,4,16,64", help="sessions in the step, comma-separated"),
    model: str = typer.Option(EMBEDDED, help="target (any loader source, e.g. random:llama-3.1-8b-instruct)"),
    dtype: str = typer.Option("float32"),
    num_layers: Optional[int] = typer.Option(None, help="keep the first N layers"),
    tokens: int = typer.Option(5, min=1, help="tokens per session: K + 1"),
    history: int = typer.Option(64, min=1, help="prompt tokens each session holds before the step"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON list"),
):
    """Operations one target verify step dispatches over n sessions, the host's time to lay it out
    (paged kernel, SDPA), and on CUDA its wall and device-busy times."""
    target = load_model(ModelSpec(source=model, dtype=dtype, num_layers=num_layers, cuda_graphs=False))
    counts = [count_step_ops(target, int(size), tokens, history) for size in rows.split(",")]
    print(json.dumps(counts) if as_json else "\n".join(map(str, counts)))
