"""The whole app's configuration (pydantic), loadable from a Serve config YAML's `args`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec_core.api.request import RequestDefaults
from specdec_core.calibration.draft_costs import DraftCosts
from specdec_core.calibration.profile_types import CalibrationSettings
from specdec_core.drafters.suffix_cache import SuffixCacheSettings
from specdec_core.heads.loading import AUTO, TargetShape, named_heads, refusal
from specdec_core.loop.kv_room import Admission as KVAdmission
from specdec_core.models.loader import DEFAULT_DRAFT, ModelSpec, load_configs, refuse_draft_only_target
from specdec_core.planning.kv_budget import DEFAULT_GPU_MEMORY_UTILIZATION
from specdec_core.target.scorer import PREFILL_CHUNK

logger = logging.getLogger(__name__)


class WorkerConfig(BaseModel):
    """One worker (draft or target): its ranks and what each rank needs from the cluster."""

    model_config = ConfigDict(extra="forbid")
    num_cpus: float = Field(1.0, ge=0, description="per rank")
    num_gpus: float = Field(0.0, ge=0, description="per rank; a fraction shares a GPU")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per rank: pins the worker to node types that have them"
    )
    replicas: int = Field(1, ge=1, description="replicas of the worker (each with its ranks); a request stays on one")
    tp_size: int = Field(
        1, ge=1, le=64, description="tensor-parallel ranks of a stage (specdec_core/models/parallel.py)"
    )
    pp_size: int = Field(
        1, ge=1, le=64, description="pipeline stages of tp_size ranks each, layers split between them (pipeline.py)"
    )
    tp_backend: Literal["transformers", "deepspeed"] = "transformers"
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK",
        description="of the stages' bundles (one a stage, each on one node): STRICT_PACK keeps every stage on one "
        "node, STRICT_SPREAD puts each stage on a node of its own",
    )
    batch_window_ms: float = Field(5.0, ge=0, le=1000, description="a step waits at most this for other sessions' rows")
    torch_threads: Optional[int] = Field(None, ge=1, description="per rank; default: the app's torch_threads")
    prefill_chunk: int = Field(PREFILL_CHUNK, ge=1, description="target worker: prompt tokens per step and session")
    kv_budget_mb: Optional[float] = Field(
        None, gt=0, description="KV memory the worker's sessions may reserve (rank 0's share); None: no limit"
    )
    gpu_memory_utilization: Optional[float] = Field(
        None,
        gt=0,
        le=1,
        description="on CUDA without kv_budget_mb: the fraction of the card a rank may use for weights, "
        "activations and KV (vLLM's knob); the KV pool gets the rest after a profiled step. Default: "
        "0.9 of the rank's num_gpus share, so workers sharing a card split it",
    )
    kv_admission: KVAdmission = Field(
        "on_demand",
        description="target worker: on_demand (vLLM's) admits a session when its prompt fits the KV pool now, "
        "takes blocks as tokens come and preempts the youngest sessions when the pool runs out (they resume "
        "by recompute); reach reserves each session's prompt plus max_tokens up front. A draft worker admits "
        "by reach",
    )
    max_waiting_sessions: int = Field(64, ge=0, description="sessions that wait for KV memory before 503s")
    admission_wait_s: float = Field(
        10.0,
        ge=0,
        description="how long one of them waits at most; also how long a request waits for the worker's first "
        "replica while the service starts (replicas.py)",
    )
    max_surge_percent: int = Field(
        100,
        ge=0,
        le=100,
        description="a `serve deploy` that changes the worker starts this share of its replicas anew before "
        "stopping old ones (Serve's rollout), so the old ones serve until their replacements are up, and keep "
        "serving if those fail to start; the cluster needs room for the extra replicas (else the update waits "
        "for it). 0: stop old replicas first (an outage while the new ones load)",
    )

    @property
    def num_ranks(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def kv_fraction(self) -> float:
        """`gpu_memory_utilization`, or its default for this rank's share of a card."""
        return self.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION * min(1.0, self.num_gpus or 1.0)

    @model_validator(mode="after")
    def _asks_for_something(self):
        if self.num_cpus <= 0 and self.num_gpus <= 0:
            raise ValueError("a worker rank needs num_cpus or num_gpus above 0")
        stage_gpus = self.num_gpus * self.tp_size
        if self.pp_size > 1 and stage_gpus > 1 and stage_gpus != int(stage_gpus):
            raise ValueError(f"a pipeline stage takes whole GPUs: num_gpus x tp_size is {stage_gpus:g}")
        return self


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_name: str = "specdec-smollm2-135m"
    target: ModelSpec = Field(default_factory=ModelSpec)
    draft: Optional[ModelSpec] = DEFAULT_DRAFT
    draft_costs: Optional[DraftCosts] = Field(
        None,
        description="the draft model's prices beside the target, the model drafters' defaults "
        "(specdec_core/calibration/draft_costs.py): `specdec serve` measures them for a CPU pair on its machine; "
        "None: the drafters' built-in ones",
    )
    target_heads: Optional[str] = Field(
        AUTO,
        description="the target's heads (drafters `heads`, `eagle3`): a directory of Medusa or Hydra heads or of "
        "an EAGLE-3 layer, two separated by a comma (heads and a layer), auto (those shipped for the target's "
        "source that fit it as configured: the embedded target's Medusa heads and EAGLE-3 layer), or None",
    )
    tree_banks: list[str] = Field(
        default_factory=list,
        description="tree bank files of `specdec frontier`: requests may name their trees (the server and "
        "the target worker register them)",
    )
    defaults: RequestDefaults = Field(
        default_factory=RequestDefaults, description="policy, drafter and K for requests that leave them out"
    )
    prefix_caching: bool = Field(
        True,
        description="reuse a prompt's full KV blocks computed for an earlier request (vLLM's automatic prefix caching)",
    )
    suffix_cache: SuffixCacheSettings = Field(
        default_factory=SuffixCacheSettings,
        description="the suffix trees that drafters `suffix`, `suffix_tree` and those with `lookup: suffix` read, "
        "one set per draft worker replica, shared by its requests (specdec_core/drafters/suffix_cache.py)",
    )
    max_tokens_limit: Optional[int] = Field(
        None, ge=1, description="a cap on max_tokens; None: a request without one runs to the end of the context"
    )
    max_body_bytes: int = Field(1 << 20, ge=1024)
    replicas: int = Field(1, ge=1)
    server_on_head_node: bool = Field(
        True,
        description="the server replicas run on the head node, beside Serve's HTTP proxy: a lost worker node "
        "never takes one, and the streams in it, along (its own streams end with an error event)",
    )
    graceful_shutdown_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a stopping server replica (a redeploy, a scale-down, SIGTERM to specdec serve) lets its "
        "streams run this long while new requests go to other replicas (or, on SIGTERM, get 503 + Retry-After); "
        "then Serve cuts the streams still running, or a SIGTERM's drain ends them with an error event. The "
        "workers wait for their sessions as long",
    )
    max_ongoing_requests: int = Field(16, ge=1)
    max_queued_requests: int = Field(
        64, ge=-1, description="a replica's queue beyond max_ongoing_requests; past it Serve answers 503 (-1: no bound)"
    )
    draft_worker: WorkerConfig = Field(default_factory=WorkerConfig)
    target_worker: WorkerConfig = Field(default_factory=WorkerConfig)
    draft_on_target_node: bool = Field(
        False, description="run the draft's ranks on the node of the target's rank 0 (else wherever they fit)"
    )
    placement_timeout_s: float = Field(
        120.0, gt=0, description="a draft on the target's node not placed, or a group's rendezvous, fails after this"
    )
    host: str = Field("127.0.0.1", description="every listener binds this address: HTTP, gRPC, both workers")
    api_key: Optional[str] = Field(
        None, repr=False, description="required as `Authorization: Bearer` (HTTP) and `authorization` metadata (gRPC)"
    )
    worker_secret: Optional[str] = Field(
        None,
        repr=False,
        description="workers refuse calls without it; unset: drawn once per cluster and model_name (app.py)",
    )
    http_port: int = Field(8000, ge=0, le=65535)
    grpc_port: int = Field(9000, ge=0, le=65535)
    rpc_deadline_s: float = Field(30.0, gt=0)
    session_idle_timeout_s: float = Field(120.0, gt=0)
    worker_lookup_timeout_s: float = Field(
        0.5,
        gt=0,
        description="the server's background question for a worker's replicas takes this long at most once "
        "it has found some; a health check and a draft lookup wait no longer for a first one (a request "
        "waits up to the target worker's admission_wait_s for its first)",
    )
    torch_threads: Optional[int] = Field(None, ge=1, description="per worker; default: its CPUs")
    calibration: Optional[CalibrationSettings] = Field(
        default_factory=CalibrationSettings,
        description="the target worker measures the target's profile (EASD's tau_h) at load, cached per "
        "model; None: no profile (EASD then needs an explicit tau_h)",
    )

    @model_validator(mode="after")
    def _target_not_int4(self):
        refuse_draft_only_target(self.target)
        return self

    def threads(self, worker: WorkerConfig) -> int:
        """A worker rank's torch threads: its own setting, else the app's, else its CPUs."""
        return worker.torch_threads or self.torch_threads or max(1, int(worker.num_cpus))


def refuse_unfit_heads(config: AppConfig) -> None:
    """Named target heads that do not fit the target as configured (its kept layers, stages,
    hidden size and vocabulary: heads/loading.py) are a config error (ValueError), found before
    any replica starts: a target worker that cannot hold them would fail its start until Serve
    gives up. Heads or a target config not readable on this node (a cluster's head node, the
    files on the GPU nodes) are checked by the target worker as it loads them. Reading the target's
    config converts a GGUF checkpoint first (cached) and asks the hub for a hub id's."""
    directories = [] if config.target_heads == AUTO else named_heads(config.target_heads)
    if not directories:
        return
    try:
        target_config = load_configs(config.target)[0]
    except OSError as error:
        logger.warning("target_heads: the target's config is not readable here (%s); the worker checks them", error)
        return
    target = TargetShape.of_config(target_config, config.target.num_layers, config.target_worker.pp_size)
    for directory in directories:
        if not Path(directory).is_dir():
            logger.warning("target_heads: %s is not on this node; the target worker checks it", directory)
            continue
        try:
            problem = refusal(directory, target)
        except (OSError, ValueError) as error:  # no heads there, or files that are not heads
            problem = f"{directory}: {error}"
        if problem:
            raise ValueError(f"target_heads: {problem}")
