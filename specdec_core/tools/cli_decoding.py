"""`specdec generate`, `bench` (in process, against an endpoint, or a load sweep with
--concurrency) and `quality`: the commands that decode prompts and questions and report speed
and outputs."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import typer

from ..api.errors import SpecdecError
from ..api.request import RequestDefaults
from ..api.sampling import SamplingParams
from ..calibration.questions import load_questions, question_messages
from ..drafters.pld import PromptLookupParams
from ..models.loader import ModelSpec
from .cli_common import (
    DraftDtypeOpt,
    DraftLayersOpt,
    DraftOpt,
    HeadsOpt,
    QuestionsOpt,
    TargetDtypeOpt,
    TargetOpt,
    TreesOpt,
    build_engine,
    comma_list,
    console,
    default_of,
    fail,
    model_specs,
    parse_scoped_params,
    print_table,
    request_from_options,
)
from .params import parse_params


def generate(
    prompt: str = typer.Option(..., "--prompt", "-p"),
    chat: bool = typer.Option(True, help="apply the chat template to the prompt"),
    policy: Optional[str] = typer.Option(None, "--policy", help="default: greedy at temperature 0, else rejection"),
    policy_param: list[str] = typer.Option([], "--policy-param", help="k=v, repeatable"),
    drafter: str = typer.Option(default_of(RequestDefaults, "drafter").name, "--drafter"),
    drafter_param: list[str] = typer.Option([], "--drafter-param", help="k=v, repeatable"),
    num_draft_tokens: int = typer.Option(default_of(RequestDefaults, "num_draft_tokens"), "-k", "--num-draft-tokens"),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    temperature: float = typer.Option(default_of(SamplingParams, "temperature"), "--temperature"),
    top_p: float = typer.Option(default_of(SamplingParams, "top_p"), "--top-p"),
    top_k: int = typer.Option(default_of(SamplingParams, "top_k"), "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed", help="default: fresh randomness"),
    stop: list[str] = typer.Option([], "--stop"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    draft: str = DraftOpt,
    draft_dtype: str = DraftDtypeOpt,
    draft_layers: Optional[int] = DraftLayersOpt,
):
    """Generate a completion and print it with a metrics line."""
    from ..drafters import DRAFTERS, DraftSource
    from ..policies import POLICY_COUNTERS

    request = request_from_options(
        {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt},
        {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "max_tokens": max_tokens,
            "seed": seed,
            "stop": stop,
        },
        policy,
        policy_param,
        drafter,
        drafter_param,
        num_draft_tokens,
    )
    needs_draft = drafter in DRAFTERS and DRAFTERS[drafter].drafts_from is DraftSource.DRAFT_MODEL
    engine = build_engine(target, target_dtype, draft if needs_draft else "none", draft_dtype, draft_layers)
    start = time.perf_counter()
    try:
        for chunk in engine.stream(request):
            console.print(chunk.text, end="", markup=False, highlight=False, soft_wrap=True)
            metrics = chunk.metrics
    except SpecdecError as error:
        fail(str(error))
    seconds = time.perf_counter() - start
    counters = " ".join(f"{name}={metrics[name]}" for name in POLICY_COUNTERS if name in metrics)
    console.print()
    console.print(
        f"[dim]tokens={metrics['completion_tokens']} time={seconds:.2f}s "
        f"tok/s={metrics['completion_tokens'] / seconds:.1f} mean_accept_len={metrics['mean_acceptance_length']} "
        f"acceptance_rate={metrics['acceptance_rate']} "
        f"steps={metrics['num_steps']} {counters} verify_ms_p50={metrics['verify_ms_p50']}[/dim]"
    )


def bench(
    cli_context: typer.Context,
    methods: str = typer.Option(
        "target,hf:prompt_lookup,specdec:greedy+pld",
        "--methods",
        help="comma list: target, hf:prompt_lookup, hf:assisted, specdec:<policy>[(k=v,...)]+<drafter>[@K], "
        "endpoint:<policy>[(k=v,...)]+<drafter>[(k=v,...)][@K]; (k=v,...) sets that method's policy or "
        "drafter parameters",
    ),
    categories: str = typer.Option("all", "--categories", help="comma list or 'all'"),
    per_category: int = typer.Option(5, "--per-category"),
    skip: int = typer.Option(0, "--skip", min=0, help="pass over each category's first N questions"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(Path("bench_out"), "--out"),
    questions: str = QuestionsOpt,
    num_draft_tokens: int = typer.Option(10, "-k", "--num-draft-tokens"),
    pld_max_ngram: int = typer.Option(default_of(PromptLookupParams, "max_ngram"), "--pld-max-ngram"),
    pld_min_ngram: int = typer.Option(default_of(PromptLookupParams, "min_ngram"), "--pld-min-ngram"),
    pld_tokens: int = typer.Option(default_of(PromptLookupParams, "num_pred_tokens"), "--pld-tokens"),
    policy_param: list[str] = typer.Option([], "--policy-param", help="policy.k=v, repeatable (e.g. ears.beta=0.2)"),
    drafter_param: list[str] = typer.Option([], "--drafter-param", help="drafter.k=v, repeatable"),
    sampling_param: list[str] = typer.Option(
        [], "--sampling", help="a sampling setting of every method, k=v, repeatable (e.g. presence_penalty=0.5)"
    ),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="base URL of a running specdec service"),
    concurrency: str = typer.Option(
        "", "--concurrency", help="with --endpoint: a load sweep, e.g. 1,4,16 concurrent streaming clients"
    ),
    run_ahead: Optional[bool] = typer.Option(
        None,
        "--run-ahead/--no-run-ahead",
        help="a draft model drafts ahead while the target verifies; unset: the default",
    ),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    draft: str = DraftOpt,
    draft_dtype: str = DraftDtypeOpt,
    draft_layers: Optional[int] = DraftLayersOpt,
    heads: str = HeadsOpt,
    trees: list[Path] = TreesOpt,
    compiled: str = typer.Option(
        "", "--compile", help="torch.compile both models: step (a model's `compile`) or layers (`compile_layers`)"
    ),
):
    """Benchmark decoding methods on Spec-Bench; writes OUT/bench.json, OUT/bench.png and
    OUT/outputs.jsonl (every method's output per question)."""
    from tqdm.auto import tqdm

    from .benchmarks.bench import run_bench
    from .benchmarks.bench_records import BenchConfig
    from .benchmarks.report import TABLE_COLUMNS, write_report

    config = BenchConfig(
        questions=questions,
        methods=comma_list(methods),
        categories=comma_list(categories),
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
        sampling_params=parse_params(sampling_param),
        endpoint=endpoint,
        skip=skip,
        run_ahead=run_ahead,
    )
    connect = (cli_context.obj or {}).get("endpoint_client")
    if endpoint and connect is None:
        fail("--endpoint needs the serving side: run the `specdec` console script with specdec[serve] installed")
    if concurrency:
        levels = comma_list(concurrency)
        if not endpoint or not all(level.isdigit() and int(level) > 0 for level in levels):
            fail("--concurrency takes a comma list of client counts (e.g. 1,4,16) and needs --endpoint")
        load_sweep(config, [int(level) for level in levels], lambda: connect(endpoint), target, out)
        return
    endpoint_client = connect(endpoint) if endpoint else None
    engine = build_engine(target, target_dtype, draft, draft_dtype, draft_layers, heads, trees, compiled)
    try:
        rows, outputs = run_bench(engine, config, lambda items: tqdm(items, desc="questions"), endpoint_client)
    except (SpecdecError, ValueError, FileNotFoundError) as error:
        fail(str(error))
    target_spec, draft_spec = model_specs(target, target_dtype, draft, draft_dtype, draft_layers, compiled)
    extra = {"target": target_spec.model_dump(), "threads": os.cpu_count()}
    if draft_spec is not None:
        extra["draft"] = draft_spec.model_dump()
    path = write_report(rows, outputs, config, out, extra)
    print_table(rows, TABLE_COLUMNS)
    console.print(f"wrote {path} and {out / 'bench.png'}")


def load_sweep(config, levels: list[int], connect, target: str, out: Path) -> None:
    """`bench --concurrency`: the config's endpoint methods under each load level (load.py)."""
    from ..api.request import GenerationRequest
    from ..loop.frontend import Frontend
    from .benchmarks.bench import Runner, parse_specdec_method
    from .benchmarks.load import sweep

    if any(not method.startswith("endpoint:") for method in config.methods):
        fail("--concurrency runs endpoint:<policy>+<drafter>[@K] methods only (target-only: endpoint:greedy+none)")
    frontend = Frontend.from_spec(ModelSpec(source=target))
    questions = load_questions(config.questions, config.categories, config.per_category, config.skip)
    prompts = [frontend.encode(GenerationRequest(messages=question_messages(question))) for question in questions]
    runner = Runner(None, config)
    methods = {
        method: (lambda prompt, level, spec=parse_specdec_method(method): runner.request(prompt, spec, f"c{level}"))
        for method in config.methods
    }
    rows = sweep(connect, methods, prompts, levels, progress=lambda text: console.print(f"[dim]{text}[/dim]"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps({"config": vars(config), "levels": levels, "rows": rows}, indent=2))
    print_table(rows, list(rows[0]), left=("method",))
    console.print(f"wrote {out / 'load.json'}")


def quality(
    sets: str = typer.Option("gsm8k,humaneval", "--sets", help="comma list of gsm8k, humaneval"),
    questions_per_set: int = typer.Option(200, "--questions", help="at most this many per set (all: 80 and 164)"),
    max_new_tokens: int = typer.Option(160, "--max-new-tokens"),
    drafter: str = typer.Option("mla", "--drafter"),
    num_draft_tokens: int = typer.Option(15, "-k", "--num-draft-tokens"),
    temperature: float = typer.Option(0.9, "--temperature", help="of the sampling runs (rejection, ears, typical)"),
    modes: str = typer.Option("greedy,sampling", "--modes", help="greedy (T = 0 runs), sampling, or both"),
    seed: int = typer.Option(0, "--seed"),
    extra_methods: str = typer.Option(
        "",
        "--extra-methods",
        help="more specdec: methods (sampling policies run at --temperature, the others at T = 0)",
    ),
    out: Path = typer.Option(Path("quality_out"), "--out"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    draft: str = DraftOpt,
    draft_dtype: str = DraftDtypeOpt,
    draft_layers: Optional[int] = DraftLayersOpt,
):
    """Every lossy policy at its defaults against its lossless base on the same drafter, on GSM8K
    and HumanEval: speedup, acceptance length, identical outputs, target NLL, correct answers.
    Writes each bench run under OUT/ and the comparison to OUT/quality.json and OUT/quality.md."""
    from tqdm.auto import tqdm

    from .benchmarks.quality import MODES, QUESTION_SETS, QualityConfig, markdown, run_quality

    chosen = comma_list(sets)
    if not chosen or set(chosen) - set(QUESTION_SETS):
        fail(f"--sets takes a comma list of {', '.join(QUESTION_SETS)}")
    chosen_modes = comma_list(modes)
    if not chosen_modes or set(chosen_modes) - set(MODES):
        fail(f"--modes takes a comma list of {', '.join(MODES)}")
    config = QualityConfig(
        sets=chosen,
        questions_per_set=questions_per_set,
        max_new_tokens=max_new_tokens,
        drafter=drafter,
        num_draft_tokens=num_draft_tokens,
        temperature=temperature,
        seed=seed,
        extra_methods=comma_list(extra_methods),
        modes=tuple(chosen_modes),
    )
    engine = build_engine(target, target_dtype, draft, draft_dtype, draft_layers)
    try:
        rows = run_quality(engine, config, out, lambda items: tqdm(items, desc="questions"))
    except (SpecdecError, ValueError) as error:
        fail(str(error))
    table = markdown(rows)
    (out / "quality.json").write_text(json.dumps({"config": vars(config), "rows": rows}, indent=2))
    (out / "quality.md").write_text(table)
    console.print(table, markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {out / 'quality.md'} and {out / 'quality.json'}")
