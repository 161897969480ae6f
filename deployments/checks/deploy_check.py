"""What `specdec start-check` and `specdec rollout-check` measure: whether a client that acts as
guidellm, lm-eval or a readiness probe do (ask /v1/models, then send its first request at once)
is served while the service starts, and whether requests sent back to back through `serve deploy`
of changed configs are all served, with the new config's output from when on. Both drive Ray's
own `serve` command line, as a user does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import httpx
import yaml

POLL_S = 0.1
RECENT_S = 5.0
SERVE_COMMAND = [sys.executable, "-m", "ray.serve.scripts"]  # Ray's `serve`, from this environment


@dataclass
class Start:
    listed_s: Optional[float]  # since the start command, when /v1/models first answered 200
    chat_status: Optional[int]  # of the chat sent at once then (0: no response)
    before: list[str]  # what /v1/models answered before (statuses, or "refused")


@dataclass
class Rollout:
    config: str
    statuses: Counter = field(default_factory=Counter)  # of the requests sent while it rolled out
    first_new_s: Optional[float] = None  # since the deploy, when a 200 first carried other token ids
    app_status: str = ""
    failures: list[str] = field(default_factory=list)  # the first few failed responses


def service_url(config: Path) -> tuple[str, str]:
    """(HTTP base URL, model name) of a Serve config's specdec application."""
    document = yaml.safe_load(config.read_text())
    http = document.get("http_options") or {}
    args = document["applications"][0].get("args") or {}
    return f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}", args.get("model_name", "")


def chat(url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Name three prime numbers."}]}
    return httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 16, "temperature": 0}, timeout=120)


def first_listing(url: str, model: str, began: float, limit_s: float) -> Start:
    """Poll /v1/models from `began` until it answers 200, then send a chat at once."""
    before: list[str] = []
    while time.perf_counter() - began < limit_s:
        try:
            status = httpx.get(f"{url}/v1/models", timeout=30).status_code
        except httpx.TransportError:
            status = "refused"
        if status == 200:
            listed_s = time.perf_counter() - began
            try:
                chat_status = chat(url, model).status_code
            except httpx.TransportError:
                chat_status = 0
            return Start(round(listed_s, 1), chat_status, sorted(set(before)))
        before.append(str(status))
        time.sleep(POLL_S)
    return Start(None, None, sorted(set(before)))


def stopped(url: str, limit_s: float = 120.0) -> None:
    """Wait until nothing answers at `url` any more (the last start's proxy is gone)."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        try:
            httpx.get(f"{url}/v1/models", timeout=5)
        except httpx.TransportError:
            return
        time.sleep(POLL_S)
    raise RuntimeError(f"{url} still answers {limit_s:g} s after the service was stopped")


def start_with_specdec_serve(config: Path, limit_s: float) -> Start:
    """`specdec serve --config CONFIG` (a Ray cluster of its own), measured, then stopped as Ctrl-C
    stops it (it shuts Serve and its Ray cluster down)."""
    url, model = service_url(config)
    stopped(url)
    began = time.perf_counter()
    process = specdec_serve(config)
    try:
        return first_listing(url, model, began, limit_s)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        stopped(url)


def specdec_serve(config: Path) -> subprocess.Popen:
    """`specdec serve --config CONFIG` from this environment, in a process group of its own."""
    command = [str(Path(sys.executable).parent / "specdec"), "serve", "--config", str(config)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def start_with_serve_deploy(config: Path, limit_s: float) -> Start:
    """`serve deploy CONFIG` onto the running Ray cluster, measured, then `serve shutdown`."""
    url, model = service_url(config)
    began = time.perf_counter()
    subprocess.run([*SERVE_COMMAND, "deploy", str(config)], check=True, capture_output=True)
    try:
        return first_listing(url, model, began, limit_s)
    finally:
        subprocess.run([*SERVE_COMMAND, "shutdown", "-y"], check=True, capture_output=True)
        stopped(url)


def app_status(app: str) -> str:
    """The application's status (`serve status`)."""
    status = yaml.safe_load(
        subprocess.run([*SERVE_COMMAND, "status"], capture_output=True, text=True, check=True).stdout
    )
    return ((status.get("applications") or {}).get(app) or {}).get("status", "absent")


class Client:
    """Sends one chat after another on a thread, noting (when sent, status, token ids or error)."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.sent: list[tuple[float, int, object]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            sent = time.perf_counter()
            try:
                reply = chat(self.url, self.model)
                ids = tuple(reply.json()["choices"][0]["token_ids"]) if reply.status_code == 200 else reply.text[:300]
                self.sent.append((sent, reply.status_code, ids))
            except httpx.TransportError as error:
                self.sent.append((sent, 0, repr(error)))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def rollout(config: Path, app: str, client: Client, settle_s: float, limit_s: float) -> Rollout:
    """`serve deploy CONFIG` while `client` sends; until the update has settled (the app RUNNING or
    DEPLOY_FAILED, and `settle_s` passed: the old replicas stop a few seconds after the new are
    up), at most `limit_s`."""
    began = time.perf_counter()
    # the running config's output: what the last requests before the deploy got
    seen = {ids for sent, status, ids in client.sent if status == 200 and sent >= began - RECENT_S}
    subprocess.run([*SERVE_COMMAND, "deploy", str(config)], check=True, capture_output=True)
    result = Rollout(str(config))
    while time.perf_counter() - began < limit_s:
        time.sleep(2.0)
        result.app_status = app_status(app)
        if result.app_status in ("RUNNING", "DEPLOY_FAILED") and time.perf_counter() - began >= settle_s:
            break
    new = [sent for sent, status, ids in client.sent if sent >= began and status == 200 and ids not in seen]
    result.first_new_s = round(new[0] - began, 1) if new else None
    during = [(status, ids) for sent, status, ids in client.sent if sent >= began]
    result.statuses = Counter(status for status, _ in during)
    result.failures = [str(ids) for status, ids in during if status != 200][:3]
    return result


def rollouts(configs: list[Path], app: str, settle_s: float, limit_s: float, tell: Callable[[str], None]):
    """Each of `configs` deployed in turn onto the running app, one client sending throughout."""
    url, model = service_url(configs[0])
    client = Client(url, model)
    try:
        time.sleep(RECENT_S)  # the running config's output, to tell the new ones' from
        results = []
        for config in configs:
            tell(f"serve deploy {config}")
            results.append(rollout(config, app, client, settle_s, limit_s))
        return results
    finally:
        client.close()
