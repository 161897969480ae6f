"""The draft and target workers. Each is a Serve deployment of the app (app.py) whose replicas
are `WorkerGroup`s: a group starts its ranks, `WorkerRank` actors that each load the model, or
their shard of it over a tensor-parallel group (specdec_core/models/parallel.py), in the replica's
placement group (one bundle per rank). Rank 0 serves the worker's gRPC service (servicers.py)
on a port of its own; the others follow it (tensor_parallel.py, `WorkerService.follow`). A
worker's ranks are pp_size pipeline stages of tp_size ranks; with one of each the group is one
rank holding the whole model."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Literal, Optional, get_args

import ray
from ray import serve
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..config import AppConfig, WorkerConfig
from ..coordination.placement import bundle_index, reserve
from ..coordination.replicas import FORGET_S
from ..coordination.startup_log import note
from .priority import SERVING_NICENESS, STARTING_NICENESS, may_raise_priority_to, set_priority

Role = Literal["draft", "target"]
ROLES: tuple[Role, ...] = get_args(Role)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
RANK_PING_TIMEOUT_S = 10.0
DRAIN_POLL_S = 0.5
logger = logging.getLogger(__name__)


def worker_grace_s(config: AppConfig) -> float:
    """A stopping worker replica's time (Serve's graceful_shutdown_timeout_s): until the servers
    have forgotten it, then their grace for the sessions it holds, then a health check."""
    return FORGET_S + config.graceful_shutdown_timeout_s + RANK_PING_TIMEOUT_S


def worker_config(role: Role, config: AppConfig) -> WorkerConfig:
    return config.draft_worker if role == "draft" else config.target_worker


def deployment_name(role: Role) -> str:
    return f"{role.capitalize()}Worker"


def worker_handle(role: Role, app_name: str):
    """The worker's deployment handle in app `app_name` (its replicas' `get_address`, `stats`,
    `rank_handles`), from outside the app: the probe, tests."""
    return serve.get_deployment_handle(deployment_name(role), app_name=app_name)


@ray.remote
class WorkerRank:
    """One rank of a worker: loads the model (or its shard) and, on rank 0, serves it."""

    def __init__(self, role: Role, config: dict, rank: int):
        self.role, self.config, self.rank = role, AppConfig(**config), rank
        self.store = None
        self.service = None  # once started
        self.prioritized = may_raise_priority_to(SERVING_NICENESS)
        if self.prioritized:
            set_priority(STARTING_NICENESS)  # until `start` has loaded the model

    def open_store(self) -> str:
        """Rank 0 of a group: the rendezvous store's host:port."""
        from specdec_core.models.parallel import open_store

        host = self.host()
        worker = worker_config(self.role, self.config)
        self.store = open_store(host, worker.num_ranks, self.config.placement_timeout_s)
        return f"{host}:{self.store.port}"

    def start(self, store_address: Optional[str]) -> Optional[str]:
        """Join the group (when there is one), load the model and serve it (rank 0: returns its
        gRPC address) or follow rank 0."""
        from protos import specdec_pb2_grpc as pb_grpc
        from specdec_core.drafters.suffix_cache import SuffixCache
        from specdec_core.heads.loading import load_heads
        from specdec_core.models.kernels.chunked import kernel_summary
        from specdec_core.models.kernels.cpu import configure_cpu
        from specdec_core.models.loader import load_configs, load_model, load_tokenizer
        from specdec_core.models.parallel import join_group, load_sharded_model
        from specdec_core.planning.kv_budget import kv_budget
        from specdec_core.runtime.model_runner import runner_of
        from specdec_core.trees.topologies import load_tree_bank

        from .admission import Admission
        from .draft_service import DraftService
        from .servicers import DraftServicer, TargetServicer, start_server
        from .target_service import TargetService
        from .tensor_parallel import ControlChannel
        from .worker_service import TORCH_THREAD, on_torch_thread

        config, worker = self.config, worker_config(self.role, self.config)
        for bank in config.tree_banks:  # trees the coordinator may name
            load_tree_bank(bank)
        on_torch_thread(configure_cpu, config.threads(worker))
        spec = config.draft if self.role == "draft" else config.target
        if spec is not None:
            layout = f"{worker.pp_size} stage(s) of {worker.tp_size} rank(s)"
            self.note(f"loading {spec.source} ({spec.dtype}, {layout})")
        channel = None
        if worker.num_ranks > 1:
            host, port = store_address.rsplit(":", 1)
            timeout_s = config.placement_timeout_s
            group = on_torch_thread(join_group, self.rank, worker.num_ranks, host, int(port), timeout_s, self.store)
            channel = ControlChannel(group)
            model = on_torch_thread(load_sharded_model, spec, worker.tp_backend, worker.pp_size)
        else:
            model = on_torch_thread(load_model, spec) if spec else None
        # rank 0 sends every operation to the others, and releases what expires on all of them
        sending = channel if self.rank == 0 else None
        idle_timeout_s = config.session_idle_timeout_s if self.rank == 0 else float("inf")
        # every rank sizes its pool alike (the smallest of their budgets); only rank 0 admits
        budget = None
        if model is not None:
            budget = on_torch_thread(kv_budget, model, worker.kv_budget_mb, worker.kv_fraction, worker.prefill_chunk)
            if budget is not None and channel is not None:
                budget = on_torch_thread(channel.smallest, budget)
        on_demand = self.role == "target" and worker.kv_admission == "on_demand"
        admission = Admission(budget, worker.max_waiting_sessions, worker.admission_wait_s, on_demand)
        if self.role == "draft":
            kernels = kernel_summary(model) if model is not None else ""
            if kernels:
                self.note(f"draft kernels on this CPU: {kernels}")
            target_config = load_configs(config.target)[0]
            service = DraftService(
                model,
                target_config,
                idle_timeout_s,
                sending,
                admission,
                batch_window_s=worker.batch_window_ms / 1000,
                tokenizer=load_tokenizer(config.target) if model is not None else None,
                suffixes=SuffixCache(config.suffix_cache),
            )
            servicer, add = DraftServicer(service, config.worker_secret), pb_grpc.add_DrafterServicer_to_server
        else:
            if config.target_heads:
                self.note(f"loading the target's heads ({config.target_heads})")
            heads = on_torch_thread(load_heads, config.target_heads, spec.source, model, self.warn)
            service = TargetService(
                model,
                idle_timeout_s,
                channel=sending,
                batch_window_s=worker.batch_window_ms / 1000,
                prefill_chunk=worker.prefill_chunk,
                admission=admission,
                heads=heads,
                rank=self.rank,
            )
            servicer, add = TargetServicer(service), pb_grpc.add_TargetServicer_to_server
        if model is not None:
            runner_of(model.model).kv_pool().prefix_caching = config.prefix_caching
        if self.prioritized:
            set_priority(SERVING_NICENESS)
        self.service = service
        if self.rank > 0:
            TORCH_THREAD.submit(service.follow, channel)
            return None
        if self.role == "target" and config.calibration is not None:
            self.load_target_profile(service, spec)
        self.server, port = start_server(servicer, add, host=self.host(), secret=config.worker_secret)
        self.note(f"serving at {self.host()}:{port}")
        return f"{self.host()}:{port}"

    def load_target_profile(self, service, spec) -> None:
        """Rank 0: the target's profile from the cache, or measured now on every rank and cached."""
        from specdec_core.calibration.target_profile import cached_profile, store_profile

        service.profile = cached_profile(spec, self.config.calibration)
        if service.profile is None:
            self.note("measuring the target's profile (EASD's tau_h; cached for the next start)")
            store_profile(spec, service.measure_profile(spec, self.config.calibration))

    def note(self, step: str) -> None:
        if self.rank == 0:  # one voice per worker
            note(self.role, step)

    def warn(self, line: str) -> None:
        """Something the deployment left out (the heads that do not fit): in the log and noted."""
        if self.rank == 0:
            logger.warning("%s worker: %s", self.role, line)
        self.note(line)

    def host(self) -> str:
        # loopback when the service is; else the one address Ray uses for this node (the server
        # may run on another node), never every interface
        return "127.0.0.1" if self.config.host in LOOPBACK else ray.util.get_node_ip_address()

    def ping(self) -> int:
        """This rank's process id; raises where its group is broken (worker_service.py: its ranks
        may hold different sessions, or a rank is gone), which fails the group's health check."""
        if self.service is not None:
            self.service.check_unbroken()
        return os.getpid()

    def stats(self) -> dict:
        """The service's counts (WorkerStats' fields)."""
        return self.service.stats()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=2, health_check_timeout_s=30)
class WorkerGroup:
    """A worker's ranks, as a replica of its Serve deployment (app.py): `WorkerRank` actors in the
    replica's placement group (`placement_group_bundles`: a bundle per rank, or per stage), rank 0's gRPC
    address for the server, and Serve's health check, which fails when a rank is gone; Serve then
    restarts the replica, and the ranks, owned by it, die with it (their requests fail at once)
    and start again with the new one. With `draft_on_target_node` the draft's group asks the
    target's replica for its node and reserves its own placement group there."""

    async def __init__(self, role: Role, config: dict, target: Optional[Any] = None):
        self.role, self.config = role, AppConfig(**config)
        worker = worker_config(role, self.config)
        placement = ray.util.get_current_placement_group()
        replica = serve.get_replica_context().replica_id.unique_id
        self.own_placement = None
        if role == "draft" and self.config.draft_on_target_node:
            node_ip = await target.node_ip.remote()
            worker = worker.model_copy(update={"resources": {**worker.resources, f"node:{node_ip}": 0.001}})
            # one a replica: a rollout's new replica reserves its own beside the old one's
            name = f"{self.config.model_name}-draft-{replica}"
            placement = self.own_placement = await asyncio.to_thread(
                reserve, name, worker, self.config.placement_timeout_s
            )
        self.ranks = [
            WorkerRank.options(
                name=f"{role} worker {replica} rank {rank}",  # the probe finds a rank by it (GCS actor table)
                num_cpus=worker.num_cpus,
                num_gpus=worker.num_gpus,
                resources=dict(worker.resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement, placement_group_bundle_index=bundle_index(worker, rank)
                ),
            ).remote(role, config, rank)
            for rank in range(worker.num_ranks)
        ]
        store_address = await self.ranks[0].open_store.remote() if worker.num_ranks > 1 else None
        addresses = await asyncio.gather(*(rank.start.remote(store_address) for rank in self.ranks))
        self.address = addresses[0]

    async def check_health(self) -> None:
        """Serve's health check: every rank answers (a lost one fails it, and Serve restarts us)."""
        await asyncio.wait_for(asyncio.gather(*(rank.ping.remote() for rank in self.ranks)), RANK_PING_TIMEOUT_S)

    def get_address(self) -> str:
        """Rank 0's gRPC service, host:port."""
        return self.address

    async def stats(self) -> dict:
        """Rank 0's counts (the ranks follow its sessions): WorkerStats' fields."""
        return await asyncio.wait_for(self.ranks[0].stats.remote(), RANK_PING_TIMEOUT_S)

    async def node_ip(self) -> str:
        """The node of rank 0."""
        return await self.ranks[0].node_ip.remote()

    def rank_handles(self) -> list:
        return list(self.ranks)

    async def __del__(self):
        """Serve stops the replica: a redeploy replaced it, or a rank is gone. With its ranks
        alive it serves on until every server has forgotten it (replicas.FORGET_S: their requests
        meanwhile are served) and its open sessions have ended, within `worker_grace_s`, so that a
        rollout fails no request. Then its ranks go with it, and its own placement group."""
        deadline = time.monotonic() + worker_grace_s(self.config) - RANK_PING_TIMEOUT_S
        try:
            if getattr(self, "address", None) is not None:  # it started, and servers may know it
                await self.check_health()
                await asyncio.sleep(FORGET_S)
                while (await self.stats())["sessions"] and time.monotonic() < deadline:
                    await asyncio.sleep(DRAIN_POLL_S)
        except Exception as error:  # noqa: BLE001 - a rank is gone: nothing left to serve
            logger.warning("%s worker replica stops at once: %r", self.role, error)
        for rank in getattr(self, "ranks", ()):
            ray.kill(rank, no_restart=True)
        if getattr(self, "own_placement", None) is not None:
            remove_placement_group(self.own_placement)
