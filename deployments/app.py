"""The Serve application builder (`import_path: deployments.app:build_app` in cluster/*.yaml)."""

from __future__ import annotations

import os
from typing import Optional

from .config import AppConfig
from .server import SpecdecServer

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
    config = AppConfig(**(args or {}))
    return SpecdecServer.options(num_replicas=config.replicas, max_ongoing_requests=config.max_ongoing_requests).bind(
        config.model_dump()
    )
