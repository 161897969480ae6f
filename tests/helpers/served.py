"""The served path without Ray, for tests: in-process gRPC draft and target workers with a
RemoteEngine pointed at them, and the HTTP app over it (an in-process client, or a real server
on a free port for client libraries that open their own connections)."""

from __future__ import annotations

import socket
import threading
import time

import grpc
from fastapi.testclient import TestClient

from deployments.config import AppConfig
from deployments.ingress.http_ingress import build_http_app
from deployments.ingress.remote_engine import STUBS, RemoteEngine, fixed_addresses
from deployments.workers.draft_service import DraftService
from deployments.workers.servicers import DraftServicer, SessionServicer, TargetServicer, start_server
from deployments.workers.target_service import TargetService
from protos import specdec_pb2_grpc as pb_grpc

ADD = {"draft": pb_grpc.add_DrafterServicer_to_server, "target": pb_grpc.add_TargetServicer_to_server}


class Workers:
    """In-process draft and target servers and an engine pointed at them; `draft` and `target`:
    the services (or servicers) to serve instead of new ones."""

    def __init__(self, engine, draft=None, target=None, deadline_s: float = 30.0, idle_timeout_s: float = 60.0):
        draft = draft or DraftService(
            engine.draft_model, engine.target_model.config, idle_timeout_s, tokenizer=engine.frontend.tokenizer
        )
        target = target or TargetService(engine.target_model, idle_timeout_s, engine.frontend.profile())
        servicers = {
            "draft": draft if isinstance(draft, SessionServicer) else DraftServicer(draft),
            "target": target if isinstance(target, SessionServicer) else TargetServicer(target),
        }
        self.servers, self.addresses = {}, {}
        for role, servicer in servicers.items():
            self.servers[role], port = start_server(servicer, ADD[role])
            self.addresses[role] = f"127.0.0.1:{port}"
        self.engine = RemoteEngine(engine.frontend, fixed_addresses(self.addresses), deadline_s)
        # blocking stubs of our own, for calling the workers directly (the engine's are grpc.aio)
        self.stubs = {role: STUBS[role](grpc.insecure_channel(address)) for role, address in self.addresses.items()}

    def stop(self) -> None:
        self.engine.close()
        for server in self.servers.values():
            server.stop(None)


def http_client(workers: Workers, **config) -> TestClient:
    return TestClient(build_http_app(workers.engine, AppConfig(model_name="tiny", **config)))


class HttpServer:
    """The HTTP app over `workers` served by uvicorn on a free loopback port (`url`)."""

    def __init__(self, workers: Workers, **config):
        import uvicorn

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        app = build_http_app(workers.engine, AppConfig(model_name="tiny", **config))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()


def listening_addresses(port: int) -> list[str]:
    """The local addresses of this machine's listening sockets on `port` (IPv4-mapped made plain)."""
    import ipaddress

    import psutil

    addresses = []
    for conn in psutil.net_connections("inet"):
        if conn.status == "LISTEN" and conn.laddr.port == port:
            ip = ipaddress.ip_address(conn.laddr.ip)
            addresses.append(str(getattr(ip, "ipv4_mapped", None) or ip))
    return addresses
