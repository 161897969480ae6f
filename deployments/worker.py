"""The draft and target workers. Each is a named, detached Ray actor (`WorkerGroup`) that places
its ranks (placement.py: one bundle each) and starts them: `WorkerRank` actors that each load the
model, or their shard of it over a tensor-parallel group (specdec_core/parallel.py). Rank 0
serves the worker's gRPC service (servicers.py) on a port of its own; the others follow it
(tensor_parallel.py). With tp_size 1 the group is one rank holding the whole model.

The group watches its ranks: when one dies, it kills the others (their requests fail at once,
none hangs on a collective) and builds the group again. Ray restarts a killed `WorkerGroup`,
whose ranks die with it. `worker_address` finds rank 0's service wherever it is now, and raises
while the group is being built."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Literal, Optional, get_args

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .config import AppConfig, WorkerConfig
from .placement import remove_placement_group, reserve

logger = logging.getLogger(__name__)

WORKER_NAMESPACE = "specdec"
Role = Literal["draft", "target"]
ROLES: tuple[Role, ...] = get_args(Role)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
WATCH_INTERVAL_S = 0.5


def worker_config(role: Role, config: AppConfig) -> WorkerConfig:
    return config.draft_worker if role == "draft" else config.target_worker


@ray.remote
class WorkerRank:
    """One rank of a worker: loads the model (or its shard) and, on rank 0, serves it."""

    def __init__(self, role: Role, config: dict, rank: int):
        self.role, self.config, self.rank = role, AppConfig(**config), rank
        self.store = None

    def open_store(self) -> str:
        """Rank 0 of a group: the rendezvous store's host:port."""
        from specdec_core.parallel import open_store

        host = self.host()
        worker = worker_config(self.role, self.config)
        self.store = open_store(host, worker.tp_size, self.config.placement_timeout_s)
        return f"{host}:{self.store.port}"

    def start(self, store_address: Optional[str]) -> Optional[str]:
        """Join the group (when there is one), load the model and serve it (rank 0: returns its
        gRPC address) or follow rank 0."""
        from protos import specdec_pb2_grpc as pb_grpc
        from specdec_core.heads import load_heads
        from specdec_core.kernels.cpu import configure_cpu
        from specdec_core.loader import load_configs, load_model
        from specdec_core.parallel import join_group, load_sharded_model
        from specdec_core.topologies import load_tree_bank

        from .admission import Admission
        from .servicers import TORCH_THREAD, DraftServicer, TargetServicer, on_torch_thread, start_server
        from .tensor_parallel import ControlChannel, follow

        config, worker = self.config, worker_config(self.role, self.config)
        for bank in config.tree_banks:  # trees the coordinator may name
            load_tree_bank(bank)
        on_torch_thread(configure_cpu, worker.torch_threads or config.torch_threads or max(1, int(worker.num_cpus)))
        spec = config.draft if self.role == "draft" else config.target
        channel = None
        if worker.tp_size > 1:
            host, port = store_address.rsplit(":", 1)
            timeout_s = config.placement_timeout_s
            group = on_torch_thread(join_group, self.rank, worker.tp_size, host, int(port), timeout_s, self.store)
            channel = ControlChannel(group)
            model = on_torch_thread(load_sharded_model, spec, worker.tp_backend)
        else:
            model = on_torch_thread(load_model, spec) if spec else None
        # rank 0 sends every operation to the others, and releases what expires on all of them
        sending = channel if self.rank == 0 else None
        idle_timeout_s = config.session_idle_timeout_s if self.rank == 0 else float("inf")
        admission = None
        if self.rank == 0:
            budget = worker.kv_budget_mb * 2**20 if worker.kv_budget_mb else None
            admission = Admission(budget, worker.max_waiting_sessions, worker.admission_wait_s)
        if self.role == "draft":
            target_config = load_configs(config.target)[0]
            servicer = DraftServicer(
                model, target_config, idle_timeout_s, sending, admission, batch_window_s=worker.batch_window_ms / 1000
            )
            add = pb_grpc.add_DrafterServicer_to_server
        else:
            heads = on_torch_thread(load_heads, config.target_heads, spec.source, model)
            servicer = TargetServicer(
                model,
                idle_timeout_s,
                channel=sending,
                batch_window_s=worker.batch_window_ms / 1000,
                prefill_chunk=worker.prefill_chunk,
                admission=admission,
                heads=heads,
            )
            add = pb_grpc.add_TargetServicer_to_server
        if self.rank > 0:
            TORCH_THREAD.submit(follow, channel, servicer.apply)
            return None
        if self.role == "target" and config.calibration is not None:
            self.load_target_profile(servicer, spec)
        self.server, port = start_server(servicer, add, host=self.host(), secret=config.worker_secret)
        return f"{self.host()}:{port}"

    def load_target_profile(self, servicer, spec) -> None:
        """Rank 0: the target's profile from the cache, or measured now on every rank and cached."""
        from specdec_core.profile import cached_profile, store_profile

        from .servicers import on_torch_thread

        servicer.profile = cached_profile(spec, self.config.calibration)
        if servicer.profile is None:
            op = {"op": "measure_profile", "spec": spec.model_dump(), "settings": self.config.calibration.model_dump()}
            store_profile(spec, on_torch_thread(servicer.run, op))

    def host(self) -> str:
        # loopback when the service is; else the one address Ray uses for this node (the server
        # may run on another node), never every interface
        return "127.0.0.1" if self.config.host in LOOPBACK else ray.util.get_node_ip_address()

    def ping(self) -> int:
        return os.getpid()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0, max_concurrency=4)
class WorkerGroup:
    """A worker's ranks: places and starts them, answers where rank 0 serves, and builds the
    group again when a rank dies."""

    def __init__(self, role: Role, config: dict):
        self.role, self.config_dict, self.config = role, config, AppConfig(**config)
        self.ranks: list = []
        self.placement = None
        self.address: Optional[str] = None
        self.lock = threading.Lock()
        self.build()
        threading.Thread(target=self.watch, name="rank-watcher", daemon=True).start()

    def build(self) -> None:
        worker = worker_config(self.role, self.config)
        if self.role == "draft" and self.config.draft_on_target_node:
            node_ip = ray.get(worker_actor("target", self.config.model_name).node_ip.remote())
            worker = worker.model_copy(update={"resources": {**worker.resources, f"node:{node_ip}": 0.001}})
        name = f"{self.config.model_name}-{self.role}"
        self.placement = reserve(name, worker, self.config.placement_timeout_s)
        self.ranks = [
            WorkerRank.options(
                num_cpus=worker.num_cpus,
                num_gpus=worker.num_gpus,
                resources=dict(worker.resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank),
            ).remote(self.role, self.config_dict, rank)
            for rank in range(worker.tp_size)
        ]
        store_address = ray.get(self.ranks[0].open_store.remote()) if worker.tp_size > 1 else None
        addresses = ray.get([rank.start.remote(store_address) for rank in self.ranks])
        self.address = addresses[0]

    def watch(self) -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            try:
                ray.get([rank.ping.remote() for rank in self.ranks])
            except ray.exceptions.RayActorError as error:
                logger.error("%s worker lost a rank (%s); building the group again", self.role, error)
                self.rebuild()

    def rebuild(self) -> None:
        with self.lock:
            self.address = None
            for rank in self.ranks:  # the survivors fail their requests now instead of hanging
                ray.kill(rank, no_restart=True)
            remove_placement_group(self.placement)
            while True:
                try:
                    self.build()
                    return
                except Exception as error:  # noqa: BLE001 - e.g. the cluster cannot place it yet; retry
                    logger.error("building the %s worker failed: %s; retrying", self.role, error)
                    time.sleep(1.0)

    def get_address(self) -> str:
        """Rank 0's gRPC address; raises while the group is being built."""
        if self.address is None:
            raise RuntimeError(f"the {self.role} worker is being rebuilt")
        return self.address

    def pids(self) -> list[int]:
        """The ranks' process ids, rank 0 first."""
        return ray.get([rank.ping.remote() for rank in self.ranks])

    def node_ip(self) -> str:
        """The node of rank 0."""
        return ray.get(self.ranks[0].node_ip.remote())

    def rank_handles(self) -> list:
        return list(self.ranks)


def worker_name(role: Role, model_name: str) -> str:
    return f"{model_name}-{role}-worker"


def worker_actor(role: Role, model_name: str) -> ray.actor.ActorHandle:
    """The running worker (raises ValueError when there is none)."""
    return ray.get_actor(worker_name(role, model_name), namespace=WORKER_NAMESPACE)


def start_worker(role: Role, config: AppConfig) -> ray.actor.ActorHandle:
    """The named worker, started unless it runs already (server replicas share it)."""
    return WorkerGroup.options(
        name=worker_name(role, config.model_name),
        namespace=WORKER_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,
    ).remote(role, config.model_dump())


def worker_address(role: Role, config: AppConfig, timeout_s: float) -> str:
    """host:port of the worker's gRPC service now (raises while it is down or restarting)."""
    return ray.get(worker_actor(role, config.model_name).get_address.remote(), timeout=timeout_s)
