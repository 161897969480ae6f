"""The draft and target workers as named Ray actors: each loads its model and serves its gRPC
service (servicers.py) on a port of its own. Ray restarts a dead worker (on a new port);
`worker_address` finds it wherever it is now."""

from __future__ import annotations

import os
from typing import Literal, get_args

import ray

from .config import AppConfig

WORKER_NAMESPACE = "specdec"
Role = Literal["draft", "target"]
ROLES: tuple[Role, ...] = get_args(Role)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@ray.remote
class WorkerActor:
    """Hosts one model behind a gRPC service ("draft": Drafter, "target": Target)."""

    def __init__(self, role: Role, config: dict):
        from protos import specdec_pb2_grpc as pb_grpc
        from specdec_core.frontend import Frontend
        from specdec_core.kernels.cpu import configure_cpu
        from specdec_core.loader import load_configs, load_model
        from specdec_core.profile import calibration_progress, load_profile

        from .servicers import DraftServicer, TargetServicer, on_torch_thread, start_server

        app_config = AppConfig(**config)
        resources = app_config.draft_worker if role == "draft" else app_config.target_worker
        on_torch_thread(configure_cpu, app_config.torch_threads or max(1, int(resources.num_cpus)))
        model_spec = app_config.draft if role == "draft" else app_config.target
        model = on_torch_thread(load_model, model_spec) if model_spec else None
        if role == "draft":
            target_config, _ = load_configs(app_config.target)
            servicer = DraftServicer(model, target_config, app_config.session_idle_timeout_s)
            add = pb_grpc.add_DrafterServicer_to_server
        else:
            profile = None
            if app_config.calibration is not None:
                frontend = Frontend.from_spec(model_spec)
                progress = calibration_progress(model_spec.source)
                profile = on_torch_thread(load_profile, model_spec, model, frontend, app_config.calibration, progress)
            servicer = TargetServicer(model, app_config.session_idle_timeout_s, profile)
            add = pb_grpc.add_TargetServicer_to_server
        # loopback when the service is; else the one address Ray uses for this node (the server
        # may run on another node), never every interface
        host = "127.0.0.1" if app_config.host in LOOPBACK else ray.util.get_node_ip_address()
        self.server, port = start_server(servicer, add, host=host, secret=app_config.worker_secret)
        self.address = f"{host}:{port}"

    def get_address(self) -> str:
        return self.address

    def pid(self) -> int:
        return os.getpid()


def worker_name(role: Role, model_name: str) -> str:
    return f"{model_name}-{role}-worker"


def worker_actor(role: Role, model_name: str) -> ray.actor.ActorHandle:
    """The running worker (raises ValueError when there is none)."""
    return ray.get_actor(worker_name(role, model_name), namespace=WORKER_NAMESPACE)


def start_worker(role: Role, config: AppConfig) -> ray.actor.ActorHandle:
    """The named worker, started unless it runs already (server replicas share it)."""
    resources = config.draft_worker if role == "draft" else config.target_worker
    return WorkerActor.options(
        name=worker_name(role, config.model_name),
        namespace=WORKER_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=resources.num_cpus,
        num_gpus=resources.num_gpus,
        max_restarts=-1,
    ).remote(role, config.model_dump())


def worker_address(role: Role, config: AppConfig, timeout_s: float) -> str:
    """host:port of the worker's gRPC service now (raises while it is down or restarting)."""
    return ray.get(worker_actor(role, config.model_name).get_address.remote(), timeout=timeout_s)
