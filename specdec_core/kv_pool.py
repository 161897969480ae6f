"""The keys and values of every session of one model, in one pool of fixed-size blocks (vLLM's
paged KV cache). Vocabulary:
- slot: one position's entry, the same index in every layer; block: `block_size` slots in a row;
- a session's block table: its blocks in order; position p lives at slot
  `table[p // block_size] * block_size + p % block_size`.
Rolling back lowers a session's length and frees its tail blocks; nothing is copied. A step's
rows write their new entries with one `index_copy_` per layer and read every row's history with
one gather (batching.py), whatever the number of rows.

Without a fixed size the pool doubles when full (a copy, done between forwards, log2 of the
peak times), so a server's memory settles at its peak and stays there."""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch

BLOCK_SIZE = 16  # positions per block, vLLM's default
INITIAL_BLOCKS = 64


class KVPoolExhausted(RuntimeError):
    """A fixed-size pool has no free block left for a session's next positions."""


class KVPool:
    """`keys`, `values`: `[layers, num_blocks * block_size, kv_heads, head_dim]`, allocated at the
    first write (its shape, dtype and device are the model's). `free`: the unused blocks, lowest
    first, so that a session's blocks tend to be consecutive (read as a view, not gathered)."""

    def __init__(
        self, num_layers: int, num_blocks: int = INITIAL_BLOCKS, growable: bool = True, block_size: int = BLOCK_SIZE
    ):
        self.num_layers, self.num_blocks, self.growable, self.block_size = num_layers, num_blocks, growable, block_size
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.free = list(range(num_blocks))

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, count: int) -> list[int]:
        """`count` free blocks, lowest first (a growable pool doubles until they fit)."""
        while count > len(self.free):
            if not self.growable:
                raise KVPoolExhausted(f"KV pool full: {count} blocks wanted, {len(self.free)} free")
            self.grow(max(self.num_blocks, count - len(self.free)))
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def release(self, blocks: Sequence[int]) -> None:
        self.free = sorted(self.free + list(blocks))

    @torch.inference_mode()
    def grow(self, extra_blocks: int) -> None:
        if self.keys is not None:
            extra = (self.num_layers, extra_blocks * self.block_size, *self.keys.shape[2:])
            self.keys = torch.cat([self.keys, self.keys.new_zeros(extra)], 1)
            self.values = torch.cat([self.values, self.values.new_zeros(extra)], 1)
        self.free += range(self.num_blocks, self.num_blocks + extra_blocks)
        self.num_blocks += extra_blocks

    def storage(self, layer: int, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values `[slots, kv_heads, head_dim]`; `key` `[1, kv_heads, N,
        head_dim]`, a forward's new keys, tells the first call what to allocate."""
        if self.keys is None:
            shape = (self.num_layers, self.num_blocks * self.block_size, key.shape[1], key.shape[3])
            self.keys = torch.zeros(shape, dtype=key.dtype, device=key.device)
            self.values = torch.zeros(shape, dtype=key.dtype, device=key.device)
        return self.keys[layer], self.values[layer]

    def slots(self, table: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """`[len(positions)]`: the slots of a session's positions, given its block table."""
        positions = torch.as_tensor(list(positions), dtype=torch.long)
        blocks = torch.as_tensor(list(table), dtype=torch.long)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


class PagedKV:
    """One session's place in its model's pool: a block table and `length`, the positions it
    holds. A forward `reserve`s blocks for its new positions, writes them, and `advance`s.
    Blocks past `length` (and past the positions reserved at first) return to the pool when it
    is cropped, and all of them when the session is dropped."""

    def __init__(self, reserve_positions: int = 0) -> None:
        """`reserve_positions`: blocks to hold from the first forward on (a request's expected reach)."""
        self.pool: Optional[KVPool] = None
        self.table: list[int] = []
        self.length = 0
        self.reserve_positions = reserve_positions

    @classmethod
    def for_request(cls, num_prompt: int, max_tokens: Optional[int], most: int = 256) -> "PagedKV":
        """A request's cache, holding at first its prompt and the tokens it may emit, at most
        `most` of them: past them it takes blocks as it goes."""
        return cls(num_prompt + 1 + min(most if max_tokens is None else max_tokens, most))

    def reserve(self, pool: KVPool, positions: int) -> None:
        """Blocks for `positions` positions in all, from `pool` (this session's from now on)."""
        if self.pool is None:
            self.pool = pool
            weakref.finalize(self, pool.release, self.table)  # the table list is kept in place
            positions = max(positions, self.reserve_positions)
        if self.pool is not pool:
            raise ValueError("a session's KV cache belongs to one model's pool")
        wanted = blocks_for(positions, pool.block_size) - len(self.table)
        if wanted > 0:
            self.table += pool.allocate(wanted)

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def crop(self, keep: int) -> None:
        """Hold only the first `keep` positions."""
        self.length = min(self.length, keep)
        if self.pool is not None:
            held = blocks_for(max(self.length, self.reserve_positions), self.pool.block_size)
            if len(self.table) > held:
                self.pool.release(self.table[held:])
                del self.table[held:]

    @torch.inference_mode()
    def keep_at(self, start: int, positions: Sequence[int]) -> None:
        """Keep the entries at `positions` (ascending, >= start), moved to start, start + 1, ..;
        the sequence ends after them (a tree's accepted path into place). One copy per tensor."""
        pool = self.pool
        source = pool.slots(self.table, positions).to(pool.keys.device)
        target = pool.slots(self.table, range(start, start + len(positions))).to(pool.keys.device)
        for held in (pool.keys, pool.values):
            held[:, target] = held[:, source]
        self.crop(start + len(positions))
