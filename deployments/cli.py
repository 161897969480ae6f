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

from specdec_core.tools.cli_app import app, console, fail, request_from_options

from .cli_checks import SERVE  # importing it adds the commands that check a running service

# the embedded default, package data so that an installed wheel serves it (cluster/local.yaml links it)
DEFAULT_CONFIG = Path(__file__).resolve().parent / "data" / "local.yaml"
# a SIGTERM's drain waits this much past the grace period: the replicas end their last streams first
DRAIN_SLACK_S = 5.0
APP_NAME = "specdec"  # the Serve application `specdec serve` runs
SIMULATED_NODE = "simulated_node"  # the resource each of --simulate-nodes' nodes past the head offers


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
        help="start a local cluster of N simulated nodes: a multi-node layout on one machine (each node past "
        f"the head offers the resource {SIMULATED_NODE!r})",
    ),
):
    """Start the specdec Ray Serve app (OpenAI HTTP + gRPC) and block until Ctrl-C. --tp and --pp
    override the config's target_worker."""
    import ray
    from pydantic import ValidationError
    from ray import serve as ray_serve

    from specdec_core.calibration.draft_costs import cpu_pair

    from .app import apply_serve_env_defaults, build_app
    from .config import AppConfig, refuse_unfit_heads
    from .coordination.startup_log import NAMESPACE, start_with_notes
    from .ingress.drain import clear_drain

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
    from specdec_core.models.sources import resolve_source

    for spec in filter(None, (app_config.target, app_config.draft)):
        resolve_source(spec.source)  # convert GGUF checkpoints once, here, with a progress bar
    try:
        refuse_unfit_heads(app_config)
    except ValueError as error:
        fail(f"bad config {config}: {error}")
    if not address and app_config.draft_costs is None and cpu_pair(app_config.target, app_config.draft):
        app_config = with_measured_draft(app_config)
    apply_serve_env_defaults()
    cluster = simulated_cluster(simulate_nodes) if simulate_nodes else None
    ray.init(address=cluster.address if cluster else address, namespace=NAMESPACE, log_to_driver=False)
    clear_drain(APP_NAME)
    # no Serve gRPC proxy: it would listen on every interface; the replicas serve gRPC (grpc_ingress.py)
    # one HTTP proxy, on the head (the cluster YAMLs' proxy_location): simulated nodes share the port
    ray_serve.start(proxy_location="HeadOnly", http_options={"host": app_config.host, "port": app_config.http_port})
    console.print("starting the workers and the server (Ray Serve)")
    application = build_app(app_config.model_dump())
    start_with_notes(lambda: ray_serve.run(application, name=APP_NAME, route_prefix="/"), console.print)
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
        drained = drain(app_config, url)  # SIGTERM: the streams in flight may finish first; Ctrl-C stops now
        console.print(f"drained in {drained:.1f}s" if drained is not None else "the grace period ended")
    except KeyboardInterrupt:
        pass
    finally:
        ray_serve.shutdown()
        clear_drain(APP_NAME)  # the cluster may serve the app again (`--address`)
        ray.shutdown()


def drain(config, url: str) -> Optional[float]:
    """Drain the server replicas (deployments/ingress/drain.py) and wait until they say so and the
    workers hold no session, at most the grace period and DRAIN_SLACK_S: seconds it took, or None
    where streams were still running (they end with an error event at the grace period)."""
    import httpx

    from .ingress.drain import begin_drain

    begin_drain(APP_NAME, config.graceful_shutdown_timeout_s)
    began = time.perf_counter()
    while time.perf_counter() - began < config.graceful_shutdown_timeout_s + DRAIN_SLACK_S:
        try:
            health = httpx.get(f"{url}/health", timeout=30).json()
        except (httpx.HTTPError, ValueError):  # busy or momentarily gone: look again
            health = {}
        # sessions of a worker that did not answer (None) are not known to be over
        if health.get("status") == "draining" and all(count == 0 for count in health["sessions"].values()):
            return time.perf_counter() - began
        time.sleep(0.5)
    return None


def with_measured_draft(config):
    """`config` with its CPU draft's costs beside the target on this machine (measured once and
    cached, the draft's kernels chosen at its worker's threads), each said: which kernels the
    draft runs here and whether it can pay."""
    from specdec_core.calibration.draft_costs import choose_draft

    draft = config.draft
    console.print(f"pricing the draft ({draft.source}, {draft.dtype}) beside the target on this CPU (cached)")
    threads = (config.threads(config.target_worker), config.threads(config.draft_worker))
    costs, kernels = choose_draft(config.target, draft, threads)
    console.print(f"draft kernels: {kernels or 'measured before (the draft worker notes them below)'}")
    console.print(f"draft: {costs.verdict()}")
    return config.model_copy(update={"draft_costs": costs})


def simulated_cluster(nodes: int):
    """A Ray cluster of `nodes` raylets on this machine (Ray's `cluster_utils`, as the cluster tests
    use), each offering every core: placement groups spread over them as over real nodes
    (cluster/local-pp2.yaml's stages, a node each), while all share the machine's cores. Each node
    past the head offers one SIMULATED_NODE, which a worker's `resources` may ask for to stay off
    the head (where the servers run: `specdec probe --phases node-loss` loses the workers' nodes).
    Its processes stop when this one exits."""
    import ray
    from ray.cluster_utils import Cluster

    cores = os.cpu_count()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cores, "include_dashboard": False})
    atexit.register(lambda: (ray.shutdown(), cluster.shutdown()))  # the driver first: Ray refuses the reverse
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cores, resources={SIMULATED_NODE: 1})
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


def connect_endpoint(base_url: str):
    from .client import SpecdecHttpClient

    return SpecdecHttpClient(base_url)


def main() -> None:
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    app(obj={"endpoint_client": connect_endpoint})


if __name__ == "__main__":
    main()
