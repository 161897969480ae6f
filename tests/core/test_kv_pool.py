"""The KV pool (specdec_core/kv_pool.py): blocks taken as sessions grow, given back on rollback
and when a session ends, a fixed pool that says when it is full, growth that keeps what was
written, and a tree's accepted path moved into place."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import tiny_llama

from specdec_core.batching import forward_ragged, pool_of
from specdec_core.kv_pool import KVPool, KVPoolExhausted, PagedKV


def test_sessions_take_blocks_as_they_grow_and_give_them_back():
    pool = KVPool(num_layers=1, num_blocks=8, block_size=4)
    first, second = PagedKV(), PagedKV(reserve_positions=9)
    first.reserve(pool, 5)  # 2 blocks
    second.reserve(pool, 1)  # its reservation: 3 blocks
    assert first.table == [0, 1] and second.table == [2, 3, 4] and pool.num_used == 5
    first.advance(5)
    first.reserve(pool, 13)  # grows to 4 blocks, the lowest free ones
    assert first.table == [0, 1, 5, 6]
    first.crop(4)  # a rollback frees whole blocks past the positions kept
    assert first.length == 4 and first.table == [0] and pool.num_used == 4
    second.crop(0)  # a reservation stays with its session
    assert second.table == [2, 3, 4]
    del first, second
    gc.collect()
    assert pool.num_used == 0 and pool.free == list(range(8))


def test_a_fixed_pool_says_it_is_full_and_a_growable_one_doubles():
    fixed = KVPool(num_layers=1, num_blocks=2, growable=False, block_size=4)
    with pytest.raises(KVPoolExhausted, match="3 blocks wanted, 2 free"):
        PagedKV().reserve(fixed, 9)
    growable = KVPool(num_layers=1, num_blocks=2, block_size=4)
    cache = PagedKV()
    cache.reserve(growable, 17)
    assert growable.num_blocks == 5 and cache.table == [0, 1, 2, 3, 4]


def test_steps_over_a_pool_that_grows_score_as_over_a_large_one():
    """Growth copies the pool between forwards: what each session wrote is still there."""
    model = tiny_llama(seed=5)
    sequences = [list(range(3, 40)), list(range(50, 61))]
    outputs = []
    for initial_blocks in (1, 64):
        model.model.kv_pool = KVPool(num_layers=len(model.model.layers), num_blocks=initial_blocks)
        caches = [PagedKV(), PagedKV()]
        with torch.inference_mode():
            forward_ragged(model, caches, [sequence[:-4] for sequence in sequences])
            hidden, _ = forward_ragged(model, caches, [sequence[-4:] for sequence in sequences])
        outputs.append(hidden)
        assert pool_of(model.model).num_blocks >= initial_blocks
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)


def test_a_trees_path_moves_into_place_and_the_rest_is_dropped():
    pool = KVPool(num_layers=2, num_blocks=4, block_size=4)
    cache = PagedKV()
    cache.reserve(pool, 10)
    keys = torch.arange(10, dtype=torch.float32).view(1, 1, 10, 1)  # [1, kv_heads, N, head_dim]
    for layer in range(2):
        stored, _ = pool.storage(layer, keys)
        stored[pool.slots(cache.table, range(10))] = keys[0].transpose(0, 1) + 100 * layer
    cache.advance(10)
    cache.keep_at(4, [4, 6, 9])  # the root (position 4) and the accepted nodes
    assert cache.length == 7 and cache.table == [0, 1]
    for layer in range(2):
        kept = pool.keys[layer][pool.slots(cache.table, range(7))].flatten().tolist()
        assert kept == [value + 100 * layer for value in (0, 1, 2, 3, 4, 6, 9)]
