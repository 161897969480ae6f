"""`specdec compile-check`: whether one target verify step compiles as one graph. It runs
`torch._dynamo.explain` over the base model's forward of a step of `rows` sessions (the ragged
attention's layout built beforehand, as a step does) and reports the graphs, the graph breaks
and where each break happens, grouped by source line: the work list of issue 33's compile-ready
step (`torch.compile`, then CUDA graphs)."""

from __future__ import annotations

import collections
import json
from typing import Optional

import torch
import typer

from ...runtime.batching import forward_ragged, step_inputs
from ...runtime.compiled_step import pad_steps
from ...runtime.kv_pool import PagedKV
from ...runtime.ragged_attention import use_ragged_attention
from ..cli_common import EMBEDDED
from .device_clock import seconds_per_call


def source_line(stack) -> str:
    """file:line function of a break's innermost frame ("?" where dynamo kept none)."""
    if not stack:
        return "?"
    frame = stack[-1]
    return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}"


@torch.inference_mode()
def explain_step(
    model: torch.nn.Module, rows: int, tokens_per_row: int = 5, history: int = 16, timed: bool = False
) -> dict:
    """Dynamo's account of one step of `rows` sessions, each scoring `tokens_per_row` tokens
    after `history` cached ones, padded as a compiled step is: graphs, breaks, and the breaks
    per source line; `timed`: also the step's ms eager and compiled (mode reduce-overhead: CUDA
    graphs where it can), on these fixed shapes, and how long compiling took."""
    generator = torch.Generator().manual_seed(0)
    vocab_size = model.config.vocab_size
    caches = [PagedKV() for _ in range(rows)]
    forward_ragged(model, caches, [torch.randint(0, vocab_size, (history,), generator=generator).tolist()] * rows)
    use_ragged_attention(model)
    pad_steps(model)
    input_ids = torch.randint(0, vocab_size, (1, rows * tokens_per_row), generator=generator).to(model.device)
    inputs = step_inputs(model.model, caches, [tokens_per_row] * rows, [None] * rows, {"input_ids": input_ids}, True)
    input_ids, positions, layout = inputs["input_ids"], inputs["position_ids"], inputs["ragged"]

    def step(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, ragged=layout)[0]

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(input_ids, positions)
    where = collections.Counter(
        f"{source_line(reason.user_stack)}: {reason.reason.splitlines()[0]}" for reason in explanation.break_reasons
    )
    report = {
        "rows": rows,
        "graphs": explanation.graph_count,
        "graph_breaks": explanation.graph_break_count,
        "ops_in_graphs": explanation.op_count,
        "breaks_by_line": dict(where.most_common()),
    }
    if timed:
        inputs = (input_ids, positions)
        report["eager_ms"] = seconds_per_call(lambda: step(*inputs), repeats=10) * 1e3
        torch._dynamo.reset()
        compiled = torch.compile(step, mode="reduce-overhead")
        report["compile_s"] = seconds_per_call(lambda: compiled(*inputs), warm_up=False)
        report["compiled_ms"] = seconds_per_call(lambda: compiled(*inputs), repeats=10) * 1e3
    return report


def compile_check_command(
    rows: int = typer.Option(8, "--rows", min=1, help="sessions in the step"),
    model: str = typer.Option(EMBEDDED, help="target (any loader source, e.g. random:llama-3.1-8b-instruct)"),
    dtype: str = typer.Option("float32"),
    num_layers: Optional[int] = typer.Option(None, help="keep the first N layers"),
    timed: bool = typer.Option(False, "--time", help="also time the step eager and compiled (reduce-overhead)"),
):
    """Graph breaks of one target verify step under torch.compile (torch._dynamo.explain), per
    source line, as JSON."""
    from ...models.loader import ModelSpec, load_model

    target = load_model(ModelSpec(source=model, dtype=dtype, num_layers=num_layers, cuda_graphs=False))
    print(json.dumps(explain_step(target, rows, timed=timed), indent=1))
