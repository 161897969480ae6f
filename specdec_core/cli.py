"""`specdec` command line, in-process commands: generate, bench, verify-cost, lookup-ceiling,
calibrate-easd, convert.
The console script (deployments/cli.py) adds the serving commands to this app."""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import SpecdecError, format_validation_errors
from .models import DEFAULT_DRAFT, EMBEDDED, ModelSpec

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Speculative decoding for large LMs.")
console = Console(width=None if __import__("sys").stdout.isatty() else 200)

TargetOpt = typer.Option(EMBEDDED, "--target", help="target: local dir, hub id, .gguf path or " + EMBEDDED)
TargetDtypeOpt = typer.Option("float32", "--target-dtype")
DraftOpt = typer.Option(DEFAULT_DRAFT.source, "--draft", help="draft model source ('none' for no draft model)")
DraftDtypeOpt = typer.Option(DEFAULT_DRAFT.dtype, "--draft-dtype")
DraftLayersOpt = typer.Option(DEFAULT_DRAFT.num_layers, "--draft-layers", help="keep the first N draft layers")


def parse_value(text: str) -> Any:
    """`k=v` values: JSON when it parses (numbers, bools, strings in quotes), `inf`, else text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return float(text)
        except ValueError:
            return text


def parse_params(pairs: list[str]) -> dict[str, Any]:
    params = {}
    for pair in pairs:
        if "=" not in pair:
            raise typer.BadParameter(f"expected key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        params[key.strip()] = parse_value(value.strip())
    return params


def parse_scoped_params(pairs: list[str], option: str) -> dict[str, dict[str, Any]]:
    """`name.key=value` pairs -> {name: {key: value}} (per-policy or per-drafter settings)."""
    scoped: dict[str, dict[str, Any]] = {}
    for scoped_key, value in parse_params(pairs).items():
        if "." not in scoped_key:
            raise typer.BadParameter(f"{option} needs name.key=value, got {scoped_key!r}")
        name, key = scoped_key.split(".", 1)
        scoped.setdefault(name, {})[key] = value
    return scoped


def build_engine(target: str, target_dtype: str, draft: str, draft_dtype: str, draft_layers: Optional[int]):
    from .engine import SpeculativeEngine
    from .models import configure_cpu

    configure_cpu(os.cpu_count() or 1)
    target_spec = ModelSpec(source=target, dtype=target_dtype)
    draft_spec = None if draft == "none" else ModelSpec(source=draft, dtype=draft_dtype, num_layers=draft_layers)
    return SpeculativeEngine.from_specs(target_spec, draft_spec)


def fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p"),
    chat: bool = typer.Option(True, help="apply the chat template to the prompt"),
    policy: str = typer.Option("greedy", "--policy"),
    policy_param: list[str] = typer.Option([], "--policy-param", help="k=v, repeatable"),
    drafter: str = typer.Option("pld", "--drafter"),
    drafter_param: list[str] = typer.Option([], "--drafter-param", help="k=v, repeatable"),
    num_draft_tokens: int = typer.Option(8, "-k", "--num-draft-tokens"),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: int = typer.Option(0, "--seed"),
    stop: list[str] = typer.Option([], "--stop"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    draft: str = DraftOpt,
    draft_dtype: str = DraftDtypeOpt,
    draft_layers: Optional[int] = DraftLayersOpt,
):
    """Generate a completion and print it with a metrics line."""
    from pydantic import ValidationError

    from .engine import GenerationRequest

    try:
        request = GenerationRequest(
            **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}),
            sampling={"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_tokens": max_tokens, "seed": seed, "stop": stop},
            policy={"name": policy, "params": parse_params(policy_param)},
            drafter={"name": drafter, "params": parse_params(drafter_param)},
            num_draft_tokens=num_draft_tokens,
        )
    except ValidationError as error:
        fail(format_validation_errors(error.errors(), "request"))
    needs_draft = drafter in ("model", "mla")
    engine = build_engine(target, target_dtype, draft if needs_draft else "none", draft_dtype, draft_layers)
    start = time.perf_counter()
    try:
        for chunk in engine.stream(request):
            console.print(chunk.text, end="", markup=False, highlight=False, soft_wrap=True)
            metrics = chunk.metrics
    except SpecdecError as error:
        fail(str(error))
    seconds = time.perf_counter() - start
    console.print()
    console.print(
        f"[dim]tokens={metrics['completion_tokens']} time={seconds:.2f}s tok/s={metrics['completion_tokens'] / seconds:.1f} "
        f"mean_accept_len={metrics['mean_acceptance_length']} acceptance_rate={metrics['acceptance_rate']} "
        f"steps={metrics['num_steps']} penalized={metrics['penalized']} pardoned={metrics['pardoned']} "
        f"loose={metrics['loose']} verify_ms_p50={metrics['verify_ms_p50']}[/dim]"
    )


@app.command()
def bench(
    methods: str = typer.Option(
        "target,hf:prompt_lookup,specdec:greedy+pld", "--methods",
        help="comma list: target, hf:prompt_lookup, hf:assisted, specdec:<policy>+<drafter>[@K], endpoint:<policy>+<drafter>[@K]",
    ),
    categories: str = typer.Option("all", "--categories", help="comma list or 'all'"),
    per_category: int = typer.Option(5, "--per-category"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(Path("bench_out"), "--out"),
    questions: Optional[Path] = typer.Option(None, "--questions", help="Spec-Bench question.jsonl"),
    num_draft_tokens: int = typer.Option(10, "-k", "--num-draft-tokens"),
    pld_max_ngram: int = typer.Option(3, "--pld-max-ngram"),
    pld_min_ngram: int = typer.Option(1, "--pld-min-ngram"),
    pld_tokens: int = typer.Option(10, "--pld-tokens"),
    policy_param: list[str] = typer.Option([], "--policy-param", help="policy.k=v, repeatable (e.g. ears.beta=0.2)"),
    drafter_param: list[str] = typer.Option([], "--drafter-param", help="drafter.k=v, repeatable"),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="base URL of a running specdec service"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    draft: str = DraftOpt,
    draft_dtype: str = DraftDtypeOpt,
    draft_layers: Optional[int] = DraftLayersOpt,
):
    """Benchmark decoding methods on Spec-Bench; writes OUT/bench.json, OUT/bench.png and
    OUT/outputs.jsonl (every method's output per question)."""
    from tqdm.auto import tqdm

    from .bench import DEFAULT_QUESTIONS, BenchConfig, run_bench, write_report

    config = BenchConfig(
        questions=questions or DEFAULT_QUESTIONS,
        methods=[method.strip() for method in methods.split(",") if method.strip()],
        categories=[category.strip() for category in categories.split(",") if category.strip()],
        per_category=per_category,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        num_draft_tokens=num_draft_tokens,
        pld_max_ngram=pld_max_ngram,
        pld_min_ngram=pld_min_ngram,
        pld_tokens=pld_tokens,
        policy_params=parse_scoped_params(policy_param, "--policy-param"),
        drafter_params=parse_scoped_params(drafter_param, "--drafter-param"),
        endpoint=endpoint,
    )
    engine = build_engine(target, target_dtype, draft, draft_dtype, draft_layers)
    try:
        rows, outputs = run_bench(engine, config, progress=lambda items: tqdm(items, desc="questions"))
    except (SpecdecError, ValueError, FileNotFoundError) as error:
        fail(str(error))
    extra = {"target": ModelSpec(source=target, dtype=target_dtype).model_dump(), "threads": os.cpu_count()}
    if draft != "none":
        extra["draft"] = ModelSpec(source=draft, dtype=draft_dtype, num_layers=draft_layers).model_dump()
    path = write_report(rows, outputs, config, out, extra)
    print_table(rows)
    console.print(f"wrote {path} and {out / 'bench.png'}")


def print_table(rows: list[dict]) -> None:
    table = Table(show_lines=False)
    columns = ["method", "category", "questions", "new_tokens", "tok_per_s", "speedup", "mean_accept_len",
               "identical_to_target", "target_nll", "verify_ms_p50", "penalized", "pardoned", "loose"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("method", "category") else "right")
    for row in rows:
        table.add_row(*["" if row.get(column) is None else str(row.get(column)) for column in columns])
    console.print(table)


@app.command("verify-cost")
def verify_cost(
    max_tokens: int = typer.Option(16, "--max-tokens", help="largest block: K + 1 for K drafts"),
    repeats: int = typer.Option(20, "--repeats"),
    context: int = typer.Option(200, "--context", help="prompt tokens before the block"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    draft: str = DraftOpt,
    draft_dtype: str = DraftDtypeOpt,
    draft_layers: Optional[int] = DraftLayersOpt,
):
    """Cost of one forward over n = 1..max-tokens new tokens, target and draft model: the
    curve that decides when speculation pays (a K-draft verify is n = K + 1)."""
    from .bench import DEFAULT_QUESTIONS, block_cost_curve, load_questions
    from .engine import GenerationRequest

    if max_tokens < 1 or repeats < 1 or context < max_tokens:
        fail("need --max-tokens >= 1, --repeats >= 1 and --context >= --max-tokens")
    engine = build_engine(target, target_dtype, draft, draft_dtype, draft_layers)
    prompt_ids: list[int] = []
    for question in load_questions(DEFAULT_QUESTIONS, ["all"], 1):
        prompt_ids += engine.encode(GenerationRequest(messages=[{"role": "user", "content": question["turns"][0]}]))
    if len(prompt_ids) < context:
        fail(f"the Spec-Bench prompts give only {len(prompt_ids)} tokens of context")
    prompt_ids = prompt_ids[:context]
    models = {"target": engine.target_model, **({"draft": engine.draft_model} if engine.draft_model is not None else {})}
    curves = {name: block_cost_curve(model, prompt_ids, max_tokens, repeats) for name, model in models.items()}
    table = Table()
    table.add_column("tokens", justify="right")
    for name in curves:
        table.add_column(f"{name}_ms_p50", justify="right")
        table.add_column(f"{name}_vs_one_token", justify="right")
    for index in range(max_tokens):
        cells = [str(index + 1)]
        for curve in curves.values():
            cells += [str(curve[index]["ms_p50"]), str(curve[index]["vs_one_token"])]
        table.add_row(*cells)
    console.print(table)
    if max_tokens > 1:  # the curve starts at one draft, a 2-token forward
        # the pld drafter's block-length model: cost of k drafts = a (k + 1)-token forward, made
        # non-decreasing so that timing noise cannot make a longer block look cheaper
        relative = list(itertools.accumulate((row["vs_one_token"] for row in curves["target"][1:]), max))
        console.print(f"pld drafter on this machine: --drafter-param 'verify_cost={json.dumps(relative)}'", soft_wrap=True)
    if "draft" in curves:  # model and mla drafters also price each draft forward
        draft_cost = round(curves["draft"][0]["ms_p50"] / curves["target"][0]["ms_p50"], 3)
        console.print(f"model and mla drafters, also: --drafter-param 'draft_cost={draft_cost}'", soft_wrap=True)


@app.command("lookup-ceiling")
def lookup_ceiling(
    bench_dir: Path = typer.Argument(..., help="a bench --out directory whose methods include target (at T = 0)"),
    method: str = typer.Option("specdec:greedy+pld", "--method", help="the measured method shown beside the replay"),
    drafter_param: list[str] = typer.Option([], "--drafter-param", help="pld k=v over the bench's settings, repeatable"),
):
    """Replay the bench's target-only greedy outputs through the pld drafter and through three
    oracles under the verify cost curve: what prompt lookup earns and could at most earn."""
    from pydantic import ValidationError

    from .bench import pld_params
    from .drafters.pld import AdaptiveLookupParams
    from .lookup_ceiling import lookup_ceiling as ceiling_rows

    try:
        config = json.loads((bench_dir / "bench.json").read_text())["config"]
        outputs = [json.loads(line) for line in (bench_dir / "outputs.jsonl").read_text().splitlines() if line]
        greedy = config["temperature"] == 0
    except (OSError, ValueError, KeyError) as error:
        fail(f"cannot read a bench run from {bench_dir}: {error}")
    if not greedy:
        fail("lookup-ceiling replays greedy outputs: the bench must run at temperature 0")
    try:
        settings = {**pld_params(config), **config["drafter_params"].get("pld", {})}
        params = AdaptiveLookupParams(**{**settings, **parse_params(drafter_param)})
        max_draft = config["num_draft_tokens"]
    except KeyError as error:
        fail(f"cannot read a bench run from {bench_dir}: its config lacks {error}")
    except ValidationError as error:
        fail(format_validation_errors(error.errors(), "drafter 'pld'"))
    try:
        rows = ceiling_rows(outputs, params, max_draft, method)
    except ValueError as error:
        fail(str(error))
    table = Table()
    for column in rows[0]:
        table.add_column(column, justify="left" if column == "category" else "right")
    for row in rows:
        table.add_row(*["" if value is None else str(value) for value in row.values()])
    console.print(table)


@app.command("calibrate-easd")
def calibrate_easd(
    questions: Optional[Path] = typer.Option(None, "--questions"),
    categories: str = typer.Option("all", "--categories"),
    per_category: int = typer.Option(3, "--per-category"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    top_fraction: float = typer.Option(0.05, "--top-fraction", help="the paper's p"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
):
    """EASD's tau_H: mean of the top 5% target entropies (nats) over target-only greedy outputs."""
    import torch
    from tqdm.auto import tqdm

    from .bench import DEFAULT_QUESTIONS, load_questions, score_continuation
    from .engine import GenerationRequest
    from .policies.easd import calibrate_tau_h

    if not 0 < top_fraction <= 1:
        fail("--top-fraction must lie in (0, 1]")
    engine = build_engine(target, target_dtype, "none", "float32", None)
    selected = load_questions(questions or DEFAULT_QUESTIONS, [c.strip() for c in categories.split(",")], per_category)
    entropies = []
    for question in tqdm(selected, desc="questions"):
        request = GenerationRequest(
            messages=[{"role": "user", "content": question["turns"][0]}],
            sampling={"max_tokens": max_new_tokens},
            drafter={"name": "pld"},
        )
        completion = engine.complete(request)
        _, step_entropies = score_continuation(engine.target_model, engine.encode(request), completion.token_ids)
        entropies.append(step_entropies)
    all_entropies = torch.cat(entropies)
    tau_h = calibrate_tau_h(all_entropies, top_fraction)
    console.print(f"steps={all_entropies.numel()} mean_entropy={float(all_entropies.mean()):.4f} nats")
    console.print(f"tau_h={tau_h:.4f}  (use: --policy easd --policy-param tau_h={tau_h:.4f})")


@app.command()
def convert(target: str = TargetOpt):
    """Convert (once) and cache a GGUF checkpoint; prints cold/warm load times."""
    from .models import resolve_source, timed_load

    start = time.perf_counter()
    path = resolve_source(target)
    console.print(f"converted/cached at {path} in {time.perf_counter() - start:.2f}s")
    _, seconds = timed_load(ModelSpec(source=target))
    console.print(f"load from cache: {seconds:.2f}s")

