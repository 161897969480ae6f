"""Tensor parallelism for a model: the ranks of one torch.distributed process group each hold a
shard, and every forward runs on all of them at once.

Rendezvous: rank 0 opens a `TCPStore` on a free port (`open_store`) and publishes its address;
every rank joins with it (`join_group`); `run_local_ranks` runs a group as processes of this
machine (the measurement commands and the tests). Backends, one interface (`load_sharded_model`):
- "transformers": transformers' own tensor parallelism (`tp_plan="auto"`): each rank reads only
  its shard of the checkpoint's weights (meta-device init), so a model too large for one host
  never materializes whole. The default.
- "deepspeed": DeepSpeed AutoTP (`deepspeed.init_inference(tensor_parallel=...)`) over a full copy
  loaded on every rank first. Its JIT-built shared-memory all-reduce (`deepspeed_shm_comm_op`)
  segfaults on CPU (seen with DeepSpeed 0.19.8 on an AVX-512 Zen 4 VM), so on CPU it is not built
  and DeepSpeed all-reduces over the plain process group.
A model splits over `tp` ranks when its query and KV heads are both divisible by `tp`. With
pipeline stages (pipeline.py), or an FP8 checkpoint, each rank reads its part itself
(shard_loader.py) and transformers' tensor-parallel forwards run over its stage's ranks."""

from __future__ import annotations

import gc
import os
import queue
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from ..planning.memory import shard_problem
from ..runtime.batching import set_kv_cache_dtype
from ..runtime.compiled_step import compile_step
from ..runtime.model_runner import runner_of
from .fp8_checkpoint import checkpoint_fp8_scheme
from .loader import DTYPES, ModelSpec, truncate_layers, use_step_settings
from .pipeline import make_stage, stage_layers
from .shard_loader import load_shard
from .sources import resolve_source

TpBackend = Literal["transformers", "deepspeed"]


def open_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port of `host` (`.port` tells which)."""
    return dist.TCPStore(
        host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


def join_group(rank: int, world_size: int, store_host: str, store_port: int, timeout_s: float, store=None):
    """Join the process group (NCCL on GPUs, gloo on CPU); returns a gloo group over the same ranks
    for small control messages on the host (the world group itself on CPU)."""
    if store is None:
        store = dist.TCPStore(store_host, store_port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # transformers' own tensor parallelism sizes its mesh and binds its device from the launcher's
    # variables (some versions from WORLD_SIZE alone): this rank's, its device the one it runs on
    local_rank = torch.cuda.current_device() if torch.cuda.is_available() else 0
    for name, value in (("RANK", rank), ("WORLD_SIZE", world_size), ("LOCAL_RANK", local_rank)):
        os.environ[name] = str(value)  # not a default: a process may join a group again, or spawn ranks
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    return dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


def leave_group(*models: torch.nn.Module) -> None:
    """Destroy the process group, `models`' CUDA graphs first: NCCL's teardown waits for every graph
    that captured one of its collectives to be freed (pytorch#115388)."""
    for model in models:
        runner_of(model.model).drop_graphs()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.destroy_process_group()


def run_local_ranks(world_size: int, main: Callable[..., Any], *args: Any, timeout_s: float = 600) -> list:
    """`main(rank, world_size, store_port, *args)` in `world_size` processes of this machine
    (spawned, each with its own torch), every rank joining with the store hosted here
    (`join_group`); each rank's return value, in rank order. Where a rank fails, the others
    (blocked on it in a collective) are killed and RuntimeError says which."""
    store = open_store("127.0.0.1", world_size, timeout_s)
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=report_rank, args=(results, main, rank, world_size, store.port, *args))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes, deadline = {}, time.monotonic() + timeout_s
    while len(outcomes) < world_size:
        try:
            rank, outcome = results.get(timeout=1)
            outcomes[rank] = outcome
        except queue.Empty:
            failed = {rank: process.exitcode for rank, process in enumerate(processes) if process.exitcode}
            if failed or time.monotonic() > deadline:
                for process in processes:
                    process.kill()
                raise RuntimeError(f"ranks failed (exit codes by rank {failed}) or ran past {timeout_s:g} s") from None
    for process in processes:
        process.join()
    failed = {rank: process.exitcode for rank, process in enumerate(processes) if process.exitcode}
    if failed:
        raise RuntimeError(f"ranks failed after answering: exit codes by rank {failed}")
    return [outcomes[rank] for rank in range(world_size)]


def report_rank(results, main: Callable[..., Any], rank: int, *args: Any) -> None:
    """A spawned rank of `run_local_ranks`: its return value, with its rank, to the parent."""
    results.put((rank, main(rank, *args)))


def load_sharded_model(spec: ModelSpec, backend: TpBackend, pp_size: int = 1) -> torch.nn.Module:
    """This rank's shard of `spec`'s model over the initialized process group: `pp_size`
    pipeline stages (pipeline.py) of world / pp_size tensor-parallel ranks. A pipeline's stages,
    and an FP8 checkpoint, are read by shard_loader.py whatever the backend (transformers' FP8
    quantizers need FBGEMM's GPU kernels)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if spec.dtype == "int4":
        raise ValueError("int4 is a CPU kernel for single-process models; a sharded model takes bf16, fp16 or fp32")
    if spec.compile_layers:  # a layer's collectives inside dynamo's graphs: not yet tested
        raise ValueError("compile_layers is for single-process models; a sharded model takes compile or neither")
    source = resolve_source(spec.source)
    tp = dist.get_world_size() // pp_size
    config = AutoConfig.from_pretrained(source)
    problem = shard_problem(config, tp)
    if problem:
        raise ValueError(problem)
    dtype = DTYPES[spec.dtype]
    if pp_size > 1 or checkpoint_fp8_scheme(source) is not None:
        stage = dist.get_rank() // tp
        layers = stage_layers(spec.num_layers or config.num_hidden_layers, stage, pp_size)
        mesh = init_device_mesh(spec.torch_device.type, (pp_size, tp), mesh_dim_names=("pp", "tp")) if tp > 1 else None
        tp_mesh = mesh["tp"] if mesh is not None else None
        model = load_shard(source, dtype, spec.torch_device, layers, tp_mesh, spec.num_layers)
        if pp_size > 1:
            make_stage(model, stage, pp_size, tp)
    else:
        if backend == "transformers":
            # a group of one shards nothing: loaded onto its device as a single model
            placement = {"tp_plan": "auto"} if tp > 1 else {"device_map": spec.torch_device}
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **placement)
        else:
            model = deepspeed_autotp(AutoModelForCausalLM.from_pretrained(source, dtype=dtype), tp, dtype)
        if spec.num_layers is not None:
            truncate_layers(model, spec.num_layers)
    set_kv_cache_dtype(model, spec.kv_cache_dtype)
    runner_of(model.model).tp_ranks = tp
    if spec.compile:
        compile_step(model)
    else:
        use_step_settings(model, spec)
    return model.eval()


def deepspeed_autotp(model: torch.nn.Module, tp: int, dtype: torch.dtype) -> torch.nn.Module:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 - inside deepspeed.comm the name `torch` is torch itself

    if not torch.cuda.is_available():
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    engine = deepspeed.init_inference(
        model, tensor_parallel={"tp_size": tp}, dtype=dtype, replace_with_kernel_inject=False
    )
    return engine.module
