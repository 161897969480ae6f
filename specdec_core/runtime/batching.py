"""One forward over many sequences: each row brings its own new tokens, KV history and positions
(a ragged batch, packed into one `[1, N]` sequence with no padding). Linears, norms and the LM
head see N rows; attention runs over the model's KV pool (kv_pool.py) in at most two calls per
layer, whatever the number of rows: one for the short rows (verify blocks, trees, single
tokens) and one for the long ones (prompt chunks), so that no short row is padded to a chunk's
length. The step's new entries go into the pool with one write; a group's rows' histories come
back padded to its longest, `[B, L]`, with one gather (a view for a lone row whose blocks are
consecutive), and a mask built once per forward says what each query sees. A padded key is
masked, so it adds an exact zero: a row's result does not depend on its batch companions beyond
the kernels' own blocking (the CPU linears are batch invariant, see docs/architecture.md). The
attention itself is ragged_attention.py's. A pipeline stage's step (pipeline.py) runs its rows
as a few micro-batches, each laid out on its own, so that the stages work at the same time.

A row may also be a candidate tree (tree.py): its tokens are the tree's root and nodes, each at
position history + its depth, each seeing the history and its own ancestors only.

Vocabulary: B rows, N new tokens in all (row b has T_b of them after H_b cached ones), Q the
most new tokens of a row, L the longest row (H_b + T_b)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..models.kernels.chunked import kernels_by_chunk
from ..models.shard_loader import activation_dtype
from ..trees.tree import Topology
from .kv_pool import BLOCK_SIZE, KV_CACHE_DTYPES, KVPool, PagedKV, blocks_for
from .model_runner import runner_of
from .paged_layout import host_tensor, paged_layout
from .ragged_attention import (
    LONG_ROW,
    RowGroup,
    StepLayout,
    attention_backends,
    mask_made,
    on_device,
    use_ragged_attention,
)

# a compiled step's sizes round up to powers of two below this, to multiples of it above
PAD_STEP = 1024


def padded_size(size: int) -> int:
    """What a compiled step pads a size to (its tokens, a group's rows, queries and keys): a power
    of two up to PAD_STEP, then a multiple of it, each at most twice the work below PAD_STEP and
    PAD_STEP - 1 more above. A CUDA graph is recorded per combination of the sizes' buckets: a
    bounded set, which grows by one bucket of keys per PAD_STEP tokens of context."""
    if size <= PAD_STEP:
        return 1 << max(size - 1, 0).bit_length()
    return blocks_for(size, PAD_STEP) * PAD_STEP


def set_kv_cache_dtype(model: torch.nn.Module, name: str) -> None:
    """Keep `model`'s KV cache in the dtype a model spec names (`KV_CACHE_DTYPES`), from its
    pool's first allocation on."""
    runner_of(model.model).kv_dtype = KV_CACHE_DTYPES[name]


def kv_cache_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype `model`'s KV pool holds: its spec's, or its activations'."""
    return runner_of(model.model).kv_dtype or activation_dtype(model)


def fix_pool(model: torch.nn.Module, budget_bytes: float, bytes_per_token: float) -> KVPool:
    """Give `model` a pool of `budget_bytes`, allocated once and never grown: a worker's KV
    budget, within which its admission keeps every session's blocks (`bytes_per_token`: what a
    position costs in all layers of this rank; the pool's scratch block is one more)."""
    num_blocks = int(budget_bytes // (bytes_per_token * BLOCK_SIZE))
    runner = runner_of(model.model)
    runner.pool = KVPool(len(model.model.layers), num_blocks=num_blocks, growable=False, dtype=runner.kv_dtype)
    return runner.pool


def step_layout(
    pool: KVPool,
    caches: Sequence[PagedKV],
    lengths: Sequence[int],
    trees: Sequence[Optional[Topology]],
    device,
    padded: bool = False,
    paged: bool = False,
    ahead: int = 0,
) -> StepLayout:
    """Reserve each row's blocks for its new tokens and lay out the step (host-side, a few ops
    per forward, not per layer). A lone row whose blocks are consecutive reads them as a slice.
    `padded` (a compiled step): every size rounds up to `padded_size`, so that a step's tensors
    take a bounded set of shapes; the padding tokens write to the pool's scratch block, padding rows and
    queries see key 0 only, and no view (a slice's bounds would be a new graph every step).
    `paged`: every row's attention is the paged kernel's (paged_layout.py), in one call.
    `ahead`: each row's blocks and the block tables reach that many positions further, for the
    later steps of a chain advanced on the device (chained_steps.py)."""
    for cache, length in zip(caches, lengths):
        cache.reserve(pool, cache.length + length + ahead)
    pad = padded_size if padded else int
    if paged:
        return paged_layout(pool, caches, lengths, trees, pad, ahead, device)
    history = torch.tensor([cache.length for cache in caches])  # [B]
    new = torch.tensor(list(lengths))  # [B]
    total, size = history + new, pool.block_size
    num_tokens, width = int(new.sum()), pad(int(total.max()) + ahead)
    num_blocks = blocks_for(width, size)
    # [B, blocks]; a shorter row's padding names block 0, whose slots its mask hides
    tables = torch.tensor([cache.table[:num_blocks] + [0] * (num_blocks - len(cache.table)) for cache in caches])
    keys = torch.arange(width)  # [L]
    read_slots = tables[:, keys // size] * size + keys % size  # [B, L]; past a row's end: some slot, masked
    queries = torch.arange(int(new.max()))  # [Q]
    real = queries[None] < new[:, None]  # [B, Q]
    write_slots = read_slots.gather(1, (history[:, None] + queries[None]).clamp(max=width - 1))[real]  # [N]
    scratch = pool.scratch_slot + torch.arange(pad(num_tokens) - num_tokens) % size  # [padding]
    offsets = torch.cumsum(new, 0) - new  # [B]
    long = new > LONG_ROW
    parts = [members for members in (torch.nonzero(~long)[:, 0], torch.nonzero(long)[:, 0]) if members.numel()]
    if len(caches) == 1 and not padded:
        table = caches[0].table
        if all(block == table[0] + index for index, block in enumerate(table[:num_blocks])):
            read_slots = slice(table[0] * size, table[0] * size + int(total[0]))  # a view, not a gather
        group, _, _ = row_group(torch.tensor([0]), history, new, offsets, read_slots, trees, pad, device)
        return StepLayout(pool, on_device(write_slots, device), [RowGroup(group.read, None, group.mask)], None)
    groups, output_index, start = [], torch.zeros(pad(num_tokens), dtype=torch.long), 0  # [N]
    for members in parts:
        group, tokens, places = row_group(members, history, new, offsets, read_slots, trees, pad, device)
        output_index[tokens] = start + places  # where each token's output lies among the groups'
        groups.append(RowGroup(group.read, on_device(group.query_index, device), group.mask))
        start += group.query_index.numel()
    write_slots = torch.cat([write_slots, scratch])
    return StepLayout(pool, on_device(write_slots, device), groups, on_device(output_index, device))


def row_group(members, history, new, offsets, read_slots, trees, pad, device):
    """The rows `members` (indices `[B_g]` into the step's `[B]` rows) as one attention call,
    `pad`ded to `pad(B_g)` rows of `pad(Q_g)` queries over `pad(L_g)` keys (a padding row has no
    history and no new token). Returns the group (its `query_index` still on the host) and, for
    each of its N_g tokens, its packed index and its place among the group's `[B_g * Q_g]`
    outputs (`[N_g]` each)."""
    num_tokens = int(new.sum())
    history, new, offsets = history[members], new[members], offsets[members]  # [B_g]
    total = history + new
    rows = pad(len(members))
    history, new, offsets = (torch.cat([part, part.new_zeros(rows - len(members))]) for part in (history, new, offsets))
    keys, queries = torch.arange(pad(int(total.max()))), torch.arange(pad(int(new.max())))  # [L], [Q]
    real = queries[None] < new[:, None]  # [B_g, Q]
    packed = offsets[:, None] + queries[None]  # [B_g, Q]; a padded query names some token, masked
    places = torch.arange(rows * queries.numel()).view(rows, -1)  # [B_g, Q]
    read = read_slots
    if not isinstance(read_slots, slice):
        read = read_slots[members, : keys.numel()]
        read = on_device(torch.cat([read, read.new_zeros(rows - len(members), keys.numel())]), device)
    mask = None
    row_trees = [trees[row] for row in members.tolist()]
    padded = pad is not int
    if padded or queries.numel() > 1 or any(tree is not None for tree in row_trees) or total.unique().numel() > 1:
        # query t of row b sees the history and new tokens 0..t (a causal mask shifted by the
        # history), or in a tree the history and its own ancestors; a padded query sees key 0
        mask = keys[None, None] <= (history[:, None, None] + queries[None, :, None])  # [B_g, Q, L]
        for index, tree in enumerate(row_trees):
            if tree is not None:
                start, width = int(history[index]), tree.num_nodes + 1
                mask[index, :width, start : start + width] = tree.attention_mask
        mask = on_device(torch.where(real[:, :, None], mask, keys[None, None] == 0)[:, None], device)  # [B_g, 1, Q, L]
    return RowGroup(read, packed.clamp(max=num_tokens - 1), mask), packed[real], places[real]


def forward_ragged(
    model: torch.nn.Module,
    caches: Sequence[PagedKV],
    token_lists: Sequence[Sequence[int]],
    trees: Optional[Sequence[Optional[Topology]]] = None,
):
    """Run each row's new tokens after its cached ones in one forward; returns the final hidden
    states `[1, N, H]` of the packed rows (row i at positions offsets[i]..) and the offsets.
    `trees`: per row, the topology its tokens (root, then nodes) form, or None for a chain."""
    input_ids = torch.tensor([[token for tokens in token_lists for token in tokens]], dtype=torch.long)
    lengths = [len(tokens) for tokens in token_lists]
    return forward_ids(model, caches, lengths, on_device(input_ids, model.device), trees)


def forward_ids(
    model: torch.nn.Module,
    caches: Sequence[PagedKV],
    lengths: Sequence[int],
    input_ids: torch.Tensor,
    trees: Optional[Sequence[Optional[Topology]]] = None,
):
    """`forward_ragged` over tokens already on the model's device, `input_ids` `[1, N]` (rows of
    `lengths` tokens): a token the device chose is fed back without a read back."""
    use_ragged_attention(model)
    with kernels_by_chunk(lengths):
        return run_ragged(model.model, caches, lengths, trees, input_ids=input_ids)


def run_ragged(
    base_model: torch.nn.Module,
    caches: Sequence[PagedKV],
    lengths: Sequence[int],
    trees: Optional[Sequence[Optional[Topology]]] = None,
    **inputs: torch.Tensor,
):
    """`forward_ragged` for a base model (layers, no LM head; its attention the ragged one) over
    rows of `lengths` new positions, given as its `input_ids` or `inputs_embeds` `[1, N, ..]`."""
    trees = trees or [None] * len(caches)
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    runner = runner_of(base_model)
    stage, graphs = runner.stage, runner.graphs
    parts = stage.microbatches(lengths) if stage is not None else [range(len(caches))]
    graphed = graphs is not None and graphs.covers(lengths)
    padded = runner.padded or graphed
    pool = runner.kv_pool()
    # a pool's storage is allocated by its first forward: that one runs eagerly, outside any
    # CUDA graph, and later ones find it in place (a static address)
    first = padded and pool.keys is None
    calls = [
        step_inputs(
            base_model,
            [caches[row] for row in part],
            [lengths[row] for row in part],
            [trees[row] for row in part],
            {name: tensor[:, offsets[part[0]] : offsets[part[-1] + 1]] for name, tensor in inputs.items()},
            padded,
        )
        for part in parts
    ]
    with attention_backends(base_model.device), torch.compiler.set_stance("force_eager" if first else "default"):
        if stage is not None:  # a graph a micro-batch, its sends and receives outside
            outputs = [output.last_hidden_state for output in stage.run_each(calls, graphs.run if graphed else None)]
        elif graphed:
            outputs = [graphs.run(calls[0])]
        else:
            outputs = [base_model(**calls[0]).last_hidden_state]
    for cache, length in zip(caches, lengths):
        cache.advance(length)
    sizes = [offsets[part[-1] + 1] - offsets[part[0]] for part in parts]
    hidden = [output[:, :size] for output, size in zip(outputs, sizes)]  # [1, N_part, H] each
    # a CUDA graph's output is overwritten by its next replay, and a scorer keeps its rows
    if len(hidden) == 1:
        return (hidden[0].clone() if padded else hidden[0]), offsets
    return torch.cat(hidden, 1), offsets


def step_inputs(base_model, caches, lengths, trees, inputs: dict, padded: bool, ahead: int = 0) -> dict:
    """A base model's keyword arguments for one forward over rows of `lengths` new tokens after
    their `caches`: the tokens (`inputs`, `[1, N, ..]`), their positions and the step's layout
    (every size `padded` to its bucket for a compiled or graphed step; `ahead`: step_layout's)."""
    # a chain's tokens follow its history; a tree's root and nodes sit at history + their depth
    positions = host_tensor(
        [
            cache.length + offset
            for cache, length, tree in zip(caches, lengths, trees)
            for offset in (range(length) if tree is None else (0, *map(len, tree.paths)))
        ]
    )
    # the paged kernel for short rows only: a prompt chunk's tokens would each read its keys again
    runner = runner_of(base_model)
    paged = runner.paged and max(lengths) <= LONG_ROW
    pool, device = runner.kv_pool(), base_model.device
    layout = step_layout(pool, caches, lengths, trees, device, padded=padded, paged=paged, ahead=ahead)
    padding = layout.write_slots.numel() - len(positions)
    return {
        **{name: pad_tokens(tensor, padding) for name, tensor in inputs.items()},
        "position_ids": on_device(pad_tokens(positions[None], padding), base_model.device),
        "use_cache": False,
        "attention_mask": mask_made(device),
        "ragged": layout,
    }


def pad_tokens(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """`tensor` `[1, N, ..]` followed by `count` zero tokens (a padded step's; position 0, id 0)."""
    if not count:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(tensor.shape[0], count, *tensor.shape[2:])], 1)
