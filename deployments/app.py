"""The Serve application builder (`import_path: deployments.app:build_app` in cluster/*.yaml)."""

from __future__ import annotations

import os
import secrets
from typing import Optional

import ray
from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

from .config import AppConfig, refuse_unfit_heads
from .coordination.placement import bundles
from .coordination.startup_log import NAMESPACE
from .ingress.server import SpecdecServer
from .workers.worker import WorkerGroup, deployment_name, worker_config, worker_grace_s

API_KEY_ENV = "SPECDEC_API_KEY"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's, on the head node only

# Serve's proxy readiness/health checks default to 5-10 s; on a busy 2-core machine starting
# two model workers they time out and Serve kills a healthy proxy. Set before Ray starts.
SERVE_ENV_DEFAULTS = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


def apply_serve_env_defaults() -> None:
    for key, value in SERVE_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def build_app(args: Optional[dict] = None):
    """The app for `args` (an AppConfig dict): the draft and target workers' deployments, each
    replica a worker group in a placement group of its ranks' bundles, bound into the server's.
    A config that cannot serve is refused here (ValueError), before any replica starts.
    The API key may come from $SPECDEC_API_KEY; the workers' secret is the cluster's
    (`shared_worker_secret`), so every replica, every restart and every redeploy shares it."""
    config = AppConfig(**(args or {}))
    refuse_unfit_heads(config)
    if config.api_key is None and os.environ.get(API_KEY_ENV):
        config.api_key = os.environ[API_KEY_ENV]
    if config.worker_secret is None:
        config.worker_secret = shared_worker_secret(config.model_name)
    arguments = config.model_dump()
    target = worker_deployment("target", config).bind("target", arguments)
    draft = worker_deployment("draft", config).bind("draft", arguments, target)
    head = {"resources": {HEAD_NODE_RESOURCE: 0.001}} if config.server_on_head_node else {}
    return SpecdecServer.options(
        ray_actor_options={"num_cpus": 0, **head},
        num_replicas=config.replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        max_queued_requests=config.max_queued_requests,
        max_surge_percent=100,  # it holds no resources: a new replica starts before the old one stops
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
    ).bind(arguments, draft, target)


def shared_worker_secret(model_name: str) -> str:
    """The secret between the servers and the workers of `model_name`'s app: drawn once per
    cluster and kept in its KV store (beside the deployments' arguments, which Serve keeps there
    too), so that a redeploy's servers and workers, which serve beside the old ones during a
    rollout, call each other. Without a cluster (an app built to be inspected), drawn anew."""
    if not ray.is_initialized():
        return secrets.token_hex(16)
    key, namespace = f"worker_secret:{model_name}", NAMESPACE
    _internal_kv_put(key, secrets.token_hex(16), overwrite=False, namespace=namespace)  # the first draw stays
    return _internal_kv_get(key, namespace=namespace).decode()


def worker_deployment(role: str, config: AppConfig):
    """A worker's deployment: its replicas, and the bundles of each replica's ranks (a draft on the
    target's node reserves its own, where that node is: worker.py)."""
    worker = worker_config(role, config)
    placement = {"placement_group_bundles": bundles(worker), "placement_group_strategy": worker.placement_strategy}
    own_placement = role == "draft" and config.draft_on_target_node
    return WorkerGroup.options(
        name=deployment_name(role),
        num_replicas=worker.replicas,
        max_surge_percent=worker.max_surge_percent,
        graceful_shutdown_timeout_s=worker_grace_s(config),
        **({} if own_placement else placement),
    )
