"""The Ray Serve app on a simulated two-node local Ray cluster (CPU), with tiny random models
saved as real checkpoints next to SmolLM2's tokenizer. HTTP, the official openai client and
gRPC are compared with the in-process engine; bad input, concurrency, worker death and restart,
and client disconnects are exercised. One cluster for the whole module."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.needs_smollm2, pytest.mark.ray]  # SmolLM2's tokenizer; a local Ray cluster

from deployments.checks.probe_cluster import held_by_workers  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from deployments.workers.worker import ROLES, worker_handle  # noqa: E402
from specdec_core import GenerationRequest, ModelSpec, SpeculativeEngine  # noqa: E402
from specdec_core.models.loader import load_model, load_tokenizer  # noqa: E402
from specdec_core.policies import POLICIES  # noqa: E402

from helpers.tiny_models import perturbed_copy, tiny_llama  # noqa: E402

HTTP_PORT, GRPC_PORT = 18431, 19431
URL = f"http://127.0.0.1:{HTTP_PORT}"
MODEL = "tiny-test"
APP = "specdec"


def kill_rank(role: str, rank: int = 0, app: str = APP) -> None:
    """Kill one rank of a worker's replica: Serve's health check fails and restarts the replica."""
    ranks = worker_handle(role, app).rank_handles.remote().result()
    ray.kill(ranks[rank], no_restart=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny target + perturbed draft over SmolLM2's 49,152-token vocabulary."""
    tokenizer = load_tokenizer(ModelSpec())
    root = tmp_path_factory.mktemp("models")
    target = tiny_llama(seed=11, vocab_size=len(tokenizer))
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    draft = perturbed_copy(target, 0.002)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


@pytest.fixture(scope="module")
def local_engine(checkpoints):
    target_dir, draft_dir = checkpoints
    return SpeculativeEngine(
        load_model(ModelSpec(source=target_dir)),
        load_tokenizer(ModelSpec(source=target_dir)),
        load_model(ModelSpec(source=draft_dir)),
    )


def start_cluster(attempts: int = 3):
    """A head and a second simulated node, without the dashboard (no test uses it). Ray's own
    start-up sometimes fails on the 2-core VM: a raylet never registers and leaves no log ("The
    current node timed out during startup", in about one full test run in seven, before any
    specdec code runs). That failure alone is retried, after killing what the attempt started."""
    import psutil
    from ray.cluster_utils import Cluster

    for attempt in range(1, attempts + 1):
        try:
            # 3 logical CPUs a node: the three apps' workers ask for more than the VM's 2 cores
            head = {"num_cpus": 3, "include_dashboard": False, "_system_config": {"metrics_report_interval_ms": 1000}}
            # custom resources name the two node types a disaggregated layout puts draft and target on
            cluster = Cluster(initialize_head=True, head_node_args={**head, "resources": {"draft_node": 2}})
            cluster.add_node(num_cpus=3, resources={"target_node": 2})
            return cluster
        except Exception as error:
            if "timed out during startup" not in str(error) or attempt == attempts:
                raise
            children = psutil.Process().children(recursive=True)
            for child in children:
                child.kill()
            psutil.wait_procs(children, timeout=30)


@pytest.fixture(scope="module")
def ray_cluster():
    from deployments.app import apply_serve_env_defaults

    apply_serve_env_defaults()
    cluster = start_cluster()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def service(checkpoints, ray_cluster):
    from ray import serve

    from deployments.app import build_app

    target_dir, draft_dir = checkpoints
    ray.init(address=ray_cluster.address, namespace="specdec")
    # one HTTP proxy, on the head (as the cluster YAMLs): the simulated nodes share this machine's
    # port, and a proxy on a node that a test removes would take its connections with it
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": HTTP_PORT})
    config = {
        "model_name": MODEL,
        "target": {"source": target_dir},
        "draft": {"source": draft_dir},
        "defaults": {"num_draft_tokens": 6},
        "session_idle_timeout_s": 4.0,
        "rpc_deadline_s": 10.0,
        "max_tokens_limit": 2048,  # a deployment's cap (none by default): bad input tests ask past it
        "torch_threads": 1,
        # each worker on its node type, so that the tensor-parallel app's ranks fit beside them
        # wherever Serve restarts them
        "draft_worker": {"resources": {"draft_node": 1}},
        "target_worker": {"resources": {"target_node": 1}},
        "http_port": HTTP_PORT,
        "grpc_port": GRPC_PORT,
    }
    serve.run(build_app(config), name=APP, route_prefix="/")
    yield config
    serve.shutdown()
    ray.shutdown()


def completion(body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(URL + path, json={"model": MODEL, **body}, timeout=120)


def body_for(policy: str, temperature: float, drafter: str = "model") -> dict:
    return {
        "prompt": "The capital of France is Paris. The capital of France is",
        "max_tokens": 24,
        "temperature": temperature,
        "seed": 3,
        "policy": {"name": policy, "params": {}},
        "drafter": drafter,
        "num_draft_tokens": 5,
    }


def local_tokens(engine, body: dict) -> list[int]:
    request = GenerationRequest(
        prompt=body["prompt"],
        sampling={"max_tokens": body["max_tokens"], "temperature": body["temperature"], "seed": body["seed"]},
        policy=body["policy"],
        drafter={"name": body["drafter"]},
        num_draft_tokens=body["num_draft_tokens"],
    )
    return engine.complete(request).token_ids


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_http_output_equals_in_process_engine_for_every_policy(service, local_engine, policy):
    for temperature in (0.0, 0.9):
        if temperature > 0 and not POLICIES[policy].supports_sampling:
            continue
        body = body_for(policy, temperature)
        response = completion(body)
        assert response.status_code == 200, response.text
        payload = response.json()
        assert payload["choices"][0]["token_ids"] == local_tokens(local_engine, body)
        assert payload["usage"]["completion_tokens"] == len(payload["choices"][0]["token_ids"])
        assert "mean_acceptance_length" in payload["speculative"]


def test_grpc_output_equals_http(service):
    from deployments.client import SpecdecGrpcClient, SpecdecHttpClient

    request = GenerationRequest(
        messages=[{"role": "user", "content": "Name three colors."}],
        sampling={"max_tokens": 20},
        policy={"name": "fly"},
        drafter={"name": "mla"},
        num_draft_tokens=6,
    )
    over_grpc = SpecdecGrpcClient(f"127.0.0.1:{GRPC_PORT}").generate(request)
    over_http = SpecdecHttpClient(URL).generate(request)
    assert over_grpc["token_ids"] == over_http["token_ids"] and over_grpc["text"] == over_http["text"]
    streamed = list(SpecdecGrpcClient(f"127.0.0.1:{GRPC_PORT}").stream(request))
    assert [t for chunk in streamed for t in chunk["token_ids"]] == over_http["token_ids"]


def test_grpc_bad_input_is_invalid_argument(service):
    import grpc

    from deployments.client import SpecdecGrpcClient

    client = SpecdecGrpcClient(f"127.0.0.1:{GRPC_PORT}")
    for request, message in (
        (GenerationRequest(prompt="hi", policy={"name": "nope"}), "valid policies"),
        (GenerationRequest(prompt="hi", sampling={"max_tokens": 4000}), "max_tokens must be <= 2048"),
    ):
        with pytest.raises(grpc.RpcError) as failure:
            client.generate(request)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in failure.value.details()


def test_official_openai_client_streaming_and_not(service):
    from openai import OpenAI

    client = OpenAI(base_url=URL + "/v1", api_key="unused")
    assert [model.id for model in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0
    )
    streamed_chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed_chat) == chat.choices[0].message.content
    text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    streamed = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == text.choices[0].text
    assert text.usage.completion_tokens == 12


@pytest.mark.parametrize(
    "raw, status, message",
    [
        ('{"prompt": "hi", ', 400, "malformed JSON"),
        ("[1, 2]", 400, "JSON object"),
        ('{"max_tokens": 4}', 400, "prompt"),
        ('{"prompt": 5}', 400, "prompt"),
        ('{"prompt": ""}', 400, "must not be empty"),
        ('{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
        ('{"prompt": "hi", "max_tokens": 4000}', 400, "max_tokens must be <= 2048"),
        ('{"prompt": "hi", "max_tokens": 100000}', 400, "max_tokens: Input should be less than or equal to 32768"),
        ('{"prompt": "hi", "temperature": -1}', 400, "temperature"),
        ('{"prompt": "hi", "top_p": 0}', 400, "top_p"),
        ('{"prompt": "hi", "top_p": 1.5}', 400, "top_p"),
        (
            '{"prompt": "hi", "policy": {"name": "nope"}}',
            400,
            "valid policies: dropmatch, ears, easd, fly, greedy, rejection, typical",
        ),
        ('{"prompt": "hi", "policy": {"name": "ears", "params": {"beta": 5}}}', 400, "beta"),
        ('{"prompt": "hi", "drafter": "nope"}', 400, "unknown drafter"),
        ('{"prompt": "hi", "num_draft_tokens": 0}', 400, "num_draft_tokens"),
        ('{"prompt": "hi", "num_draft_tokens": 500}', 400, "num_draft_tokens"),
        ('{"prompt": "hi", "temperature": 0.5, "policy": {"name": "greedy"}}', 400, "needs temperature 0"),
        ('{"prompt": "hi", "model": "gpt-9"}', 404, "not found"),
        ('{"prompt": "' + "word " * 3000 + '"}', 400, "prompt has"),
        ('{"prompt": "' + "x" * (1 << 20) + '"}', 413, "exceeds"),
    ],
)
def test_bad_input_gets_an_openai_error_and_the_service_stays_up(service, raw, status, message):
    response = httpx.post(
        URL + "/v1/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert completion({"prompt": "ok", "max_tokens": 2, "temperature": 0}).status_code == 200


def test_concurrent_requests_match_sequential(service):
    bodies = [
        dict(body_for("greedy", 0.0, drafter), prompt=f"Story number {index}: once")
        for index, drafter in zip(range(16), ["pld", "model", "mla", "none"] * 4)
    ]
    sequential = [completion(body).json()["choices"][0]["token_ids"] for body in bodies]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        concurrent_results = list(pool.map(lambda body: completion(body).json()["choices"][0]["token_ids"], bodies))
    assert concurrent_results == sequential


def session_counts() -> dict:
    return httpx.get(URL + "/health", timeout=30).json()["sessions"]


def test_disconnected_stream_leaves_no_session(service):
    body = dict(body_for("greedy", 0.0), max_tokens=200, stream=True)
    with httpx.stream("POST", URL + "/v1/completions", json={"model": MODEL, **body}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # read one event, then hang up
    deadline = time.time() + 20
    while session_counts() != {"draft": 0, "target": 0} and time.time() < deadline:
        time.sleep(0.5)
    assert session_counts() == {"draft": 0, "target": 0}


def completed(body: dict) -> dict:
    response = completion(body)
    assert response.status_code == 200, response.text
    return response.json()


def test_draft_worker_killed_mid_stream_falls_back_then_speculation_resumes(service, local_engine):
    """The stream in flight finishes target-only (same greedy tokens, counted as a fallback); every
    request while Serve restarts the worker's replica is answered target-only, then speculation
    resumes. How long such a request takes against target-only is `specdec probe`'s measurement
    (tests assert no wall-clock bounds)."""
    probe = dict(body_for("greedy", 0.0), max_tokens=24)
    body = dict(body_for("greedy", 0.0), max_tokens=60, stream=True)
    events = []
    with httpx.stream("POST", URL + "/v1/completions", json={"model": MODEL, **body}, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if len(events) == 1:
                kill_rank("draft")
    assert all("choices" in event for event in events), events[-1]  # no error event
    tokens = [token for event in events for token in event["choices"][0]["token_ids"]]
    assert events[-1]["speculative"]["draft_fallback"] is True
    assert tokens == local_tokens(local_engine, body)
    deadline = time.time() + 90
    while time.time() < deadline:
        payload = completed(probe)
        if not payload["speculative"]["draft_fallback"]:
            break
        time.sleep(0.5)
    assert payload["speculative"]["draft_fallback"] is False
    assert payload["speculative"]["spec_decode_num_drafts"] > 0


def test_target_worker_killed_mid_stream_ends_it_with_an_error_then_the_service_recovers(service):
    """The stream in flight ends with an error event and [DONE]; while Serve restarts the target's
    replica, requests get 503 with Retry-After and /health says what is down; then 200 again."""
    body = dict(body_for("greedy", 0.0), max_tokens=200, stream=True, drafter="pld")
    events = []
    with httpx.stream("POST", URL + "/v1/completions", json={"model": MODEL, **body}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 1:
                    kill_rank("target")
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "worker_unavailable" and "request id" in error["message"]
    statuses, deadline = [], time.time() + 120
    while time.time() < deadline:
        response = completion(dict(body_for("greedy", 0.0), max_tokens=4))
        statuses.append((response.status_code, httpx.get(URL + "/health", timeout=30).status_code))
        if response.status_code == 200:
            break
        assert response.status_code == 503 and response.headers["Retry-After"], response.text
        time.sleep(1)
    assert statuses[-1] == (200, 200), statuses


def test_every_listener_binds_the_configured_host(service):
    """HTTP, gRPC and both workers listen on loopback only (the config's host)."""
    from helpers.served import listening_addresses

    worker_ports = [int(worker_handle(role, APP).get_address.remote().result().rsplit(":")[1]) for role in ROLES]
    for port in (HTTP_PORT, GRPC_PORT, *worker_ports):
        assert set(listening_addresses(port)) == {"127.0.0.1"}, port


def test_bench_against_the_endpoint_matches_in_process(service, checkpoints, tmp_path):
    """`specdec bench --endpoint` (the console script hands the bench its HTTP client) on the
    service's own checkpoints: the served method's outputs equal the in-process ones."""
    from typer.testing import CliRunner

    from deployments.cli import app, connect_endpoint

    target_dir, draft_dir = checkpoints
    args = ["bench", "--methods", "target,specdec:greedy+pld,endpoint:greedy+pld", "--categories", "writing,coding"]
    args += ["--per-category", "1", "--max-new-tokens", "8", "--endpoint", URL, "--out", str(tmp_path)]
    args += ["--target", target_dir, "--draft", draft_dir, "--draft-dtype", "float32"]
    result = CliRunner().invoke(app, args, obj={"endpoint_client": connect_endpoint})
    assert result.exit_code == 0, result.output
    rows = {
        (row["method"], row["category"]): row for row in json.loads((tmp_path / "bench.json").read_text())["results"]
    }
    served = rows[("endpoint:greedy+pld", "overall")]
    assert served["identical_to_target"] == 1.0 and served["new_tokens"] > 0
    assert served["wire_bytes_per_step"] < served["full_logits_bytes_per_step"]


def scrape(name: str, **labels: str) -> float:
    """The sum over every node's Prometheus export of metric `name`'s samples with `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        text = httpx.get(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
    return total


def test_prometheus_metrics_are_exported(service):
    """vLLM-named spec-decode counters, latency and acceptance-length histograms and error
    counters, scraped from the nodes' metrics ports as Prometheus would; the counts agree with
    each other (one acceptance-length observation per drafting step)."""
    import grpc

    from deployments.client import SpecdecGrpcClient

    for index in range(3):
        assert completion(dict(body_for("typical", 0.0), prompt=f"Count to {index}: one")).status_code == 200
    assert completion({"prompt": "hi", "max_tokens": 0}).status_code == 400
    with pytest.raises(grpc.RpcError):
        SpecdecGrpcClient(f"127.0.0.1:{GRPC_PORT}").generate(GenerationRequest(prompt="hi", policy={"name": "nope"}))
    typical = {"policy": "typical"}

    def consistent() -> bool:
        drafts = scrape("ray_specdec_spec_decode_num_drafts_total", **typical)
        accepted = scrape("ray_specdec_spec_decode_num_accepted_tokens_total", **typical)
        requests = scrape("ray_specdec_e2e_request_latency_seconds_count", **typical)
        return (
            requests >= 3
            and scrape("ray_specdec_time_to_first_token_seconds_count", **typical) == requests
            and scrape("ray_specdec_inter_token_latency_seconds_count", **typical) > 0
            and drafts > 0
            and scrape("ray_specdec_spec_decode_acceptance_length_count", **typical) == drafts
            and scrape("ray_specdec_spec_decode_num_accepted_tokens_per_pos_total", **typical) == accepted
            and scrape("ray_specdec_spec_decode_num_draft_tokens_total", **typical) >= accepted
            and scrape("ray_specdec_generation_tokens_total") >= 3 * 24
            and scrape("ray_specdec_request_errors_total", protocol="http", status="400") >= 1
            and scrape("ray_specdec_request_errors_total", protocol="grpc", status="INVALID_ARGUMENT") >= 1
        )

    deadline = time.time() + 60  # Ray exports every metrics_report_interval_ms
    while not consistent() and time.time() < deadline:
        time.sleep(1)
    assert consistent()


def test_the_probe_refuses_a_service_off_this_machine():
    """`specdec probe` kills workers and reads process memory: it runs against loopback only."""
    from typer.testing import CliRunner

    from deployments.cli import app as cli

    result = CliRunner().invoke(cli, ["probe", "--endpoint", "http://example.com:8000", "--no-kills"])
    assert result.exit_code != 0 and "loopback only, not 'example.com'" in result.output


def test_probe_command_passes_against_the_service(service):
    """`specdec probe`, with small counts, against the test service: hostile inputs over HTTP and
    gRPC, concurrent streams, disconnects, both workers killed mid-stream, a soak. It exits 0
    only when no request was lost, hung or answered unexpectedly and no session leaked."""
    from typer.testing import CliRunner

    from deployments.cli import app

    args = ["probe", "--endpoint", URL, "--grpc", f"127.0.0.1:{GRPC_PORT}", "--streams", "8", "--disconnects", "4"]
    args += ["--draft-slack", "60"]  # a request's speed during the draft's outage is the benchmark's to judge
    result = CliRunner().invoke(app, [*args, "--soak", "15", "--soak-concurrency", "4", "--timeout", "60"])
    assert result.exit_code == 0, result.output
    assert "FAIL" not in result.output and "target worker" in result.output


# ---------------------------------------------------------------- a tensor-parallel target group

TP_APP, TP_ROUTE = "tiny-tp", "/tp"


def tp_config(checkpoints, **fields) -> dict:
    """The tiny pair with the target and the draft over 2 ranks each (`fields` override any of it)."""
    target_dir, draft_dir = checkpoints
    config = {
        "model_name": MODEL,
        "target": {"source": target_dir},
        "draft": {"source": draft_dir},
        "torch_threads": 1,
        "calibration": {"questions_per_category": 1, "max_new_tokens": 4},
        "rpc_deadline_s": 10.0,
        "grpc_port": 0,
        # a pool of two contexts a rank (256 bytes a position on each of 2 ranks): KV on demand preempts
        "target_worker": {"tp_size": 2, "num_cpus": 0.5, "resources": {"target_node": 0.5}, "kv_budget_mb": 0.5},
        "draft_worker": {"tp_size": 2, "num_cpus": 0.5, "resources": {"draft_node": 0.5}},
    }
    return AppConfig(**{**config, **fields}).model_dump()


@pytest.fixture(scope="class")
def tp_app(service, checkpoints):
    """A second app beside the service: the target over 2 ranks (gloo) on the simulated target node
    and the draft over 2 ranks on the other, each a replica's placement group. Its class's tests
    only: an app left running costs every later test CPU time on the 2-core VM."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(tp_config(checkpoints)), name=TP_APP, route_prefix=TP_ROUTE)
    yield URL + TP_ROUTE
    serve.delete(TP_APP)


def tp_body(policy: str, temperature: float = 0.0, **fields) -> dict:
    return {**body_for(policy, temperature), "num_draft_tokens": 5, "seed": 7, **fields}


class TestTwoRankApp:
    """The tensor-parallel app (tp_app), deleted after these tests."""

    @pytest.mark.parametrize(("policy", "temperature"), [("greedy", 0.0), ("dropmatch", 0.0), ("rejection", 0.9)])
    def test_target_and_draft_over_two_ranks_each_serve_what_one_process_does(
        self, tp_app, local_engine, policy, temperature
    ):
        body = tp_body(policy, temperature)
        payload = httpx.post(tp_app + "/v1/completions", json=body, timeout=120).json()
        assert payload["choices"][0]["token_ids"] == local_tokens(local_engine, body)
        assert payload["speculative"]["spec_decode_num_drafts"] > 0

    def test_a_two_rank_target_preempts_on_demand_and_serves_what_one_process_does(self, tp_app, local_engine):
        """Four chats without max_tokens at once, in a pool of two contexts a rank: each may run to the
        end of the context; rank 0 preempts the youngest and every rank applies it (Preempt, Resume);
        every output equals the in-process engine's, and the preemptions are counted and exported."""

        def chat(index: int) -> dict:
            messages = [{"role": "user", "content": f"Chapter {index}. It was a dark night and"}]
            body = {**tp_body("greedy"), "messages": messages, "model": MODEL}
            del body["prompt"], body["max_tokens"]
            return body

        bodies = [chat(index) for index in range(4)]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            replies = pool.map(lambda body: httpx.post(tp_app + "/v1/chat/completions", json=body, timeout=600), bodies)
            payloads = [reply.json() for reply in replies]
        assert all("choices" in payload for payload in payloads), payloads
        for body, payload in zip(bodies, payloads):
            request = GenerationRequest(
                messages=body["messages"],
                sampling={"temperature": 0.0, "seed": body["seed"]},
                policy=body["policy"],
                drafter={"name": body["drafter"]},
                num_draft_tokens=body["num_draft_tokens"],
            )
            expected = local_engine.complete(request).token_ids
            assert payload["choices"][0]["token_ids"] == expected and len(expected) > 500
        preemptions = sum(payload["speculative"]["preemptions"] for payload in payloads)
        assert preemptions > 0
        deadline = time.time() + 60  # Ray exports every metrics_report_interval_ms
        while scrape("ray_specdec_preemptions_total") < preemptions and time.time() < deadline:
            time.sleep(1)
        assert scrape("ray_specdec_preemptions_total") >= preemptions

    def test_the_probe_fills_the_two_rank_targets_pool_and_each_preempted_chat_serves_as_alone(self, tp_app):
        """`specdec probe --phases kv-pressure` against the two-rank target's pool of two contexts:
        four chats of half the pool each at once; every one completes, some are preempted, each
        preempted chat's output equals it sent alone, and every block comes back."""
        from typer.testing import CliRunner

        from deployments.cli import app

        args = ["probe", "--endpoint", tp_app, "--grpc", "", "--app", TP_APP, "--phases", "kv-pressure"]
        wide = {"COLUMNS": "400", "TERMINAL_WIDTH": "400"}  # the result on one line
        result = CliRunner().invoke(app, [*args, "--timeout", "300"], env=wide)
        assert result.exit_code == 0, result.output
        assert "4/4 completed" in result.output and "KV held after: 0 bytes" in result.output
        assert "skipped" not in result.output and " 0 preempted" not in result.output

    def test_the_layout_puts_target_ranks_and_draft_on_their_node_types(self, tp_app):
        nodes = {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
        for role, node_type in (("target", "target_node"), ("draft", "draft_node")):
            ranks = worker_handle(role, TP_APP).rank_handles.remote().result()
            assert len(ranks) == 2
            for rank in ranks:
                assert node_type in nodes[ray.get(rank.node_id.remote())]

    def test_a_killed_rank_fails_its_request_then_serve_restarts_the_group(self, tp_app, local_engine):
        killed_rank_fails_its_request_then_serve_restarts_the_group(tp_app, TP_APP, local_engine)


# ---------------------------------------------------------------- a target in pipeline stages

PP_APP, PP_ROUTE = "tiny-pp", "/pp"


@pytest.fixture(scope="class")
def pp_app(service, checkpoints):
    """A third app: the target as 2 pipeline stages of 1 rank, each stage's bundle on a node of
    its own (STRICT_SPREAD over the two simulated nodes); its CPUs nominal beside the others'."""
    from ray import serve

    from deployments.app import build_app

    stages = {"pp_size": 2, "num_cpus": 0.01, "placement_strategy": "STRICT_SPREAD"}
    config = tp_config(checkpoints, target_worker=stages, draft_worker={"num_cpus": 0.01})
    serve.run(build_app(config), name=PP_APP, route_prefix=PP_ROUTE)
    yield URL + PP_ROUTE
    serve.delete(PP_APP)


class TestPipelineApp:
    """The app whose target runs in two pipeline stages (pp_app), deleted after these tests."""

    @pytest.mark.parametrize(("policy", "temperature"), [("greedy", 0.0), ("rejection", 0.9)])
    def test_a_target_in_two_stages_on_two_nodes_serves_what_one_process_does(
        self, pp_app, local_engine, policy, temperature
    ):
        body = tp_body(policy, temperature)
        payload = httpx.post(pp_app + "/v1/completions", json=body, timeout=120).json()
        assert payload["choices"][0]["token_ids"] == local_tokens(local_engine, body)
        ranks = worker_handle("target", PP_APP).rank_handles.remote().result()
        assert len({ray.get(rank.node_id.remote()) for rank in ranks}) == 2

    def test_a_killed_rank_fails_its_request_then_serve_restarts_the_group(self, pp_app, local_engine):
        killed_rank_fails_its_request_then_serve_restarts_the_group(pp_app, PP_APP, local_engine)


def killed_rank_fails_its_request_then_serve_restarts_the_group(app_url: str, app_name: str, local_engine):
    """A killed rank 1 (of a tensor-parallel group, or the second pipeline stage): rank 0's
    request fails at once (its collective or its send to the next stage breaks, or Serve's
    restart takes the group down): an error event and [DONE]; then 503s until the new replica
    serves."""
    body = {**tp_body("greedy"), "max_tokens": 900, "ignore_eos": True, "stream": True}
    events, killed_at = [], None
    with httpx.stream("POST", app_url + "/v1/completions", json={"model": MODEL, **body}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 1:
                    killed_at = time.perf_counter()
                    kill_rank("target", 1, app_name)
    failed_s = time.perf_counter() - killed_at
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "worker_unavailable"
    statuses = []
    while len(statuses) < 120:
        reply = httpx.post(app_url + "/v1/completions", json=tp_body("greedy"), timeout=120)
        statuses.append(reply.status_code)
        if reply.status_code == 200:
            break
        assert reply.status_code == 503 and reply.headers["Retry-After"], reply.text
        time.sleep(1)
    assert reply.json()["choices"][0]["token_ids"] == local_tokens(local_engine, tp_body("greedy"))
    served_s = time.perf_counter() - killed_at
    print(f"request failed {failed_s:.2f} s after the kill; served again {served_s:.1f} s after ({statuses})")


def test_a_placement_the_cluster_cannot_satisfy_says_why(service, checkpoints):
    """Serve keeps a worker it cannot place pending (an autoscaler may yet add the node) and its
    status says what each replica's ranks ask for."""
    from ray import serve

    from deployments.app import build_app

    config = tp_config(checkpoints)
    config["target_worker"]["resources"] = {"gpu_node": 1}
    serve._run(build_app(config), name="tiny-nowhere", route_prefix="/nowhere", _blocking=False)
    try:
        deadline, message = time.time() + 120, ""
        while "gpu_node" not in message and time.time() < deadline:
            time.sleep(2)
            deployments = serve.status().applications["tiny-nowhere"].deployments
            message = deployments["TargetWorker"].message or ""
        assert "gpu_node" in message and "Resources required for each replica" in message, message
    finally:
        serve.delete("tiny-nowhere")


# ---------------------------------------------------------------- starting and redeploying an app


def nominal(checkpoints, target: dict, app: str) -> dict:
    """An app of `target` and the tiny draft beside the others: one rank each at nominal CPUs, no
    calibration."""
    nominal_rank = {"num_cpus": 0.01}
    return tp_config(
        checkpoints,
        model_name=f"{MODEL}-{app}",
        target=target,
        calibration=None,
        target_worker=nominal_rank,
        draft_worker=nominal_rank,
    )


def chat_body(model: str) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 12,
        "temperature": 0,
    }


def chat_tokens(engine, model: str) -> list[int]:
    request = GenerationRequest(messages=chat_body(model)["messages"], sampling={"max_tokens": 12, "temperature": 0})
    return engine.complete(request).token_ids


def test_a_chat_sent_the_moment_the_model_is_listed_is_served(service, checkpoints, local_engine):
    """While the workers start, /v1/models does not list the model (503, Retry-After) and a chat
    waits for them instead of failing at once; once listed, a chat sent at once gets 200."""
    from ray import serve

    from deployments.app import build_app

    name, route = "tiny-fresh", "/fresh"
    config = nominal(checkpoints, {"source": checkpoints[0]}, name)
    started = time.perf_counter()
    serve._run(build_app(config), name=name, route_prefix=route, _blocking=False)
    try:
        seen, listed = [], None
        while listed is None and time.perf_counter() - started < 240:
            reply = httpx.get(URL + route + "/v1/models", timeout=60)
            if reply.status_code == 503:
                assert reply.headers["Retry-After"] and reply.json()["error"]["code"] == "worker_unavailable"
            seen.append(reply.status_code)
            listed = reply if reply.status_code == 200 else None
            time.sleep(0.1)
        assert listed is not None, seen[-5:]
        assert set(seen[:-1]) <= {404, 503}, seen  # not yet routed, or no target worker yet
        chat = httpx.post(URL + route + "/v1/chat/completions", json=chat_body(config["model_name"]), timeout=120)
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["token_ids"] == chat_tokens(local_engine, config["model_name"])
        print(f"listed {time.perf_counter() - started:.1f} s after the deploy; before: {sorted(set(seen[:-1]))}")
    finally:
        serve.delete(name)


@pytest.fixture(scope="module")
def unloadable_target(checkpoints, tmp_path_factory):
    """The tiny target's config and tokenizer beside weights that are no checkpoint: a server and a
    draft worker start with it, a target worker cannot."""
    import shutil
    from pathlib import Path

    unloadable = tmp_path_factory.mktemp("unloadable")
    for file in Path(checkpoints[0]).iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, unloadable / file.name)
    (unloadable / "model.safetensors").write_bytes(b"not a checkpoint")
    return str(unloadable)


def test_a_redeploy_serves_throughout_whether_its_target_cannot_start_or_replaces_the_old(
    service, checkpoints, unloadable_target, local_engine
):
    """A redeploy whose target cannot load: the old target answers 200 all through, and stays once
    the update gave up (DEPLOY_FAILED). Then one that cuts the target to 1 of its 2 layers (a
    documented config): 200 all through, the old target's ids until the new one serves its own."""
    from ray import serve

    from deployments.app import build_app

    name, route = "tiny-rollout", "/rollout"
    model = f"{MODEL}-{name}"
    serve.run(build_app(nominal(checkpoints, {"source": checkpoints[0]}, name)), name=name, route_prefix=route)
    try:
        whole = chat_tokens(local_engine, model)
        cut_engine = SpeculativeEngine(
            load_model(ModelSpec(source=checkpoints[0], num_layers=1)),
            load_tokenizer(ModelSpec(source=checkpoints[0])),
            local_engine.draft_model,
        )
        cut = chat_tokens(cut_engine, model)
        assert cut != whole

        def served_ids() -> list[int]:
            reply = httpx.post(URL + route + "/v1/chat/completions", json=chat_body(model), timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["token_ids"]

        def deployment_status(deployment: str) -> str:
            return serve.status().applications[name].deployments[deployment].status

        failing = nominal(checkpoints, {"source": unloadable_target}, name)
        serve._run(build_app(failing), name=name, route_prefix=route, _blocking=False)
        deadline, answered = time.time() + 300, 0
        while deployment_status("TargetWorker") != "DEPLOY_FAILED" and time.time() < deadline:
            assert served_ids() == whole
            answered += 1
        assert deployment_status("TargetWorker") == "DEPLOY_FAILED" and answered > 0
        assert [served_ids() for _ in range(3)] == [whole] * 3

        replacing = nominal(checkpoints, {"source": checkpoints[0], "num_layers": 1}, name)
        serve._run(build_app(replacing), name=name, route_prefix=route, _blocking=False)
        deadline, seen = time.time() + 300, []
        while (not seen or seen[-1] != cut) and time.time() < deadline:
            seen.append(served_ids())
            assert seen[-1] in (whole, cut)
        assert seen[-1] == cut, seen[-3:]
        print(f"{answered} requests served while the update failed; {len(seen)} while the next replaced it")
    finally:
        serve.delete(name)


# ---------------------------------------------------------------- node loss

LOSS_APP, LOSS_ROUTE = "tiny-loss", "/loss"


def settled(count, limit_s: float = 30.0):
    """`count()` once two looks a second apart agree (an earlier app's ranks and groups may still
    be going), at most `limit_s`."""
    last = count()
    for _ in range(int(limit_s)):
        time.sleep(1)
        now = count()
        if now == last:
            return now
        last = now
    return last


@pytest.fixture(scope="class")
def loss_nodes(ray_cluster) -> dict:
    """Four more nodes, by id, for the apps whose nodes are removed: a target's, two that may hold
    a draft, and three (two of those among them) that may hold a pipeline stage: after the draft's
    node is gone, two stages and a spare."""
    resources = [
        {"loss_target": 1, "loss_stage": 1},
        {"loss_draft": 1, "loss_stage": 1},
        {"loss_draft": 1, "loss_stage": 1},
        {"loss_stage": 1},
    ]
    nodes = {node.node_id: node for node in (ray_cluster.add_node(num_cpus=1, resources=each) for each in resources)}
    ray_cluster.wait_for_nodes()
    yield nodes  # the tests pop the nodes they remove
    for node in nodes.values():  # a node's raylet and agents cost the tests after it CPU time
        ray_cluster.remove_node(node)


class TestNodeLoss:
    """Nodes of a fourth app removed while it streams (loss_nodes, removed after these tests)."""

    def test_losing_the_draft_workers_node_falls_back_then_speculation_resumes_on_another(
        self, service, ray_cluster, loss_nodes, checkpoints, local_engine
    ):
        """The node of a fourth app's draft is removed (`cluster.remove_node`) while a stream runs: the
        stream finishes target-only with its own tokens, requests meanwhile are answered target-only,
        the draft's group is rebuilt on the other node that may hold it and speculation resumes; the
        ranks alive, the placement groups and the target's sessions come back to their counts before."""
        from ray import serve

        from deployments.app import build_app

        config = tp_config(
            checkpoints,
            target_worker={"num_cpus": 0.5, "resources": {"loss_target": 1}},
            draft_worker={"num_cpus": 0.5, "resources": {"loss_draft": 1}},
        )
        serve.run(build_app(config), name=LOSS_APP, route_prefix=LOSS_ROUTE)
        url = URL + LOSS_ROUTE
        try:
            probe = tp_body("greedy")
            assert (
                httpx.post(url + "/v1/completions", json=probe, timeout=120).json()["speculative"]["draft_fallback"]
                is False
            )
            before = settled(held_by_workers)
            draft_rank = worker_handle("draft", LOSS_APP).rank_handles.remote().result()[0]
            draft_node = loss_nodes.pop(ray.get(draft_rank.node_id.remote()))
            # a draft token a step: the stream outlasts the node's removal
            body = {**tp_body("greedy"), "max_tokens": 900, "num_draft_tokens": 1, "stream": True}
            events = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[len("data: ") :]))
                        if len(events) == 1:
                            ray_cluster.remove_node(draft_node)
                            removed_at = time.perf_counter()
            assert all("choices" in event for event in events) and events[-1]["speculative"]["draft_fallback"] is True
            tokens = [token for event in events for token in event["choices"][0]["token_ids"]]
            assert tokens == local_tokens(local_engine, {**body, "stream": False})
            statuses = []
            while time.perf_counter() - removed_at < 180:
                reply = httpx.post(url + "/v1/completions", json=probe, timeout=120)
                statuses.append(reply.status_code)
                if reply.status_code == 200 and reply.json()["speculative"]["draft_fallback"] is False:
                    break
                time.sleep(0.5)
            recovered_s = time.perf_counter() - removed_at
            assert set(statuses) == {200} and reply.json()["speculative"]["spec_decode_num_drafts"] > 0
            ranks = worker_handle("draft", LOSS_APP).rank_handles.remote().result()
            assert ray.get(ranks[0].node_id.remote()) != draft_node.node_id
            deadline = time.perf_counter() + 60
            while held_by_workers() != before and time.perf_counter() < deadline:
                time.sleep(1)
            assert held_by_workers() == before
            sessions = httpx.get(url + "/health", timeout=30).json()["sessions"]
            assert sessions["target"] == 0
            print(f"draft node lost: speculation again after {recovered_s:.1f} s; {len(statuses)} requests, all 200")
        finally:
            serve.delete(LOSS_APP)

    def test_losing_a_pipeline_stages_node_ends_its_stream_then_the_group_is_rebuilt(
        self, service, ray_cluster, loss_nodes, checkpoints
    ):
        """A fifth app's target in two stages, each on a node of its own (STRICT_SPREAD). A stage's
        node is removed while a stream runs: the stream ends with an error event and [DONE],
        requests get 503 with Retry-After until Serve has rebuilt the group on the nodes left, then
        200; the ranks alive, the placement groups and the sessions come back to their counts."""
        from ray import serve

        from deployments.app import build_app

        stages = {"pp_size": 2, "num_cpus": 0.01, "placement_strategy": "STRICT_SPREAD", "resources": {"loss_stage": 1}}
        # pld only (no draft model); the lookup's draft worker on the target's node of the fourth app
        lookup = {"num_cpus": 0.01, "resources": {"loss_target": 1}}
        config = tp_config(checkpoints, target_worker=stages, draft=None, draft_worker=lookup)
        serve.run(build_app(config), name=LOSS_APP, route_prefix=LOSS_ROUTE)
        url = URL + LOSS_ROUTE
        try:
            probe = tp_body("greedy", drafter="pld")
            assert httpx.post(url + "/v1/completions", json=probe, timeout=120).status_code == 200
            before = settled(held_by_workers)
            draft_rank = worker_handle("draft", LOSS_APP).rank_handles.remote().result()[0]
            stage_nodes = [
                ray.get(rank.node_id.remote())
                for rank in worker_handle("target", LOSS_APP).rank_handles.remote().result()
            ]
            # a stage's node that holds no draft rank
            stage_node = loss_nodes.pop(
                next(node for node in stage_nodes if node != ray.get(draft_rank.node_id.remote()))
            )
            body = {**probe, "max_tokens": 900, "num_draft_tokens": 1, "stream": True}
            events = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
                        if len(events) == 1:
                            ray_cluster.remove_node(stage_node)
                            removed_at = time.perf_counter()
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "worker_unavailable"
            statuses = []
            while time.perf_counter() - removed_at < 240:
                reply = httpx.post(url + "/v1/completions", json=probe, timeout=120)
                statuses.append(reply.status_code)
                if reply.status_code == 200:
                    break
                assert reply.status_code == 503 and reply.headers["Retry-After"]
                time.sleep(0.5)
            recovered_s = time.perf_counter() - removed_at
            assert statuses[-1] == 200
            ranks = worker_handle("target", LOSS_APP).rank_handles.remote().result()
            assert stage_node.node_id not in {ray.get(rank.node_id.remote()) for rank in ranks}
            deadline = time.perf_counter() + 60
            while held_by_workers() != before and time.perf_counter() < deadline:
                time.sleep(1)
            assert held_by_workers() == before
            assert httpx.get(url + "/health", timeout=30).json()["sessions"]["target"] == 0
            print(f"stage node lost: served again after {recovered_s:.1f} s; {statuses.count(503)} x 503 before")
        finally:
            serve.delete(LOSS_APP)


@pytest.fixture(scope="module")
def probe_nodes(ray_cluster):
    """Four more nodes for the probe's node losses: the draft's and the target's (0.6 of a node's
    `probe_node` each: never together), and two to rebuild them on."""
    nodes = [ray_cluster.add_node(num_cpus=1, resources={"probe_node": 1}) for _ in range(4)]
    ray_cluster.wait_for_nodes()
    yield nodes
    for node in nodes:
        if not node.remaining_processes_alive():  # lost by the probe: out of the cluster's list too
            ray_cluster.remove_node(node, allow_graceful=False)


def test_the_probe_loses_the_workers_nodes_and_the_service_recovers_without_leaks(service, probe_nodes, checkpoints):
    """`specdec probe --phases node-loss`: the node of the draft worker, then of the target worker,
    lost mid-stream (their raylets and agents killed, found by node id on this machine): the draft's
    streams finish target-only and speculation resumes, the target's end with an error event and
    503s follow until 200, and ranks alive and placement groups come back to their counts."""
    from ray import serve
    from typer.testing import CliRunner

    from deployments.app import build_app
    from deployments.cli import app

    apart = {"num_cpus": 0.5, "resources": {"probe_node": 0.6}}
    serve.run(
        build_app(tp_config(checkpoints, target_worker=apart, draft_worker=apart)),
        name=LOSS_APP,
        route_prefix=LOSS_ROUTE,
    )
    try:
        args = ["probe", "--endpoint", URL + LOSS_ROUTE, "--grpc", "", "--app", LOSS_APP, "--phases", "node-loss"]
        args += ["--draft-slack", "60"]  # speed is not a test's to judge: a request must complete, not be fast
        wide = {"COLUMNS": "400", "TERMINAL_WIDTH": "400"}
        result = CliRunner().invoke(app, [*args, "--timeout", "120"], env=wide)
        assert result.exit_code == 0, result.output
        assert "skipped" not in result.output
        assert "draft worker's node lost" in result.output and "target worker's node lost" in result.output
        print(result.output)
    finally:
        serve.delete(LOSS_APP)
