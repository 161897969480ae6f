"""Many sessions in one forward (specdec_core/runtime/batching.py, target.forward_rows): each row's
logits equal its own unbatched forward, through prompt chunks and rejections of different
lengths in the same step."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdec_core.api.sampling import SamplingParams
from specdec_core.policies import make_policy
from specdec_core.runtime.batching import padded_size
from specdec_core.runtime.compiled_step import pad_steps
from specdec_core.target.scorer import Row, TargetScorer, forward_rows

from helpers.tiny_models import repeating_prompt, tiny_llama, tiny_profile


@torch.inference_mode()
def plain_logits(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' own forward over the whole sequence (no cache), fp32 logits `[T, V]`."""
    return model(torch.tensor([token_ids])).logits[0].float()


def started(model, prompt: list[int]) -> TargetScorer:
    scorer = TargetScorer(model)
    scorer.start(prompt, make_policy("greedy"), SamplingParams())
    return scorer


@pytest.mark.parametrize("padded", [False, True])
def test_each_row_of_a_ragged_step_scores_as_it_would_alone(padded: bool):
    """`padded`: every size of the step padded (pad_steps, as a compiled step is): the padding
    rows, queries, keys and tokens change no real row's logits."""
    model = tiny_llama(seed=3)
    if padded:
        pad_steps(model)
    generator = torch.Generator().manual_seed(0)

    def random_tokens(count: int) -> list[int]:
        return torch.randint(0, model.config.vocab_size, (count,), generator=generator).tolist()

    prompts = [random_tokens(length) for length in (5, 23, 9, 2)]
    scorers = [started(model, prompt) for prompt in prompts]
    # prompts prefilled in chunks of 7 beside each other; one prompt still prefilling while the
    # others score their first blocks
    step = 7
    while any(scorer.committed_len < len(prompt) - 1 for scorer, prompt in zip(scorers, prompts)):
        forward_rows(
            [
                Row(scorer, prompt[scorer.committed_len : min(scorer.committed_len + step, len(prompt) - 1)], True)
                for scorer, prompt in zip(scorers, prompts)
                if scorer.committed_len < len(prompt) - 1
            ]
        )
    committed = [list(prompt[:-1]) for prompt in prompts]
    lasts = [prompt[-1] for prompt in prompts]
    for draft_counts, keeps in (((4, 1, 7, 0), (2, 0, 8, 1)), ((3, 6, 2, 5), (4, 7, 0, 2))):
        drafts = [random_tokens(count) for count in draft_counts]
        blocks = forward_rows([Row(scorer, [last, *draft]) for scorer, last, draft in zip(scorers, lasts, drafts)])
        for block, history, last, draft in zip(blocks, committed, lasts, drafts):
            reference = plain_logits(model, [*history, last, *draft])[len(history) :]
            torch.testing.assert_close(block.logits, reference, atol=1e-5, rtol=0)
        # rejections of different lengths in the same step: keep the last token and `keep - 1` drafts
        for index, (scorer, keep) in enumerate(zip(scorers, keeps)):
            block_tokens = [lasts[index], *drafts[index]]
            keep = min(keep, len(block_tokens))
            scorer.commit(keep)
            committed[index] += block_tokens[:keep]
            lasts[index] = random_tokens(1)[0] if keep == len(block_tokens) else block_tokens[keep]

    # a row alone and the same row beside another: bitwise equal
    alone, batched, other = (TargetScorer(model) for _ in range(3))
    for scorer, prompt in ((alone, prompts[1]), (batched, prompts[1]), (other, prompts[0])):
        scorer.reset(prompt, make_policy("greedy"), SamplingParams())
    block = [prompts[1][-1], *random_tokens(5)]
    by_itself = alone.score(block)
    beside = forward_rows([Row(other, [prompts[0][-1], *random_tokens(3)]), Row(batched, block)])[1]
    assert torch.equal(by_itself.logits, beside.logits)


@pytest.mark.parametrize("padded", [False, True])
def test_a_long_prompt_chunk_attends_apart_and_every_row_scores_as_alone(padded: bool):
    """A step holding a prompt chunk longer than LONG_ROW beside short verify rows makes two
    attention calls per layer (the short rows are not padded to the chunk); each verify row's
    logits are those of its step alone, and the chunk's prompt continues as unbatched; the same
    with the step's sizes padded (its calls then have 8 and 128 queries)."""
    from specdec_core.runtime.ragged_attention import LONG_ROW

    model = tiny_llama(seed=4)
    if padded:
        pad_steps(model)
    generator = torch.Generator().manual_seed(3)
    long_prompt = torch.randint(0, 512, (LONG_ROW + 40,), generator=generator).tolist()
    prompts = [torch.randint(0, 512, (length,), generator=generator).tolist() for length in (9, 30)]
    blocks = [torch.randint(0, 512, (5,), generator=generator).tolist() for _ in prompts]
    alone = []
    for prompt, block in zip(prompts, blocks):
        scorer = TargetScorer(model)
        scorer.reset(prompt, make_policy("greedy"), SamplingParams())
        alone.append(scorer.score(block).logits)
    scorers = [TargetScorer(model) for _ in range(3)]
    for scorer, prompt in zip(scorers, prompts):
        scorer.reset(prompt, make_policy("greedy"), SamplingParams())
    scorers[2].start(long_prompt, make_policy("greedy"), SamplingParams())
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = lambda *a, **k: calls.append(a[0].shape) or original(*a, **k)
    try:
        chunk = Row(scorers[2], long_prompt[:-1], prefill=True)
        got = forward_rows([Row(scorers[0], blocks[0]), chunk, Row(scorers[1], blocks[1])])
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    queries = {padded_size(5), padded_size(LONG_ROW + 39)} if padded else {5, LONG_ROW + 39}
    assert len(calls) == 2 * model.config.num_hidden_layers and {shape[2] for shape in calls} == queries
    for block, logits in zip((got[0], got[2]), alone):
        torch.testing.assert_close(block.logits, logits, atol=1e-5, rtol=0)
    last = scorers[2].score(long_prompt[-1:]).logits
    torch.testing.assert_close(last, plain_logits(model, long_prompt)[-1:], atol=1e-5, rtol=0)


def test_proposals_in_lockstep_equal_each_proposal_alone():
    """Draft proposals of sessions with different prompts, drafters, block lengths and sampling
    run together (one ragged forward per round, rows of one int4 draft on different kernels by
    their own chunk's length) come out bitwise as each alone, over two steps with commits."""
    from specdec_core.drafters import make_drafter
    from specdec_core.drafters.draft_rounds import propose_together
    from specdec_core.models.kernels.chunked import CHUNK_LENGTHS, ChunkedLinear, kernel_for
    from specdec_core.models.kernels.int4 import quantize_int4

    model = tiny_llama(seed=5).to(torch.bfloat16)
    table = ((1, "int4"), (4, "fp32"), (12, "int4"), (256, "bf16"))  # three kernels by chunk length
    quantize_int4(model, lambda linear, candidates: tuple(entry for entry in table if entry[1] in candidates))
    generator = torch.Generator().manual_seed(1)
    repeated = torch.randint(0, 512, (6,), generator=generator).tolist()
    # the mla sessions' prompts repeat a phrase, so their lookup guesses make long checks
    prompts = [repeated * 4, torch.randint(0, 512, (9,), generator=generator).tolist(), repeated * 3, [7]]
    setups = [
        ("mla", SamplingParams(), 15),
        ("model", SamplingParams(temperature=0.9, seed=3), 5),
        ("mla", SamplingParams(temperature=0.9, seed=4), 12),
        ("model", SamplingParams(), 0),
    ]

    def sessions():
        drafters = []
        for prompt, (name, sampling, _) in zip(prompts, setups):
            params = {"adaptive": False, **({"max_ngram": 2} if name == "mla" else {})}
            drafters.append(make_drafter(name, params, model))
            drafters[-1].reset(prompt, sampling)
        return drafters

    alone, together = sessions(), sessions()
    chunk_lengths = []  # what the first chunked linear was told in each forward
    first_chunked = next(module for module in model.modules() if isinstance(module, ChunkedLinear))
    first_chunked.register_forward_hook(lambda *_: chunk_lengths.append(CHUNK_LENGTHS.get()))
    for step in range(2):
        expected = [drafter.propose(max_tokens) for drafter, (_, _, max_tokens) in zip(alone, setups)]
        blocks = propose_together(
            model, [drafter.drafting(max_tokens) for drafter, (_, _, max_tokens) in zip(together, setups)]
        )
        for got, want in zip(blocks, expected):
            assert torch.equal(got.tokens, want.tokens)
            for name in ("logits", "token_probs"):
                assert (getattr(got, name) is None) == (getattr(want, name) is None)
                if getattr(want, name) is not None:
                    assert torch.equal(getattr(got, name), getattr(want, name))
        assert blocks[3].num_tokens == 0 and blocks[0].num_tokens > 1
        for drafter_pair, block in zip(zip(alone, together), expected):
            committed = [*block.tokens[:2].tolist(), 11 + step]  # two drafts kept, then a correction
            for drafter in drafter_pair:
                drafter.commit(committed)
    # some forward ran rows on several kernels (a prompt beside draft steps)
    assert any(lengths and len({kernel_for(table, n) for n in lengths}) > 1 for lengths in chunk_lengths)


def test_a_compiled_step_captures_without_breaks_and_decodes_as_eager(monkeypatch):
    """compile_step: every step of target-only and speculative decoding, one session or three
    (one with a prompt longer than LONG_ROW: two row groups), runs in dynamo's graphs with no
    break, in a few graphs, and gives the eager model's tokens (dynamo's capture alone, backend
    "eager", so the numbers are the same; inductor's code is what `specdec compile-check --time`
    measures). Its steps' tensors take a few shapes, each size a padded one (CUDA graphs are
    recorded per shape), where the eager steps' shapes change nearly every step."""
    from torch._dynamo.utils import counters

    from specdec_core import GenerationRequest, SpeculativeEngine
    from specdec_core.loop.lockstep import complete_together
    from specdec_core.runtime import batching
    from specdec_core.runtime.compiled_step import compile_step
    from specdec_core.runtime.ragged_attention import LONG_ROW

    shapes = {False: [], True: []}  # padded or not: each step's tensor sizes

    def recording_layout(*args, padded=False, **others):
        layout = laid_out(*args, padded=padded, **others)
        tensors = [layout.write_slots, *(t for group in layout.groups for t in (group.read, group.mask))]
        shapes[padded].append(tuple(size for tensor in tensors if torch.is_tensor(tensor) for size in tensor.shape))
        return layout

    laid_out = batching.step_layout
    monkeypatch.setattr(batching, "step_layout", recording_layout)

    def requests(drafter: str) -> list[GenerationRequest]:
        prompts = [repeating_prompt(seed, length) for seed, length in ((1, 12), (2, LONG_ROW + 20), (3, 30))]
        return [
            GenerationRequest(
                prompt_ids=prompt, drafter={"name": drafter}, num_draft_tokens=4, sampling={"max_tokens": 12}
            )
            for prompt in prompts
        ]

    eager = SpeculativeEngine(tiny_llama(seed=3), None, None, profile=lambda *_: tiny_profile())
    compiled_target = tiny_llama(seed=3)
    compile_step(compiled_target, backend="eager")
    compiled = SpeculativeEngine(compiled_target, None, None, profile=lambda *_: tiny_profile())
    torch._dynamo.reset()
    counters.clear()
    for drafter in ("none", "pld"):
        expected = [completion.token_ids for completion in complete_together(eager, requests(drafter))]
        assert [completion.token_ids for completion in complete_together(compiled, requests(drafter))] == expected
        assert compiled.complete(requests(drafter)[0]).token_ids == expected[0]
    assert not counters["graph_break"]
    assert 1 <= counters["stats"]["unique_graphs"] <= 12
    assert all(padded_size(size) == size for step in shapes[True] for size in step)
    assert len(set(shapes[True])) < len(set(shapes[False]))  # 15 against 23 when written


def test_sizes_pad_to_powers_of_two_then_to_multiples_of_the_step():
    from specdec_core.runtime.batching import PAD_STEP

    assert [padded_size(size) for size in (1, 2, 3, 5, 64, 65, PAD_STEP)] == [1, 2, 4, 8, 64, 128, PAD_STEP]
    assert [padded_size(size) for size in (PAD_STEP + 1, 3 * PAD_STEP - 7)] == [2 * PAD_STEP, 3 * PAD_STEP]


@pytest.mark.parametrize("padded", [False, True])
def test_the_paged_layout_writes_where_sdpas_does_and_describes_each_row(padded: bool):
    """paged_layout.py builds its tensors from plain integers; against SDPA's layout of the same
    step (built by gathers over the block tables): the same write slots, padding included; and
    each row's keys, blocks, start and view of its new tokens (a chain's causal, a tree's its
    mask), the padding tokens a row of no keys."""
    from specdec_core.runtime.batching import step_layout
    from specdec_core.runtime.kv_pool import BLOCK_SIZE, KVPool, PagedKV
    from specdec_core.trees.topologies import default_bank

    pool = KVPool(num_layers=1, num_blocks=64, growable=False)
    tree = default_bank().limited("mc_sim_7b_63", 2)
    histories, lengths = [3, BLOCK_SIZE - 1, 40, 0], [5, 2, tree.num_nodes + 1, 1]
    trees = [None, None, tree, None]
    caches = []
    for history in histories:
        cache = PagedKV()
        cache.reserve(pool, history)
        cache.advance(history)
        caches.append(cache)
    layouts = [step_layout(pool, caches, lengths, trees, "cpu", padded=padded, paged=paged) for paged in (False, True)]
    sdpa, paged = layouts
    assert torch.equal(paged.write_slots, sdpa.write_slots)
    rows = paged.paged
    pad = padded_size if padded else int
    assert rows.seq_lens[:4].tolist() == [h + n for h, n in zip(histories, lengths)] and not rows.seq_lens[4:].any()
    for row, cache in enumerate(caches):
        assert rows.block_tables[row, : len(cache.table)].tolist() == cache.table
    counts = lengths + ([pad(sum(lengths)) - sum(lengths)] if padded else [])
    assert rows.query_start.tolist()[: len(counts) + 1] == [0, *itertools.accumulate(counts)]
    assert rows.new_mask.shape == (pad(sum(lengths)), pad(max(lengths)))
    start = sum(lengths[:2])
    assert torch.equal(rows.new_mask[:5, :5].bool(), torch.ones(5, 5).tril().bool())
    assert torch.equal(rows.new_mask[start : start + lengths[2], : lengths[2]].bool(), tree.attention_mask)


def test_a_padded_paged_layouts_block_tables_widen_only_as_the_context_doubles():
    """A graphed step's block tables are a power of two blocks wide (a graph a width): one
    session's context from 1 to 4,096 positions meets 9 widths, where its keys' 1,024-token buckets
    would add one for each 1,024 more. Each row lists its blocks, then block 0."""
    from specdec_core.runtime.batching import step_layout
    from specdec_core.runtime.kv_pool import BLOCK_SIZE, KVPool, PagedKV

    pool = KVPool(num_layers=1, num_blocks=300, growable=False)
    growing, short = PagedKV(), PagedKV()
    short.reserve(pool, 3)
    short.advance(3)
    widths = set()
    for length in range(1, 4096, 13):
        growing.reserve(pool, length)
        growing.advance(length - growing.length)
        tables = step_layout(pool, [growing, short], [1, 1], [None, None], "cpu", padded=True, paged=True)
        tables = tables.paged.block_tables  # [B_p, blocks]
        widths.add(tables.shape[1])
        assert tables.shape[1] >= -(-(length + 1) // BLOCK_SIZE)
        for row, cache in enumerate((growing, short)):
            assert tables[row].tolist() == cache.table + [0] * (tables.shape[1] - len(cache.table))
        assert not tables[2:].any()
    assert widths == {1 << power for power in range(9)}
