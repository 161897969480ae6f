"""The whole app's configuration (pydantic), loadable from a Serve config YAML's `args`."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from specdec_core.loader import DEFAULT_DRAFT, ModelSpec
from specdec_core.profile import CalibrationSettings
from specdec_core.request import RequestDefaults


class WorkerResources(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_name: str = "specdec-smollm2-135m"
    target: ModelSpec = Field(default_factory=ModelSpec)
    draft: Optional[ModelSpec] = DEFAULT_DRAFT
    defaults: RequestDefaults = Field(
        default_factory=RequestDefaults, description="policy, drafter and K for requests that leave them out"
    )
    max_tokens_limit: int = Field(2048, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024)
    replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(16, ge=1)
    draft_worker: WorkerResources = Field(default_factory=WorkerResources)
    target_worker: WorkerResources = Field(default_factory=WorkerResources)
    host: str = Field("127.0.0.1", description="every listener binds this address: HTTP, gRPC, both workers")
    api_key: Optional[str] = Field(
        None, repr=False, description="required as `Authorization: Bearer` (HTTP) and `authorization` metadata (gRPC)"
    )
    worker_secret: Optional[str] = Field(
        None, repr=False, description="workers refuse calls without it; generated per deployment when unset"
    )
    http_port: int = Field(8000, ge=0, le=65535)
    grpc_port: int = Field(9000, ge=0, le=65535)
    rpc_deadline_s: float = Field(30.0, gt=0)
    session_idle_timeout_s: float = Field(120.0, gt=0)
    worker_poll_interval_s: float = Field(
        1.0, gt=0, description="how often the server looks up each worker's address (a restarted worker moves)"
    )
    torch_threads: Optional[int] = Field(None, ge=1, description="per worker; default: its CPUs")
    calibration: Optional[CalibrationSettings] = Field(
        default_factory=CalibrationSettings,
        description="the target worker measures the target's profile (EASD's tau_h) at load, cached per "
        "model; None: no profile (EASD then needs an explicit tau_h)",
    )
