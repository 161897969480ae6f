"""The KV pool (specdec_core/runtime/kv_pool.py): blocks taken as sessions grow, given back on rollback
and when a session ends, a fixed pool that says when it is full, growth that keeps what was
written, a tree's accepted path moved into place, and an FP8 cache."""

from __future__ import annotations

import gc

import pytest
import torch

from specdec_core.runtime.batching import forward_ragged, kv_cache_dtype, set_kv_cache_dtype
from specdec_core.runtime.kv_pool import KVPool, KVPoolExhausted, PagedKV, write
from specdec_core.runtime.model_runner import runner_of

from helpers.tiny_models import tiny_llama


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
        runner_of(model.model).pool = KVPool(num_layers=len(model.model.layers), num_blocks=initial_blocks)
        caches = [PagedKV(), PagedKV()]
        with torch.inference_mode():
            forward_ragged(model, caches, [sequence[:-4] for sequence in sequences])
            hidden, _ = forward_ragged(model, caches, [sequence[-4:] for sequence in sequences])
        outputs.append(hidden)
        assert runner_of(model.model).kv_pool().num_blocks >= initial_blocks
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [None, torch.float8_e4m3fn])
def test_a_trees_path_moves_into_place_and_the_rest_is_dropped(dtype):
    pool = KVPool(num_layers=2, num_blocks=4, block_size=4, dtype=dtype)
    cache = PagedKV()
    cache.reserve(pool, 10)
    keys = torch.arange(10, dtype=torch.float32).view(1, 1, 10, 1)  # [1, kv_heads, N, head_dim]
    for layer in range(2):
        storage, _ = pool.storage(layer, keys)
        write(storage, pool.slots(cache.table, range(10)), keys[0].transpose(0, 1) * (layer + 1))
    cache.advance(10)
    cache.keep_at(4, [4, 6, 9])  # the root (position 4) and the accepted nodes
    assert cache.length == 7 and cache.table == [0, 1]
    for layer in range(2):  # (integers up to 16, even ones to 32: exact in FP8 too)
        kept = pool.keys[layer][pool.slots(cache.table, range(7))].float().flatten().tolist()
        assert kept == [value * (layer + 1) for value in (0, 1, 2, 3, 4, 6, 9)]


def greedy_steps(scorers, prompts, num_tokens: int) -> list[list[int]]:
    """Target-only greedy decoding of every session together, one token per step each."""
    from specdec_core.target.scorer import Row, forward_rows

    lasts, outputs = [prompt[-1] for prompt in prompts], [[] for _ in prompts]
    for _ in range(num_tokens):
        blocks = forward_rows([Row(scorer, [last]) for scorer, last in zip(scorers, lasts)])
        for index, (scorer, block) in enumerate(zip(scorers, blocks)):
            lasts[index] = int(block.logits[-1].argmax())
            scorer.commit(1)
            outputs[index].append(lasts[index])
    return outputs


def test_sessions_sharing_a_prefix_take_its_blocks_and_each_continue_as_alone():
    """The second session of a shared 40-token prefix finds its 2 full blocks cached and prefills
    only the rest; both sessions, open together, continue token for token as each does on a model
    without prefix caching; when they end, every block is back and the prefix stays cached."""
    from specdec_core.api.sampling import SamplingParams
    from specdec_core.policies import make_policy
    from specdec_core.target.scorer import TargetScorer

    shared = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    prompts = [shared + [5, 6, 7], shared + [9, 8]]
    cached, alone = tiny_llama(seed=7), tiny_llama(seed=7)
    runner_of(alone.model).pool = KVPool(len(alone.model.layers), prefix_caching=False)
    expected = []
    for prompt in prompts:
        scorer = TargetScorer(alone)
        scorer.reset(prompt, make_policy("greedy"), SamplingParams())
        assert scorer.prefix_cache_hits == 0
        expected += greedy_steps([scorer], [prompt], 12)
    first, second = TargetScorer(cached), TargetScorer(cached)
    first.reset(prompts[0], make_policy("greedy"), SamplingParams())
    assert (first.prefix_cache_queries, first.prefix_cache_hits) == (42, 0)
    to_prefill = second.start(prompts[1], make_policy("greedy"), SamplingParams())
    assert (second.prefix_cache_queries, second.prefix_cache_hits) == (41, 32) and to_prefill == prompts[1][32:-1]
    assert second.cache.table[:2] == first.cache.table[:2]  # the same blocks, held twice
    second.reset(prompts[1], make_policy("greedy"), SamplingParams())
    assert greedy_steps([first, second], prompts, 12) == expected
    pool = runner_of(cached.model).kv_pool()
    del first, second
    gc.collect()
    assert pool.num_used == 0 and len(pool.idle) >= 2


def test_a_full_pool_evicts_the_least_recently_used_cached_blocks():
    pool = KVPool(num_layers=1, num_blocks=4, growable=False, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    owner = PagedKV()
    assert owner.reuse(pool, tokens) == 0
    owner.reserve(pool, 5)
    owner.advance(5)
    owner.publish(tokens)  # blocks [1, 2] and [3, 4]; the fifth token's block is not full
    assert len(owner.prefix_keys) == 2
    reader = PagedKV()
    assert reader.reuse(pool, tokens) == 4 and reader.table == owner.table[:2]
    owner_table = list(owner.table)
    del owner, reader
    gc.collect()
    assert pool.num_used == 0 and len(pool.idle) == 2
    taker = PagedKV()
    taker.reserve(pool, 6)  # 3 blocks: the two free ones, then the oldest cached one
    assert pool.num_used == 3 and list(pool.published.values()) == [owner_table[1]]
    assert PagedKV().reuse(pool, tokens) == 0  # its first block is gone, so no prefix matches


def test_an_fp8_cache_holds_a_quarter_of_fp32s_bytes_and_scores_close_to_it():
    """The same tiny fp32 target with its cache in fp32 and in FP8 (e4m3, scale 1): 60 scored
    positions after a 40-token prompt differ by under 5% of the logits' norm (measured: about
    1%) and agree on the argmax at 90% of them or more (58 of 60); FP8 saturates, not NaN."""
    from specdec_core.api.sampling import SamplingParams
    from specdec_core.policies import make_policy
    from specdec_core.target.scorer import TargetScorer

    exact, fp8 = tiny_llama(seed=5), tiny_llama(seed=5)
    set_kv_cache_dtype(fp8, "fp8")
    assert kv_cache_dtype(exact) == torch.float32 and kv_cache_dtype(fp8) == torch.float8_e4m3fn
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, exact.config.vocab_size, (40,), generator=generator).tolist()
    blocks = torch.randint(0, exact.config.vocab_size, (10, 5), generator=generator).tolist()
    logits = {}
    for name, model in (("exact", exact), ("fp8", fp8)):
        scorer = TargetScorer(model)
        scorer.reset(prompt, make_policy("greedy"), SamplingParams())
        rows, last = [], prompt[-1]
        for block in blocks:  # each block's first token kept: the cache grows by a token a step
            rows.append(scorer.score([last, *block]).logits)
            scorer.commit(2)
            last = block[1]
        logits[name] = torch.cat(rows)  # [50, V]
    # several sessions in one forward (a gather of their blocks, not a view) score as alone
    from specdec_core.target.scorer import Row, forward_rows

    together = [TargetScorer(fp8) for _ in range(2)]
    for scorer, head in zip(together, (prompt, prompt[::-1])):
        scorer.reset(head, make_policy("greedy"), SamplingParams())
    both = forward_rows([Row(scorer, [head[-1], *blocks[0]]) for scorer, head in zip(together, (prompt, prompt[::-1]))])
    torch.testing.assert_close(both[0].logits, logits["fp8"][:6], rtol=0, atol=1e-5)
    fp8_keys, exact_keys = runner_of(fp8.model).kv_pool().keys, runner_of(exact.model).kv_pool().keys
    assert fp8_keys.dtype == torch.float8_e4m3fn and exact_keys.element_size() == 4 * fp8_keys.element_size()
    error = (logits["fp8"] - logits["exact"]).norm() / logits["exact"].norm()
    agreement = (logits["fp8"].argmax(-1) == logits["exact"].argmax(-1)).float().mean()
    assert error < 0.05 and agreement >= 0.9, (error, agreement)
    storage = torch.zeros(4, 1, 1, dtype=torch.float8_e4m3fn)
    write(storage, torch.tensor([0, 1, 3]), torch.tensor([1000.0, -1000.0, 1.0])[:, None, None])
    assert storage.float().flatten().tolist() == [448.0, -448.0, 0.0, 1.0]
