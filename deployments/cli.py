"""The `specdec` console script: specdec_core's in-process commands plus `serve` and `client`;
`bench --endpoint` gets its HTTP client from here."""

from __future__ import annotations

import atexit
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from specdec_core.tools.cli import app, console, fail, request_from_options

# the embedded default, package data so that an installed wheel serves it (cluster/local.yaml links it)
DEFAULT_CONFIG = Path(__file__).resolve().parent / "data" / "local.yaml"
SERVE = "Serve"  # the commands of a service, a group of `specdec --help`


def load_serve_config(path: Path) -> dict:
    """The app args of a Serve config YAML (its first application)."""
    import yaml

    if not path.exists():
        fail(f"config not found: {path}")
    document = yaml.safe_load(path.read_text()) or {}
    applications = document.get("applications") or [{}]
    return applications[0].get("args") or {}


def options_over(args: dict, tp_size: Optional[int], pp_size: Optional[int], **options) -> dict:
    """A config's app args with the options given on the command line over them (`tp_size` and
    `pp_size`: the target worker's)."""
    layout = {key: value for key, value in (("tp_size", tp_size), ("pp_size", pp_size)) if value is not None}
    given = {key: value for key, value in options.items() if value is not None}
    return {**args, **given, "target_worker": {**(args.get("target_worker") or {}), **layout}}


@app.command(rich_help_panel=SERVE)
def serve(
    config: Path = typer.Option(DEFAULT_CONFIG, "--config", help="Serve config YAML (cluster/*.yaml)"),
    host: Optional[str] = typer.Option(None, "--host", help="bind address (default: the config's)"),
    port: Optional[int] = typer.Option(None, "--port", help="HTTP port"),
    grpc_port: Optional[int] = typer.Option(None, "--grpc-port"),
    address: Optional[str] = typer.Option(None, "--address", help="existing Ray cluster (default: start one)"),
    tp: Optional[int] = typer.Option(None, "--tp", min=1, help="the target's tensor-parallel ranks a stage"),
    pp: Optional[int] = typer.Option(None, "--pp", min=1, help="the target's pipeline stages"),
    simulate_nodes: int = typer.Option(
        0,
        "--simulate-nodes",
        min=0,
        help="start a local cluster of N simulated nodes: a multi-node layout on one machine",
    ),
):
    """Start the specdec Ray Serve app (OpenAI HTTP + gRPC) and block until Ctrl-C. --tp and --pp
    override the config's target_worker."""
    import ray
    from pydantic import ValidationError
    from ray import serve as ray_serve

    from .app import apply_serve_env_defaults, build_app
    from .config import AppConfig
    from .startup_log import NAMESPACE, start_with_notes

    start = time.perf_counter()
    args = options_over(
        load_serve_config(config), host=host, http_port=port, grpc_port=grpc_port, tp_size=tp, pp_size=pp
    )
    if simulate_nodes and address:
        fail("--simulate-nodes starts a cluster of its own: leave out --address")
    try:
        app_config = AppConfig(**args)
    except ValidationError as error:
        fail(f"bad config {config}: {error}")
    from specdec_core.loader import resolve_source

    for spec in filter(None, (app_config.target, app_config.draft)):
        resolve_source(spec.source)  # convert GGUF checkpoints once, here, with a progress bar
    apply_serve_env_defaults()
    cluster = simulated_cluster(simulate_nodes) if simulate_nodes else None
    ray.init(address=cluster.address if cluster else address, namespace=NAMESPACE, log_to_driver=False)
    # no Serve gRPC proxy: it would listen on every interface; the replicas serve gRPC (grpc_ingress.py)
    ray_serve.start(http_options={"host": app_config.host, "port": app_config.http_port})
    console.print("starting the workers and the server (Ray Serve)")
    application = build_app(app_config.model_dump())
    start_with_notes(lambda: ray_serve.run(application, name="specdec", route_prefix="/"), console.print)
    url = f"http://{app_config.host}:{app_config.http_port}"
    grpc_url = f"{app_config.host}:{app_config.grpc_port}"
    console.print(f"[green]specdec ready[/green] in {time.perf_counter() - start:.1f}s: {url} (gRPC {grpc_url})")
    example = json.dumps(
        {
            "model": app_config.model_name,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 32,
            "temperature": 0,
        }
    )
    console.print(
        f"try: curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{example}'",
        markup=False,
        soft_wrap=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        ray_serve.shutdown()
        ray.shutdown()


def simulated_cluster(nodes: int):
    """A Ray cluster of `nodes` raylets on this machine (Ray's `cluster_utils`, as the cluster tests
    use), each offering every core: placement groups spread over them as over real nodes
    (cluster/local-pp2.yaml's stages, a node each), while all share the machine's cores. Its
    processes stop when this one exits."""
    import ray
    from ray.cluster_utils import Cluster

    cores = os.cpu_count()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cores, "include_dashboard": False})
    atexit.register(lambda: (ray.shutdown(), cluster.shutdown()))  # the driver first: Ray refuses the reverse
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cores)
    return cluster


@app.command(rich_help_panel=SERVE)
def client(
    prompt: str = typer.Option(..., "--prompt", "-p"),
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="HTTP endpoint"),
    grpc_address: Optional[str] = typer.Option(None, "--grpc", help="use gRPC at host:port instead of HTTP"),
    policy: Optional[str] = typer.Option(None, "--policy", help="default: the service's, by temperature"),
    policy_param: list[str] = typer.Option([], "--policy-param"),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="default: the service's"),
    num_draft_tokens: Optional[int] = typer.Option(None, "-k", help="default: the service's"),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    seed: Optional[int] = typer.Option(None, "--seed", help="default: fresh randomness"),
    stream: bool = typer.Option(True, help="print the reply as it arrives"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDEC_API_KEY"),
):
    """Send one chat request to a running service and print the reply and its metrics."""
    from .client import SpecdecGrpcClient, SpecdecHttpClient

    request = request_from_options(
        {"messages": [{"role": "user", "content": prompt}]},
        {"max_tokens": max_tokens, "temperature": temperature, "seed": seed},
        policy,
        policy_param,
        drafter,
        [],
        num_draft_tokens,
    )
    service = (
        SpecdecGrpcClient(grpc_address, api_key=api_key) if grpc_address else SpecdecHttpClient(url, api_key=api_key)
    )
    start = time.perf_counter()
    num_tokens, metrics = 0, {}
    try:
        for reply in service.stream(request) if stream else [service.generate(request)]:
            console.print(reply["text"], end="", markup=False, highlight=False, soft_wrap=True)
            num_tokens += len(reply["token_ids"])
            metrics = reply["speculative"] or metrics
    except Exception as error:  # noqa: BLE001 - report any transport or service error to the user, then exit non-zero
        fail(f"{type(error).__name__}: {error}")
    console.print()
    console.print(
        f"[dim]tokens={num_tokens} time={time.perf_counter() - start:.2f}s "
        f"mean_accept_len={metrics.get('mean_acceptance_length')} "
        f"wire_bytes_per_step={metrics.get('wire_bytes_per_step')}[/dim]"
    )


@app.command(rich_help_panel=SERVE)
def probe(
    endpoint: str = typer.Option("http://127.0.0.1:8000", "--endpoint", help="the service's HTTP address (loopback)"),
    grpc_address: str = typer.Option("127.0.0.1:9000", "--grpc", help="its gRPC ingress ('' skips the gRPC cases)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDEC_API_KEY"),
    ray_address: str = typer.Option("auto", "--ray-address", help="the service's Ray cluster (kills, memory)"),
    app_name: str = typer.Option("specdec", "--app", help="the service's Serve application"),
    kills: bool = typer.Option(True, help="kill each worker mid-stream and read process memory (needs Ray)"),
    streams: int = typer.Option(64, "--streams", min=1, help="concurrent streams"),
    disconnects: int = typer.Option(16, "--disconnects", min=1, help="streams dropped after their first event"),
    soak: int = typer.Option(1000, "--soak", min=1, help="requests in the soak"),
    soak_concurrency: int = typer.Option(8, "--soak-concurrency", min=1),
    timeout_s: float = typer.Option(120.0, "--timeout", help="a request unanswered this long counts as hung"),
):
    """The reliability suite against a running service on this machine: hostile inputs, concurrent
    streams, disconnects, worker kills mid-stream, a soak with memory before and after. Prints a
    table; exits 1 on a lost or hung request, an unexpected status or a leaked session."""
    import asyncio

    from rich.markup import escape
    from rich.table import Table

    from .tools.probe import Probe
    from .tools.probe_cluster import LocalCluster

    try:
        suite = Probe(endpoint, grpc_address or None, api_key, timeout_s)
    except ValueError as error:
        fail(str(error))
    cluster = LocalCluster(ray_address, app_name) if kills else None
    report = asyncio.run(
        suite.run(
            streams, disconnects, soak, soak_concurrency, cluster, lambda phase: console.print(f"[dim]probe: {phase}")
        )
    )
    inputs = Table("input", "expected", "got", title="hostile inputs (status, param)")
    for row in report.inputs:
        inputs.add_row(*map(escape, row), style=None if row[1] == row[2] else "red")
    checks = Table("check", "result", "", title="specdec probe")
    for name, result, passed in report.checks:
        checks.add_row(escape(name), escape(result), "[green]ok[/green]" if passed else "[red]FAIL[/red]")
    console.print(inputs, checks)
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
    from specdec_core.loader import load_model, load_tokenizer

    from .tools.clients_check import ClientsCheck

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


def connect_endpoint(base_url: str):
    from .client import SpecdecHttpClient

    return SpecdecHttpClient(base_url)


def main() -> None:
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    app(obj={"endpoint_client": connect_endpoint})


if __name__ == "__main__":
    main()
