"""gpu-report's decode tables: the in-process engine (lockstep.py, every session's steps batched)
at several concurrencies, eager and with CUDA graphs, each method's tokens/s and each step's time
split (draft forwards, target forward, host) against the target forward's floor."""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from typing import Optional

import torch
import typer

from ...api.request import GenerationRequest
from ...drafters import make_drafter
from ...loop.engine import SpeculativeEngine
from ...loop.lockstep import StepTimes, complete_together
from ...planning.memory import kv_bytes_per_token
from ...runtime.compiled_layers import layers_compiled
from ...runtime.model_runner import runner_of
from .recorded_drafter import Recording, recorded_drafters

# greedy+model_tree: the draft model's trees (at T > 0: rejection sampling's tree rule)
DRAFTERS = {
    "target": "none",
    "greedy+model": "model",
    "greedy+pld": "pld",
    "greedy+eagle3": "eagle3",
    "greedy+model_tree": "model_tree",
}
# greedy+model@a: the draft model's forwards paid, the target's continuation as greedy+model's
# run recorded it proposed (recorded_drafter.py): acceptance length a at K = 4, where random
# weights accept nothing; greedy+eagle3@a likewise over a random EAGLE-3 layer's chains
RECORDING = "greedy+model"
FIXED_ACCEPTANCE = (RECORDING, "greedy+eagle3")
METHODS = ["target", RECORDING, *(f"{RECORDING}@{length}" for length in (1, 2, 3, 4)), "greedy+eagle3@3"]
# a fixed chain of K drafts: no adaptive length (the eagle3 chain is cut to the step's K)
DRAFTER_PARAMS = {"model": {"adaptive": False}, "eagle3": {"adaptive": False}}


def method_parts(method: str) -> tuple[str, Optional[int]]:
    """A method's drafter and its fixed acceptance length (None: the drafter's own tokens)."""
    name, _, accept_length = method.partition("@")
    if name not in DRAFTERS or (accept_length and (name not in FIXED_ACCEPTANCE or not accept_length.isdigit())):
        known = ", ".join([*DRAFTERS, *(f"{fixed}@<acceptance length>" for fixed in FIXED_ACCEPTANCE)])
        raise typer.BadParameter(f"method {method!r}: one of {known}")
    return DRAFTERS[name], int(accept_length) if accept_length else None


def reads_eagle3(methods: list[str]) -> bool:
    """Whether a method drafts from the target's EAGLE-3 layer (the report then attaches a random one)."""
    return any(method_parts(method)[0] == "eagle3" for method in methods)


def requests(
    method: str, count: int, prompt_tokens: int, max_tokens: int, num_draft: int, vocab: int, temperature: float = 0.0
) -> list:
    """`count` requests of `max_tokens` each (EOS ignored), request i on seed i's prompt: a random
    half repeated, so prompt lookup has something to find in the prompt at least. Greedy, or at a
    `temperature` sampled (seed i) and verified by rejection sampling."""
    drafter = method_parts(method)[0]
    batch = []
    for seed in range(count):
        half = torch.randint(0, vocab, (prompt_tokens // 2,), generator=torch.Generator().manual_seed(seed)).tolist()
        batch.append(
            GenerationRequest(
                prompt_ids=half + half,
                policy={"name": "greedy" if temperature == 0 else "rejection"},
                drafter={"name": drafter, "params": DRAFTER_PARAMS.get(drafter, {})},
                num_draft_tokens=num_draft,
                sampling={"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "ignore_eos": True},
            )
        )
    return batch


def shown_name(method: str, temperature: float) -> str:
    """A method as its rows name it: its policy is rejection sampling at a temperature."""
    return method if temperature == 0 else method.replace("greedy+", "rejection+")


def measure(engine: SpeculativeEngine, method: str, sessions: int, args: dict, copy_bytes_s: float, recorded: dict):
    """One method at one concurrency: its row (tokens/s over the decode, prefills excluded, and
    per step) and each request's token ids, after an unmeasured run of the same requests: greedy
    steps repeat, so it records the CUDA graph of every shape the measured run visits (a shorter
    run missed the last steps' shapes, and the measured run paid ~0.5 s to record each one on an
    H100). `recorded`: each prompt's output in the
    RECORDING run, which a method of fixed acceptance proposes: its verify rows are K + 1 tokens,
    as theirs are, so that bf16 rounding decides the target's argmax the same way in both."""
    shape = (args["prompt_tokens"], args["max_tokens"], args["num_draft"], args["vocab"], args["temperature"])
    batch = requests(method, sessions, *shape)
    times = StepTimes()
    accept_length = method_parts(method)[1]
    if accept_length is not None:
        engine.make_drafter = recorded_drafters(engine.draft_model, Recording(recorded, accept_length, args["vocab"]))
    try:
        complete_together(engine, batch)
        completions = complete_together(engine, batch, times)
    finally:
        engine.make_drafter = make_drafter
    if method == RECORDING:
        recorded.update((tuple(request.prompt_ids), done.token_ids) for request, done in zip(batch, completions))
    steps = len(times.target_s)
    decode_s = times.wall_s - sum(done.metrics["prefill_ms"] for done in completions) / 1e3
    draft_s, target_s = sum(times.draft_s), sum(times.target_s)
    model = engine.target_model
    weight_bytes = sum(parameter.numel() * parameter.itemsize for parameter in model.parameters())
    # the KV a forward reads: its sessions at the mean context of the decode
    per_token = kv_bytes_per_token(model.config, 1, model.dtype.itemsize)
    kv_bytes = sum(times.target_rows) / steps * (args["prompt_tokens"] + args["max_tokens"] / 2) * per_token
    return {
        "steps": steps_name(engine),
        "method": shown_name(method, args["temperature"]),
        "sessions": sessions,
        "tok/s": round(sum(len(done.token_ids) for done in completions) / decode_s, 1),
        "accept len": round(statistics.mean(done.metrics["mean_acceptance_length"] for done in completions), 2),
        "step ms": round(decode_s / steps * 1e3, 2),
        "draft ms": round(draft_s / steps * 1e3, 2),
        "target ms": round(target_s / steps * 1e3, 2),
        "host ms": round((decode_s - draft_s - target_s) / steps * 1e3, 2),
        "floor ms": round((weight_bytes + kv_bytes) / copy_bytes_s * 1e3, 2) if copy_bytes_s else "-",
    }, [done.token_ids for done in completions]


def decode_section(engine, concurrency: list[int], methods: list[str], args: dict, copy_bytes_s: float) -> list[str]:
    """Each method at each concurrency (`copy_bytes_s` 0: no floor), eager and with CUDA graphs
    where the models have them, as a table; then what recording the graphs cost."""
    models = stepped(engine)
    rows, warm_up = [], []
    for steps in ("eager", "graphs") if any(graphed(model) for _, model in models) else ("eager",):
        with steps_as([model for _, model in models], steps):
            clock = time.perf_counter()
            complete_together(engine, requests(RECORDING, 2, 32, 4, 2, args["vocab"]))  # compiles what is compiled
            warm_up.append(f"{steps_name(engine)} {time.perf_counter() - clock:.1f} s")
            for sessions in concurrency:
                recorded, baseline = {}, None
                for method in methods:
                    row, token_ids = measure(engine, method, sessions, args, copy_bytes_s, recorded)
                    baseline = baseline or (row["tok/s"], token_ids)
                    row["speedup"] = round(row["tok/s"] / baseline[0], 2)
                    same = f"{sum(a == b for a, b in zip(token_ids, baseline[1]))}/{sessions}"
                    row["same as " + methods[0]] = same if args["temperature"] == 0 else "-"  # samples differ
                    rows.append(row)
                    print(table([row], list(row)), file=sys.stderr, flush=True)
    heading = (
        f"Decode, {args['prompt_tokens']}-token prompts, {args['max_tokens']} tokens each, K = {args['num_draft']} "
        "(host: policy, commits and transfers between forwards; greedy+model@a: the draft model's forwards run "
        "and their tokens replaced by the target's recorded output, corrupted at the a-th, a measurement tool "
        "(tools/recorded_drafter.py) for a fixed acceptance length a; greedy+eagle3@a: the same over a random "
        "EAGLE-3 layer's chains (the published heads' shape); same as: greedy outputs equal to the first "
        "method's at that concurrency, where random bf16 weights' near-flat logits let rounding decide ties, "
        "so the exactness check is tests/core/test_gpu.py's, in fp32):"
    )
    recording = [
        f"{role} {graphs.recorded} graphs in {graphs.recording_seconds:.1f} s"
        for role, model in models
        if (graphs := graphed(model))
    ]
    if args["temperature"]:
        heading += (
            f" At T = {args['temperature']}, every method's requests are sampled (request i with seed i) and verified "
            "by rejection sampling, a step's chains decided together (policies/sampled_chains.py)."
        )
    lines = [heading, "", table(rows, list(rows[0])), "", f"First 2 requests (a warm-up): {', '.join(warm_up)}", ""]
    return lines + ([f"CUDA graphs recorded at first use: {'; '.join(recording)}", ""] if recording else [])


def stepped(engine) -> list[tuple[str, torch.nn.Module]]:
    """The base models whose steps run eagerly or replay graphs, by role: the target's, the draft
    model's, an EAGLE-3 layer."""
    models = [("target", engine.target_model.model)]
    if engine.draft_model is not None:
        models.append(("draft", engine.draft_model.model))
    if "eagle3" in engine.heads:
        models.append(("eagle3 layer", engine.heads["eagle3"]))
    return models


def steps_name(engine) -> str:
    """How the models' steps run now: eager or graphed, their layers compiled or not."""
    graphs = "graphs" if any(graphed(model) for _, model in stepped(engine)) else "eager"
    compiled = any(model is not None and layers_compiled(model) for model in (engine.target_model, engine.draft_model))
    return f"compiled layers, {graphs}" if compiled else graphs


def graphed(base_model: torch.nn.Module):
    """`base_model`'s StepGraphs (step_graphs.py), None where it runs eagerly."""
    return runner_of(base_model).graphs


@contextlib.contextmanager
def steps_as(base_models, steps: str):
    """The models' steps eager (their graphs set aside) or graphed, as they were loaded."""
    kept = [graphed(model) for model in base_models]
    if steps == "eager":
        for model in base_models:
            runner_of(model).graphs = None
    try:
        yield
    finally:
        for model, graphs in zip(base_models, kept):
            runner_of(model).graphs = graphs


def table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join([*lines, *("| " + " | ".join(str(row[column]) for column in columns) + " |" for row in rows)])
