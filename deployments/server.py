"""The Serve deployment: one replica holds a RemoteEngine (tokenizer and loop, no weights),
keeps it pointed at the draft and target workers (watcher.py), serves the OpenAI HTTP API
(http_ingress.py, through Serve's HTTP proxy) and the gRPC API (grpc_ingress.py, its own
server), and counts metrics (metrics.py).

  HTTP (OpenAI API) / gRPC (Specdec.Generate) --> SpecdecServer --gRPC--> draft worker actor
                                                                \\--gRPC--> target worker actor
"""

from __future__ import annotations

import ray
from ray import serve

from specdec_core.frontend import Frontend
from specdec_core.kernels.cpu import configure_cpu
from specdec_core.topologies import load_tree_bank

from .config import AppConfig
from .grpc_ingress import GrpcIngress
from .http_ingress import build_http_app
from .metrics import ServeMetrics
from .remote_engine import RemoteEngine
from .watcher import WorkerWatcher
from .worker import ROLES, start_worker, worker_address

# a lookup of a worker's address while it restarts gives up after this long (the next round retries)
LOOKUP_TIMEOUT_S = 2.0


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class SpecdecServer:
    def __init__(self, config: dict):
        configure_cpu(1)  # verify is small; the cores belong to the workers
        self.config = AppConfig(**config)
        for bank in self.config.tree_banks:
            load_tree_bank(bank)
        frontend = Frontend.from_spec(self.config.target, self.config.defaults, self.config.max_tokens_limit)
        workers = {role: start_worker(role, self.config) for role in ROLES}
        addresses = {role: ray.get(worker.get_address.remote()) for role, worker in workers.items()}
        self.engine = RemoteEngine(
            frontend, addresses, self.config.rpc_deadline_s, ServeMetrics(), self.config.worker_secret
        )
        self.watcher = WorkerWatcher(
            lambda role: worker_address(role, self.config, LOOKUP_TIMEOUT_S),
            self.engine.connect,
            addresses,
            self.config.worker_poll_interval_s,
        )
        self.grpc_ingress = GrpcIngress(self.engine, self.config)

    def __del__(self):  # Serve calls it when the replica stops: free the gRPC port at once
        self.grpc_ingress.stop()
        self.watcher.stop()
        self.engine.close()

    def __serve_build_asgi_app__(self):
        return build_http_app(self.engine, self.config)
