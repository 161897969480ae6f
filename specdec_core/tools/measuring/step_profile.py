"""`specdec step-profile`: where one step's time goes, for the target's verify step (K + 1 tokens a
row), the draft model's one-token step and its chain of K - 1 as one graph (where it chains),
eager and with CUDA graphs: the call's wall time, its
graph's replay alone (what remains is the host: the layout, the buffer copies, the LM head's
launch), the time the device is busy, the kernels it runs, and their time by kind. Issue 50's
goals (a 7 ms 8B step, a 2 ms 1B draft step) need the replay near the weights' read: this says
which kernels stand between them."""

from __future__ import annotations

import cProfile
import functools
import pstats
import re
from collections import Counter
from pathlib import Path
from typing import Optional

import torch
import typer

from ...drafters.draft_rounds import argmax_step
from ...models.loader import ModelSpec, load_model
from ...runtime.chained_steps import chains_in_one_graph, run_chain
from ...runtime.compiled_layers import layers_compiled
from ...target.scorer import forward_rows
from .device_clock import seconds_per_call, synchronize
from .gpu_decode import graphed, steps_as, table
from .gpu_report import AttentionOpt, CompileLayersOpt, DeviceOpt, DraftShapeOpt, DtypeOpt, TargetShapeOpt
from .step_ops import OpCounter, verify_rows

# a kernel's kind, by the first pattern its name matches (the SDPA kernels, cuBLAS's and CUTLASS's
# GEMMs, inductor's fused Triton kernels, data movement, PyTorch's own pointwise and reductions)
KINDS = {
    "attention": r"flash|fmha|attention|attn",
    "gemm": r"gemm|cutlass|nvjet|sm\d\d_xmma|cublas|splitk",
    "triton": r"^triton",
    "copy": r"copy|memcpy|memset|index|gather|scatter|cat_|catarray|fill",
    "pointwise": r"elementwise|vectorized|reduce|unrolled|softmax|norm",
}


def kernel_kind(name: str) -> str:
    """The kind `KINDS` gives a kernel's name, "other" where none matches."""
    lowered = name.lower()
    return next((kind for kind, pattern in KINDS.items() if re.search(pattern, lowered)), "other")


def device_kernels(call, repeats: int) -> Counter:
    """Each kernel's device microseconds per `call`, by name (CUDA; one profiled pass of `repeats`
    calls after the timed ones: the profiler slows the host)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        seconds_per_call(call, repeats, warm_up=False)
    times: Counter = Counter()
    counts: Counter = Counter()
    for event in profiled.key_averages():
        if event.self_device_time_total > 0:
            times[event.key] += event.self_device_time_total / repeats
            counts[event.key] += event.count / repeats
    return Counter({name: (times[name], counts[name]) for name in times})


def profile_step(model: torch.nn.Module, role: str, rows: int, tokens: int, history: int, repeats: int = 10) -> dict:
    """One step of `rows` sessions, `tokens` new tokens each after `history`, in the model's
    current mode (eager, or graphed where it has graphs): its row of the table, and its kernels."""
    sessions = verify_rows(model, rows, tokens, history)
    return profile_call(
        model, {"model": role, "rows": rows, "tokens a row": tokens}, lambda: forward_rows(sessions), repeats
    )


def profile_chain(model: torch.nn.Module, rows: int, steps: int, history: int, repeats: int = 10) -> Optional[dict]:
    """A draft model's greedy chain over `rows` sessions: its `steps` forwards after the first as
    one graph (runtime/chained_steps.py), as a K-token draft runs them (None where the model
    cannot: no graphs, or not the paged kernel)."""
    sessions = verify_rows(model, rows, 1, history)
    caches = [row.scorer.cache for row in sessions]
    if not chains_in_one_graph(model.model, rows):
        return None
    first = {"tokens": torch.zeros(rows, dtype=torch.long, device=model.device)}  # [B]
    step = functools.partial(argmax_step, model)

    def call():
        for row in sessions:
            row.scorer.cache.crop(row.scorer.committed_len)
        return run_chain(model.model, caches, first, step, "argmax", steps)

    return profile_call(model, {"model": f"draft chain of {steps}", "rows": rows, "tokens a row": 1}, call, repeats)


def profile_call(model: torch.nn.Module, head: dict, call, repeats: int) -> dict:
    """`call`'s row of the table (after `head`): wall, its last graph's replay, operations, device
    kernels by kind; its kernels; the host's time in this project's functions."""
    wall_s = seconds_per_call(call, repeats)  # its warm-up records the call's graph
    graphs = graphed(model.model)
    replay = list(graphs.graphs.values())[-1].graph if graphs is not None and graphs.graphs else None
    row = {
        **head,
        "mode": "graphs" if replay is not None else "eager",
        "wall ms": round(wall_s * 1e3, 2),
        "replay ms": round(seconds_per_call(replay.replay, repeats) * 1e3, 2) if replay is not None else "-",
        "aten ops": "-" if layers_compiled(model) else count_ops(call),
    }
    host = host_functions(call, repeats)
    if model.device.type != "cuda":
        return {"row": row, "kernels": Counter(), "host": host}
    kernels = device_kernels(call, repeats)
    row["busy ms"] = round(sum(time for time, _ in kernels.values()) / 1e3, 2)
    row["kernels"] = round(sum(count for _, count in kernels.values()))
    for kind in [*KINDS, "other"]:
        mine = [(time, count) for name, (time, count) in kernels.items() if kernel_kind(name) == kind]
        row[f"{kind} ms (n)"] = f"{sum(t for t, _ in mine) / 1e3:.2f} ({round(sum(c for _, c in mine))})"
    return {"row": row, "kernels": kernels, "host": host}


def count_ops(call) -> int:
    """The aten operations one `call` dispatches. Not for compiled layers: a dispatch mode makes
    dynamo run their code eagerly, and the compiled code is not used again after."""
    with OpCounter() as counter:
        call()
    return sum(counter.ops.values())


def host_functions(call, repeats: int, count: int = 10) -> list[dict]:
    """This project's functions that take the most host time over `repeats` calls, cumulative and
    their own, per call (the wait for the device is in whichever function reads a result)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        call()
    synchronize()
    profiler.disable()
    timed = [
        (Path(file).name, line, name, own, cumulative)
        for (file, line, name), (_, _, own, cumulative, _) in pstats.Stats(profiler).stats.items()
        if "specdec_core" in Path(file).parts and Path(file).name != Path(__file__).name
    ]
    ranked = sorted(timed, key=lambda function: -function[4])[:count]
    return [
        {
            "function": f"{file}:{line} {name}",
            "ms a call": round(cumulative / repeats * 1e3, 2),
            "own ms": round(own / repeats * 1e3, 2),
        }
        for file, line, name, own, cumulative in ranked
    ]


def top_kernels(kernels: Counter, count: int = 12) -> list[dict]:
    """The `count` kernels that take the most device time per step."""
    ranked = sorted(kernels.items(), key=lambda item: -item[1][0])[:count]
    return [
        {"kernel": name[:70].replace("|", "/"), "kind": kernel_kind(name), "us": round(time, 1), "calls": round(calls)}
        for name, (time, calls) in ranked
    ]


def step_profile(
    target: ModelSpec,
    draft: ModelSpec,
    rows: list[int],
    num_draft: int,
    history: int,
    top: int = 12,
) -> str:
    """The profile's markdown: each model's step at each row count, eager and graphed where the
    models have graphs; then the top kernels of each model's graphed (else eager) one-row step."""
    lines, tables = [], []
    for role, spec, tokens in (("target", target, num_draft + 1), ("draft", draft, 1)):
        model = load_model(spec)
        modes = ("eager", "graphs") if graphed(model.model) is not None else ("eager",)
        profiled = {}
        for mode in modes:
            with steps_as([model.model], mode):
                for count in rows:
                    profiled[mode, count] = profile_step(model, role, count, tokens, history)
        tables += [result["row"] for result in profiled.values()]
        if role == "draft" and num_draft > 1 and graphed(model.model) is not None:  # K - 1 forwards, one graph
            chains = [profile_chain(model, count, num_draft - 1, history) for count in rows]
            tables += [chain["row"] for chain in chains if chain is not None]
        shown = profiled[modes[-1], rows[0]]
        heading = f"The host's time in this project's functions, the {role}'s step of {rows[0]} row(s), {modes[-1]}:"
        lines += ["", heading, "", table(shown["host"], ["function", "ms a call", "own ms"])]
        kernels = shown["kernels"]
        if kernels:
            heading = f"The {role}'s top kernels, {rows[0]} row(s) of {tokens}, {modes[-1]} (us per step):"
            lines += ["", heading, "", table(top_kernels(kernels, top), ["kernel", "kind", "us", "calls"])]
        del model
    columns = list(dict.fromkeys(column for row in tables for column in row))
    filled = [{column: row.get(column, "-") for column in columns} for row in tables]
    heading = (
        f"One step after {history} tokens ({target.source} verifying {num_draft + 1} tokens a row, {draft.source} "
        f"drafting one; {target.dtype}{', layers compiled' if target.compile_layers else ''}"
        f"{', paged attention' if target.paged_attention else ', SDPA'}); wall: the call "
        "with its layout and LM head; replay: its CUDA graph alone; busy: the device's kernel time:"
    )
    return "\n".join([heading, "", table(filled, columns), *lines])


def step_profile_command(
    target: str = TargetShapeOpt,
    draft: str = DraftShapeOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    rows: str = typer.Option("1,64", help="sessions in the step, comma-separated"),
    num_draft_tokens: int = typer.Option(4, min=1, help="K: the target verifies K + 1 tokens a row"),
    history: int = typer.Option(256, min=1, help="tokens each session holds before the step"),
    compile_layers: bool = CompileLayersOpt,
    num_layers: Optional[int] = typer.Option(None, help="keep each model's first N layers"),
    attention: str = AttentionOpt,
):
    """Where one target verify step's and one draft step's time goes: wall, graph replay, device
    busy, kernels by kind, and the top kernels (CUDA; on the CPU the wall and the operations)."""
    target_spec, draft_spec = (
        ModelSpec(
            source=source,
            dtype=dtype,
            device=device,
            compile_layers=compile_layers,
            num_layers=num_layers,
            attention=attention,
        )
        for source in (target, draft)
    )
    counts = [int(count) for count in rows.split(",")]
    print(step_profile(target_spec, draft_spec, counts, num_draft_tokens, history))


if __name__ == "__main__":  # the device machine runs it as a module: no console script installed there
    typer.run(step_profile_command)
