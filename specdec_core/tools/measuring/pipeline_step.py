"""`specdec pipeline-step`: what a target in pipeline stages (specdec_core/models/pipeline.py) pays for
passing its hidden states on, and what filling the pipeline wins back. One verify step of n
sessions, timed on `pp` stages of `tp` ranks, each rank a process here (gloo on the CPU, NCCL and
a GPU a rank on CUDA): whole (every stage waits for the one before) and split one micro-batch a
stage (the stages compute at once), whatever the step's size (the served worker splits only
steps of `MICROBATCH_MIN_TOKENS` a part). `--pp 1` times the same steps in one process, the
model loaded as a single-process worker loads it."""

from __future__ import annotations

import statistics
import sys

import torch
import typer

from ...models.kernels.cpu import configure_cpu
from ...models.loader import ModelSpec, load_model
from ...models.parallel import join_group, leave_group, load_sharded_model, run_local_ranks
from ...runtime.model_runner import runner_of
from ...target.scorer import forward_rows
from ..cli_common import TargetDtypeOpt, TargetOpt, fail, print_table
from .device_clock import seconds_per_call
from .step_ops import verify_rows

TIMEOUT_S = 600  # a rank's rendezvous and collectives: loading a large target takes minutes


def step_shapes(text: str) -> list[tuple[int, int]]:
    """ "8x11,8x1": steps of 8 sessions scoring 11 tokens each, then of 8 scoring 1."""
    try:
        shapes = [tuple(int(part) for part in shape.split("x")) for shape in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        raise ValueError(f"steps {text!r}: sessions x tokens, comma-separated (as 8x11,8x1)")
    return shapes


def time_steps(model: torch.nn.Module, shapes: list[tuple[int, int]], repeats: int, history: int) -> list[dict]:
    """Median ms of each step shape, whole and (in a pipeline) split a micro-batch a stage. Every
    rank of the group runs it alike: the same steps in the same order."""
    stage = runner_of(model.model).stage
    splits = {"whole": sys.maxsize, "a micro-batch a stage": 1} if stage else {"whole": 0}
    timings = []
    with torch.inference_mode():
        for num_rows, tokens in shapes:
            rows = verify_rows(model, num_rows, tokens, history)
            timing = {"step": f"{num_rows} x {tokens} tokens"}
            for name, min_tokens in splits.items():
                if stage:
                    stage.min_tokens = min_tokens
                forward_rows(rows)  # warm: the first forward of a shape allocates
                times = [seconds_per_call(lambda: forward_rows(rows), warm_up=False) for _ in range(repeats)]
                timing[f"{name} ms"] = round(statistics.median(times) * 1e3, 1)
            timings.append(timing)
    return timings


def rank_main(rank: int, world_size: int, port: int, spec: ModelSpec, pp: int, options: dict) -> list[dict]:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    configure_cpu(options.pop("threads"))
    join_group(rank, world_size, "127.0.0.1", port, timeout_s=TIMEOUT_S)
    # one rank: the model as a single-process worker loads it (its own kernels)
    model = load_sharded_model(spec, "transformers", pp) if world_size > 1 else load_model(spec)
    timings = time_steps(model, **options)
    leave_group(model)
    return timings


def pipeline_step(
    pp: int = typer.Option(2, "--pp", min=1, help="pipeline stages"),
    tp: int = typer.Option(1, "--tp", min=1, help="tensor-parallel ranks a stage"),
    steps: str = typer.Option("8x11,8x1,2x11", "--steps", help="sessions x tokens scored each, comma-separated"),
    repeats: int = typer.Option(10, "--repeats", min=1, help="timed steps of each shape (the median is shown)"),
    history: int = typer.Option(64, "--history", min=1, help="prompt tokens each session holds"),
    threads: int = typer.Option(1, "--threads", min=1, help="torch threads a rank (CPU)"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
):
    """Median ms of a verify step on --pp stages of --tp ranks (processes on this machine), the
    step whole and split a micro-batch a stage."""
    try:
        shapes = step_shapes(steps)
        spec = ModelSpec(source=target, dtype=target_dtype)
    except ValueError as error:
        fail(str(error))
    options = {"shapes": shapes, "repeats": repeats, "history": history, "threads": threads}
    try:
        timings = run_local_ranks(pp * tp, rank_main, spec, pp, options, timeout_s=TIMEOUT_S * 2)[0]
    except RuntimeError as error:
        fail(f"{error}: a rank's traceback is above")
    print_table(timings, timings[0], left=("step",))
