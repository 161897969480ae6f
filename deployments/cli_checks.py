"""The `specdec` commands that check a running service (or its start and redeploys) from outside:
`probe`, `clients-check`, `start-check`, `rollout-check`, `drain-check`, and `served-rows`, the host's cost of a
sampled request's rows (deployments/checks/ does the work).
deployments/cli.py imports this module, which adds them to the app."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from specdec_core.tools.cli_app import app, console, fail

SERVE = "Serve"  # the group of `specdec --help` the service's commands are in (cli.py's)


@app.command(rich_help_panel=SERVE)
def probe(
    endpoint: str = typer.Option("http://127.0.0.1:8000", "--endpoint", help="the service's HTTP address (loopback)"),
    grpc_address: str = typer.Option("127.0.0.1:9000", "--grpc", help="its gRPC ingress ('' skips the gRPC cases)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDEC_API_KEY"),
    ray_address: str = typer.Option("auto", "--ray-address", help="the service's Ray cluster (kills, memory)"),
    app_name: str = typer.Option("specdec", "--app", help="the service's Serve application"),
    kills: bool = typer.Option(
        True, help="through Ray: kill each worker mid-stream, fill the target's KV pool, read process memory"
    ),
    phases: str = typer.Option(
        "inputs,streams,disconnects,kills,kv-pressure,redeploy,soak",
        help="the phases to run; node-loss (a simulated cluster's nodes of the workers, lost for good) is asked for",
    ),
    streams: int = typer.Option(64, "--streams", min=1, help="concurrent streams"),
    disconnects: int = typer.Option(16, "--disconnects", min=1, help="streams dropped after their first event"),
    kv_chats: int = typer.Option(4, "--kv-chats", min=3, help="chats of half the target's KV pool each, at once"),
    redeploy: Optional[Path] = typer.Option(
        None, "--redeploy", help="a changed Serve config of the app, deployed while streams run (else no redeploy)"
    ),
    redeploy_streams: int = typer.Option(16, "--redeploy-streams", min=1, help="streams in flight through it"),
    soak: int = typer.Option(1000, "--soak", min=1, help="requests in the soak"),
    soak_concurrency: int = typer.Option(8, "--soak-concurrency", min=1),
    timeout_s: float = typer.Option(120.0, "--timeout", help="a request unanswered this long counts as hung"),
    draft_slack_s: Optional[float] = typer.Option(
        None, "--draft-slack", min=0, help="seconds a request may take over target-only while the draft is out [1]"
    ),
):
    """The reliability suite against a running service on this machine: hostile inputs, concurrent
    streams, disconnects, worker kills mid-stream, KV pressure that preempts, a redeploy under
    streams, a soak with memory before and after. Prints a table; exits 1 on a lost or hung
    request, an unexpected status, a leaked session or block."""
    import asyncio

    from rich.markup import escape
    from rich.table import Table

    from .checks.probe import PHASES, Probe, ProbeCounts
    from .checks.probe_client import ProbeClient
    from .checks.probe_cluster import LocalCluster

    chosen = tuple(phase.strip() for phase in phases.split(","))
    if unknown := set(chosen) - set(PHASES):
        fail(f"--phases: {', '.join(sorted(unknown))} unknown; of {', '.join(PHASES)}")
    try:
        slack = {} if draft_slack_s is None else {"draft_slack_s": draft_slack_s}
        suite = Probe(ProbeClient(endpoint, grpc_address or None, api_key, timeout_s, **slack))
    except ValueError as error:
        fail(str(error))
    cluster = LocalCluster(ray_address, app_name) if kills else None
    counts = ProbeCounts(streams, disconnects, kv_chats, redeploy_streams, soak, soak_concurrency)
    report = asyncio.run(
        suite.run(counts, chosen, cluster, redeploy, lambda phase: console.print(f"[dim]probe: {phase}"))
    )
    inputs = Table("input", "expected", "got", title="hostile inputs (status, param)")
    for row in report.inputs:
        inputs.add_row(*map(escape, row), style=None if row[1] == row[2] else "red")
    checks = Table("check", "result", "", title="specdec probe")
    for name, result, passed in report.checks:
        checks.add_row(escape(name), escape(result), "[green]ok[/green]" if passed else "[red]FAIL[/red]")
    console.print(*([inputs] if report.inputs else []), checks)
    for failure in report.failures:
        console.print(escape(failure), style="red", highlight=False)
    if report.failures:
        raise typer.Exit(1)


@app.command("clients-check", rich_help_panel=SERVE)
def clients_check(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="the running service's HTTP address"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDEC_API_KEY"),
    target: str = typer.Option("embedded:smollm2-135m-instruct", "--target", help="the service's target (reference)"),
    parts: str = typer.Option("openai,lm-eval,guidellm", "--parts", help="comma list"),
    limit: int = typer.Option(20, "--limit", min=1, help="lm-eval: questions per task"),
    gen_kwargs: str = typer.Option(
        '{"policy": "greedy", "drafter": "pld"}', "--gen-kwargs", help="lm-eval's gen_kwargs (JSON): extra body fields"
    ),
    lm_eval_concurrency: int = typer.Option(4, "--lm-eval-concurrency", min=1),
    concurrency: str = typer.Option("1,4,16", "--concurrency", help="guidellm's concurrency levels"),
    requests: str = typer.Option("8,32,64", "--requests", help="guidellm: requests per level (the last repeats)"),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens"),
    output_tokens: int = typer.Option(64, "--output-tokens"),
    guidellm_body: str = typer.Option("{}", "--guidellm-body", help="extra body fields of guidellm's requests (JSON)"),
    out: Path = typer.Option(Path("clients_check"), "--out", help="results: clients_check.json, guidellm.json"),
):
    """Drive a running service with real client libraries (the openai SDK, lm-evaluation-harness,
    guidellm), unmodified, and compare what they get with the target in process. Prints a table;
    exits 1 if any check fails."""
    from rich.markup import escape
    from rich.table import Table

    from specdec_core import ModelSpec, SpeculativeEngine
    from specdec_core.models.loader import load_model, load_tokenizer

    from .checks.clients_check import ClientsCheck

    spec = ModelSpec(source=target)
    tokenizer = load_tokenizer(spec)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out / "tokenizer")
    engine = SpeculativeEngine(load_model(spec), tokenizer)
    check = ClientsCheck(url.rstrip("/"), out / "tokenizer", engine, api_key)
    wanted, results = set(parts.split(",")), {}
    if "openai" in wanted:
        check.openai_sdk()
    if "lm-eval" in wanted:
        results["lm_eval"] = check.lm_eval(limit, json.loads(gen_kwargs), lm_eval_concurrency)
    if "guidellm" in wanted:
        levels, counts = [int(x) for x in concurrency.split(",")], [int(x) for x in requests.split(",")]
        results["guidellm"] = check.guidellm(
            levels, counts, prompt_tokens, output_tokens, out, json.loads(guidellm_body)
        )
    table = Table("client", "check", "result", "", title=f"specdec clients-check against {url}")
    for row in check.checks:
        verdict = "[green]ok[/green]" if row.passed else "[red]FAIL[/red]"
        table.add_row(row.part, escape(row.name), escape(row.result), verdict)
    console.print(table)
    results["checks"] = [vars(row) for row in check.checks]
    (out / "clients_check.json").write_text(json.dumps(results, indent=1, default=str))
    if check.failed:
        raise typer.Exit(1)


@app.command("start-check", rich_help_panel=SERVE)
def start_check(
    config: Path = typer.Option(Path("cluster/local.yaml"), "--config", help="the Serve config to start"),
    starts: int = typer.Option(10, "--starts", min=1),
    via: str = typer.Option(
        "serve", "--via", help="serve: `specdec serve`; deploy: `serve deploy` (a running cluster)"
    ),
    limit_s: float = typer.Option(600.0, "--limit", help="seconds a start may take"),
):
    """Start the service `--starts` times as a client that checks /v1/models first would meet it:
    poll /v1/models until it lists the model, then send a chat at once; stop it again. Prints when
    the model was listed, what /v1/models answered before and the chat's status; exits 1 unless
    every chat got 200."""
    from rich.table import Table

    from .checks.deploy_check import start_with_serve_deploy, start_with_specdec_serve

    if via not in ("serve", "deploy"):
        fail("--via is serve or deploy")
    start = start_with_specdec_serve if via == "serve" else start_with_serve_deploy
    table = Table("start", "listed after s", "before", "chat", title=f"specdec start-check: {via} {config}")
    results = []
    for number in range(1, starts + 1):
        results.append(start(config, limit_s))
        result = results[-1]
        table.add_row(str(number), str(result.listed_s), ", ".join(result.before), str(result.chat_status))
        console.print(f"[dim]start {number}: {json.dumps(vars(result))}")
    served = sum(result.chat_status == 200 for result in results)
    console.print(table, f"chats sent the moment the model was listed: {served} of {starts} got 200")
    if served < starts:
        raise typer.Exit(1)


@app.command("rollout-check", rich_help_panel=SERVE)
def rollout_check(
    configs: list[Path] = typer.Argument(..., help="Serve configs to `serve deploy` in turn onto the running app"),
    app_name: str = typer.Option("specdec", "--app", help="the service's Serve application"),
    settle_s: float = typer.Option(20.0, "--settle", help="seconds to watch at least after each deploy"),
    limit_s: float = typer.Option(600.0, "--limit", help="seconds to watch at most after each deploy"),
):
    """`serve deploy` each config in turn onto the running service while a client sends chats back
    to back: per deploy, the requests' statuses, when a 200 first carried the new config's token
    ids, and how the update ended (RUNNING, or DEPLOY_FAILED with the old replicas serving). Exits
    1 if any request failed."""
    from rich.table import Table

    from .checks.deploy_check import rollouts
    from .checks.drain_check import counted

    results = rollouts(configs, app_name, settle_s, limit_s, lambda line: console.print(f"[dim]{line}"))
    table = Table("config", "requests", "new output after s", "app", title="specdec rollout-check")
    for result in results:
        table.add_row(result.config, counted(result.statuses), str(result.first_new_s), result.app_status)
    console.print(table)
    for result in results:
        for failure in result.failures:
            console.print(f"{result.config}: {failure}", style="red", markup=False)
    if any(status != 200 for result in results for status in result.statuses):
        raise typer.Exit(1)


@app.command("drain-check", rich_help_panel=SERVE)
def drain_check(
    config: Path = typer.Option(
        ..., "--config", help="deploy: a changed Serve config for the running app; sigterm: the config to start"
    ),
    via: str = typer.Option(
        "deploy", "--via", help="deploy: `serve deploy` it; sigterm: `specdec serve` it, then SIGTERM"
    ),
    app_name: str = typer.Option("specdec", "--app", help="the service's Serve application"),
    streams: int = typer.Option(16, "--streams", min=1, help="streams in flight when it happens"),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="each stream's"),
    timeout_s: float = typer.Option(300.0, "--timeout", help="a stream silent this long counts as hung"),
):
    """Streams in flight through a redeploy or a SIGTERM: how each ended (completed, an error event,
    cut, hung), what requests sent meanwhile got, and when the app was RUNNING again (deploy) or
    the process had exited (sigterm). Exits 1 if a stream was cut or hung."""
    from rich.table import Table

    from .checks.drain_check import counted, deploy_drain, sigterm_drain

    if via not in ("deploy", "sigterm"):
        fail("--via is deploy or sigterm")
    if via == "deploy":
        drain = deploy_drain(config, app_name, streams, max_tokens, timeout_s)
    else:
        drain = sigterm_drain(config, streams, max_tokens, timeout_s)
    table = Table("event", "streams", "requests after it", "after s", "new output after s", title="specdec drain-check")
    table.add_row(
        drain.event, counted(drain.streams), counted(drain.requests), str(drain.after_s), str(drain.first_new_s)
    )
    console.print(table)
    for failure in drain.failures:
        console.print(failure, style="red", markup=False)
    if drain.streams["cut"] or drain.streams["hung"]:
        raise typer.Exit(1)


@app.command("served-rows", rich_help_panel=SERVE)
def served_rows(
    target: str = typer.Option("embedded:smollm2-135m-instruct", "--target", help="whose rows"),
    num_rows: int = typer.Option(9, "--rows", min=1, help="rows a request's step sends: K + 1"),
    vocab: int = typer.Option(0, "--vocab", min=0, help="pad the rows to this vocabulary's size (128256: Llama 3)"),
    temperature: float = typer.Option(0.8, "--temperature", min=0.01),
    top_p: float = typer.Option(0.9, "--top-p", min=0.01, max=1.0),
    repeats: int = typer.Option(20, "--repeats", min=1),
    sessions: str = typer.Option("1,16,64", "--sessions", help="comma list: sampled sessions a step decides"),
):
    """Per request and step, what a sampled verdict's whole target rows cost the server's host:
    their bytes and wire time as float32 and as bf16 (a GPU target's), and their warp's; then a
    step's verdicts at each of `--sessions`, decided on the server from rows, against on the target
    beside them (which sends verdicts only)."""
    import torch

    from specdec_core.models.loader import ModelSpec, load_model, load_tokenizer
    from specdec_core.tools.cli_common import print_table

    from .checks.served_rows import row_costs, step_costs, target_rows

    torch.set_num_threads(1)
    spec = ModelSpec(source=target)
    rows = target_rows(load_model(spec), load_tokenizer(spec), num_rows, vocab)
    console.print(f"{num_rows} rows of {rows.shape[-1]} tokens, T {temperature}, top_p {top_p}; ms, medians")
    columns = ["dtype", "MB", "wire ms", "warp ms", "warp ms, full sort", "nucleus tokens"]
    print_table(row_costs(rows, temperature, top_p, repeats), columns, left=("dtype",))
    console.print("a step of sampled rejection chains, ms, medians: on the server from rows, on the target beside them")
    steps = [step_costs(rows, count, temperature, top_p, repeats) for count in map(int, sessions.split(","))]
    print_table(steps, ["sessions", "server ms", "target ms"])
