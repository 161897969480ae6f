"""The server deployment: one replica holds a RemoteEngine (tokenizer and loop, no weights),
serves the OpenAI HTTP API (http_ingress.py, through Serve's HTTP proxy) and the gRPC API
(grpc_ingress.py, its own server), and counts metrics (prometheus.py). It reaches the draft and
target workers (worker.py) through their deployments' handles: each request takes a replica's
gRPC address that the handle gave (replicas.py) and keeps that replica for all its calls, so its
sessions stay where they were opened; the data path is gRPC.

  HTTP (OpenAI API) / gRPC (Specdec.Generate) --> SpecdecServer --gRPC--> DraftWorker replica
                                                                \\--gRPC--> TargetWorker replica
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

from ray import serve

from specdec_core.loop.frontend import Frontend
from specdec_core.models.kernels.cpu import configure_cpu
from specdec_core.trees.topologies import load_tree_bank

from ..config import AppConfig
from ..coordination.replicas import ReplicaDirectory
from ..workers.worker import worker_config
from .drain import watch_for_drain
from .grpc_ingress import GrpcIngress
from .http_ingress import build_http_app
from .prometheus import ServeMetrics
from .remote_engine import RemoteEngine


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class SpecdecServer:
    def __init__(self, config: dict, draft, target):
        """`draft`, `target`: the workers' deployment handles."""
        configure_cpu(1)  # verify is small; the cores belong to the workers
        self.config = AppConfig(**config)
        for bank in self.config.tree_banks:
            load_tree_bank(bank)
        # a lookup waits on Serve's handle off the coordinator loop; a directory asks once at a time
        self.lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="replica-lookup")
        self.replicas = {
            role: ReplicaDirectory(role, self.lookup(handle), self.config.worker_lookup_timeout_s)
            for role, handle in (("draft", draft), ("target", target))
        }
        frontend = Frontend.from_spec(self.config.target, self.config.defaults, self.config.max_tokens_limit)
        frontend.draft_costs = lambda: self.config.draft_costs
        self.engine = RemoteEngine(
            frontend, self.locate, self.config.rpc_deadline_s, ServeMetrics(), self.config.worker_secret
        )
        for directory in self.replicas.values():  # ask now: the first request finds them known
            self.engine.coordinator.loop.call_soon_threadsafe(directory.ask)
        self.grpc_ingress = GrpcIngress(self.engine, self.config)
        app_name = serve.get_replica_context().app_name
        asyncio.run_coroutine_threadsafe(watch_for_drain(self.engine.drain, app_name), self.engine.coordinator.loop)

    async def locate(self, role: str, wait: bool = True) -> str:
        """A replica of the worker `role` for one request: its gRPC address (replicas.py). With
        none found yet it waits up to the worker's `admission_wait_s` (`wait`), or as long as a
        refresh may take."""
        wait_s = worker_config(role, self.config).admission_wait_s if wait else self.config.worker_lookup_timeout_s
        return await self.replicas[role].pick(wait_s)

    def lookup(self, handle) -> Callable[[float], Awaitable[str]]:
        """Ask `handle` for a replica's address, within the timeout given."""

        async def ask(timeout_s: float) -> str:
            response = handle.get_address.remote()
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    self.lookups, lambda: response.result(timeout_s=timeout_s)
                )
            except BaseException:
                response.cancel()
                raise

        return ask

    def __del__(self):
        """Serve calls it when the replica stops, also where its start failed midway: free the
        gRPC port at once."""
        if hasattr(self, "grpc_ingress"):
            self.grpc_ingress.stop()
        if hasattr(self, "engine"):
            self.engine.close()
        if hasattr(self, "lookups"):
            self.lookups.shutdown(wait=False)

    def __serve_build_asgi_app__(self):
        return build_http_app(self.engine, self.config)
