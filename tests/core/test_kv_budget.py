"""kv_budget.py: a rank's KV bytes from kv_budget_mb or from a fraction of its GPU (CUDA parts in
test_gpu.py); the serving config's default fraction per share of a card."""

from __future__ import annotations

import gc

import pytest

from deployments.config import WorkerConfig
from specdec_core.api.errors import SpecdecError
from specdec_core.planning.kv_budget import kv_budget, kv_budget_from_fraction, profile_step
from specdec_core.planning.memory import GIB
from specdec_core.runtime.model_runner import runner_of

from helpers.tiny_models import tiny_llama


def test_the_pool_gets_the_fraction_less_the_step_peak_and_what_others_hold():
    assert kv_budget_from_fraction(80 * GIB, 0.9, peak_reserved=20 * GIB, others=1 * GIB) == pytest.approx(51 * GIB)


def test_cuda_graphs_own_pool_comes_out_of_the_budget():
    budget = kv_budget_from_fraction(80 * GIB, 0.9, peak_reserved=20 * GIB, others=1 * GIB, graph_pool=2 * GIB)
    assert budget == pytest.approx(49 * GIB)
    with pytest.raises(SpecdecError, match=r"take 30.0 GiB, CUDA graphs 4.0 GiB and others hold 0.5 GiB"):
        kv_budget_from_fraction(80 * GIB, 0.42, peak_reserved=30 * GIB, others=0.5 * GIB, graph_pool=4 * GIB)


def test_a_fraction_that_leaves_nothing_for_the_kv_cache_is_refused_with_the_numbers():
    with pytest.raises(SpecdecError, match=r"gpu_memory_utilization 0.3 of 80.0 GiB .* take 30.0 GiB"):
        kv_budget_from_fraction(80 * GIB, 0.3, peak_reserved=30 * GIB, others=0.5 * GIB)


def test_a_byte_budget_wins_and_a_cpu_pool_without_one_grows():
    model = tiny_llama(seed=0)
    assert kv_budget(model, 3.0, utilization=0.9, profile_tokens=64) == 3 * 2**20
    assert kv_budget(model, None, utilization=0.9, profile_tokens=64) is None


def test_the_profiled_step_gives_its_blocks_back():
    model = tiny_llama(seed=0)
    profile_step(model, 40)
    gc.collect()
    assert runner_of(model.model).kv_pool().num_used == 0


@pytest.mark.parametrize(
    "settings, fraction",
    [
        ({}, 0.9),
        ({"num_gpus": 1}, 0.9),
        ({"num_gpus": 0.5}, 0.45),
        ({"num_gpus": 0.5, "gpu_memory_utilization": 0.7}, 0.7),
    ],
)
def test_workers_sharing_a_card_split_the_default_fraction(settings, fraction):
    assert WorkerConfig(**settings).kv_fraction == pytest.approx(fraction)
