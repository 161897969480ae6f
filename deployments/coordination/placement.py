"""Where a worker's ranks run: one placement group per worker (a bundle per rank or per stage),
ready within a bounded time or an error that says what was asked and what the cluster has."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from ..config import WorkerConfig


def bundles(worker: WorkerConfig) -> list[dict[str, float]]:
    """One bundle a rank, or with pipeline stages one a stage holding its ranks' resources (a
    bundle is on one node, so a stage's tensor-parallel collectives never leave it; the strategy
    places the stages). A stage's GPUs are whole (WorkerConfig checks), as Ray wants a bundle's."""
    rank = {"CPU": worker.num_cpus, "GPU": worker.num_gpus, **worker.resources}
    ranks_a_bundle, count = (1, worker.tp_size) if worker.pp_size == 1 else (worker.tp_size, worker.pp_size)
    return [{key: value * ranks_a_bundle for key, value in rank.items() if value > 0}] * count


def bundle_index(worker: WorkerConfig, rank: int) -> int:
    """The bundle of a worker's `rank` (rank = stage * tp_size + tp rank)."""
    return rank if worker.pp_size == 1 else rank // worker.tp_size


def cluster_description() -> str:
    """What each alive node offers (its total resources), one line per node."""
    lines = []
    for node in ray.nodes():
        if node.get("Alive"):
            resources = {
                key: value
                for key, value in node["Resources"].items()
                if not key.startswith("node:") and key not in ("memory", "object_store_memory")
            }
            lines.append(f"  node {node['NodeManagerAddress']}: {resources}")
    return "\n".join(lines) or "  (no alive nodes)"


def reserve(name: str, worker: WorkerConfig, timeout_s: float) -> PlacementGroup:
    """A ready placement group for `worker`'s ranks; raises RuntimeError after `timeout_s`."""
    group = placement_group(bundles(worker), strategy=worker.placement_strategy, name=name)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"cannot place {name}: asked for {len(bundles(worker))} bundle(s) of {bundles(worker)[0]} "
            f"({worker.placement_strategy}) and none was ready within {timeout_s:g} s; the cluster has:\n"
            + cluster_description()
        )
    return group
