"""The keys and values of every session of one model, in one pool of fixed-size blocks (vLLM's
paged KV cache). Vocabulary:
- slot: one position's entry, the same index in every layer; block: `block_size` slots in a row;
- a session's block table: its blocks in order; position p lives at slot
  `table[p // block_size] * block_size + p % block_size`.
Rolling back lowers a session's length and frees its tail blocks; nothing is copied. A step's
rows write their new entries with one `index_copy_` per layer and read every row's history with
one gather (batching.py), whatever the number of rows.

Without a fixed size the pool doubles when full (a copy, done between forwards, log2 of the
peak times), so a server's memory settles at its peak and stays there.

Prefix caching (vLLM's automatic prefix caching): a full block of a session's committed prompt (or,
when it is preempted, of all its committed positions) is published under a key that hashes its
tokens and the key before it, so a key names a whole prefix; a later session whose tokens start
with the same blocks takes them (a reference each) instead of computing them. Only committed,
full blocks are published, and a session writes only past its committed positions, so a shared
block never changes. A block no session holds stays cached until the pool needs it (LRU)."""

from __future__ import annotations

import hashlib
import itertools
import weakref
from array import array
from collections import OrderedDict
from typing import Optional, Sequence

import torch

BLOCK_SIZE = 16  # positions per block, vLLM's default
INITIAL_BLOCKS = 64
# a model spec's `kv_cache_dtype` -> the pool's (None: the activations'); FP8 as vLLM's fp8 cache
# without calibrated scales (scale 1): entries saturate at +-448, read back in the activations' dtype
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


class KVPoolExhausted(RuntimeError):
    """A fixed-size pool has no free block left for a session's next positions."""


def prefix_keys(tokens: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """The keys of `tokens`' full blocks, each a hash of its tokens and the key before it."""
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", tokens[start : start + block_size]).tobytes()).digest()
        keys.append(parent)
    return keys


POOL_SERIALS = itertools.count()


class KVPool:
    """`keys`, `values`: `[layers, (num_blocks + 1) * block_size, kv_heads, head_dim]`, the last
    block a scratch block, allocated at the first write (its shape, dtype and device are the
    model's). A block is held (`holders`: how many sessions hold it), cached (no holder,
    published: `idle`, least recently used first) or `free` (lowest first, so that a session's
    blocks tend to be consecutive: read as a view)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int = INITIAL_BLOCKS,
        growable: bool = True,
        block_size: int = BLOCK_SIZE,
        prefix_caching: bool = True,
        dtype: Optional[torch.dtype] = None,
    ):
        """`dtype`: the entries' (None: the model's activations', known at the first write)."""
        self.num_layers, self.num_blocks, self.growable, self.block_size = num_layers, num_blocks, growable, block_size
        self.dtype = dtype
        self.prefix_caching = prefix_caching
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.storage_version = 0  # one more each time the storage is placed: CUDA graphs wrote the old one
        self.serial = next(POOL_SERIALS)  # unlike id(), never reused by a later pool
        self.free = list(range(num_blocks))
        self.holders = [0] * num_blocks
        self.published: dict[bytes, int] = {}  # prefix key -> block
        self.key_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()

    @property
    def num_used(self) -> int:
        """Blocks some session holds."""
        return self.num_blocks - len(self.free) - len(self.idle)

    @property
    def available(self) -> int:
        """Blocks a session can take now: free ones and cached ones nobody holds (evicted first)."""
        return len(self.free) + len(self.idle)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks for one session: free ones first, lowest first, then the least recently
        used cached ones; only when held blocks fill it does a growable pool double."""
        while count > self.available:
            if not self.growable:
                raise KVPoolExhausted(f"KV pool full: {count} blocks wanted, {self.available} free")
            self.grow(max(self.num_blocks, count - len(self.free) - len(self.idle)))
        taken, self.free = self.free[:count], self.free[count:]
        while len(taken) < count:  # evict
            block, _ = self.idle.popitem(last=False)
            del self.published[self.key_of.pop(block)]
            taken.append(block)
        for block in taken:
            self.holders[block] = 1
        return taken

    def release(self, blocks: Sequence[int]) -> None:
        freed = []
        for block in blocks:
            self.holders[block] -= 1
            if self.holders[block] == 0:
                if block in self.key_of:
                    self.idle[block] = None  # cached, most recently used
                else:
                    freed.append(block)
        if freed:
            self.free = sorted(self.free + freed)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The published blocks of the longest prefix of `keys`, each now held once more."""
        blocks = []
        for key in keys:
            block = self.published.get(key)
            if block is None:
                break
            self.idle.pop(block, None)
            self.holders[block] += 1
            blocks.append(block)
        return blocks

    def publish(self, block: int, key: bytes) -> None:
        """Offer a held block's entries to later sessions under `key` (a prefix's first holder wins)."""
        if key not in self.published and block not in self.key_of:
            self.published[key], self.key_of[block] = block, key

    @torch.inference_mode()
    def grow(self, extra_blocks: int) -> None:
        if self.keys is not None:
            extra = (self.num_layers, extra_blocks * self.block_size, *self.keys.shape[2:])
            held = self.scratch_slot  # the new blocks go before the scratch block
            grown = []
            for entries in (as_bytes(self.keys), as_bytes(self.values)):
                grown.append(torch.cat([entries[:, :held], entries.new_zeros(extra), entries[:, held:]], 1))
            self.keys, self.values = (entries.view(self.keys.dtype) for entries in grown)
            self.storage_version += 1
            self.mark_static()
        self.free += range(self.num_blocks, self.num_blocks + extra_blocks)
        self.holders += [0] * extra_blocks
        self.num_blocks += extra_blocks

    @property
    def scratch_slot(self) -> int:
        """The first slot of the scratch block, past the others: a padded step's padding tokens
        write there (batching.step_layout), and nothing reads it unmasked."""
        return self.num_blocks * self.block_size

    def storage(self, layer: int, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values `[slots, kv_heads, head_dim]`; `key` `[1, kv_heads, N,
        head_dim]`, a forward's new keys, tells the first call what to allocate."""
        if self.keys is None:
            shape = (self.num_layers, (self.num_blocks + 1) * self.block_size, key.shape[1], key.shape[3])
            self.keys = torch.zeros(shape, dtype=self.dtype or key.dtype, device=key.device)
            self.values = torch.zeros(shape, dtype=self.dtype or key.dtype, device=key.device)
            self.storage_version += 1
            self.mark_static()
        return self.keys[layer], self.values[layer]

    def mark_static(self) -> None:
        """Tell torch.compile that the storage stays where it is (until the pool grows), so that a
        CUDA graph may write into it in place rather than being skipped for mutating an input
        (only a tag on the tensors: eager forwards do not see it)."""
        for held in (self.keys, self.values):
            torch._dynamo.mark_static_address(held)

    def slots(self, table: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """`[len(positions)]`: the slots of a session's positions, given its block table."""
        positions = torch.as_tensor(list(positions), dtype=torch.long)
        blocks = torch.as_tensor(list(table), dtype=torch.long)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size


def as_bytes(entries: torch.Tensor) -> torch.Tensor:
    """FP8 entries as their bytes (a view), for the copies and gathers torch has no FP8 kernel
    for (index_copy_ on the CPU; indexing on older versions); other entries as they are."""
    return entries.view(torch.uint8) if entries.dtype == torch.float8_e4m3fn else entries


def write(storage: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor) -> None:
    """`storage[slots] = entries` `[N, kv_heads, head_dim]`, as a pool of `storage`'s dtype holds
    them (FP8: saturated, not NaN)."""
    if entries.dtype != storage.dtype and storage.dtype == torch.float8_e4m3fn:
        entries = entries.clamp(-FP8_MAX, FP8_MAX).to(storage.dtype)
    as_bytes(storage).index_copy_(0, slots, as_bytes(entries))


def gather(storage: torch.Tensor, index) -> torch.Tensor:
    """`storage[index]` (a slice or indices), through its bytes where it is FP8."""
    return as_bytes(storage)[index].view(storage.dtype)


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
        self.prefix_keys: list[bytes] = []  # of its first blocks, published or taken

    @classmethod
    def for_request(cls, num_prompt: int, max_tokens: Optional[int], most: int = 256) -> "PagedKV":
        """A request's cache, holding at first its prompt and the tokens it may emit, at most
        `most` of them: past them it takes blocks as it goes."""
        return cls(num_prompt + 1 + min(most if max_tokens is None else max_tokens, most))

    def join(self, pool: KVPool) -> None:
        """Take blocks from `pool` from now on (one model's; its first call decides)."""
        if self.pool is None:
            self.pool = pool
            weakref.finalize(self, pool.release, self.table)  # the table list is kept in place
        elif self.pool is not pool:
            raise ValueError("a session's KV cache belongs to one model's pool")

    def reuse(self, pool: KVPool, tokens: Sequence[int]) -> int:
        """A new session's first positions from the pool's published blocks where `tokens` (its
        prompt but the last token) starts with them; returns the positions it now holds."""
        self.join(pool)
        if pool.prefix_caching and not self.table:
            keys = prefix_keys(tokens, pool.block_size)
            self.table += pool.lookup(keys)
            self.prefix_keys = keys[: len(self.table)]
            self.length = len(self.table) * pool.block_size
        return self.length

    def publish(self, tokens: Sequence[int]) -> None:
        """Publish the full blocks of `tokens`, this session's committed positions from 0."""
        if self.pool is None or not self.pool.prefix_caching:
            return
        done = len(self.prefix_keys)
        parent = self.prefix_keys[-1] if done else b""
        start = done * self.pool.block_size
        for key in prefix_keys(tokens[start : min(len(tokens), self.length)], self.pool.block_size, parent):
            self.pool.publish(self.table[len(self.prefix_keys)], key)
            self.prefix_keys.append(key)

    def reserve(self, pool: KVPool, positions: int) -> None:
        """Blocks for `positions` positions in all, from `pool` (this session's from now on)."""
        self.join(pool)
        wanted = self.blocks_wanted(positions, pool.block_size)
        if wanted > 0:
            self.table += pool.allocate(wanted)

    def blocks_wanted(self, positions: int, block_size: int = BLOCK_SIZE) -> int:
        """The blocks `reserve(positions)` would take from the pool."""
        return max(blocks_for(max(positions, self.reserve_positions), block_size) - len(self.table), 0)

    def drop(self) -> None:
        """Give every block back (a preempted session's: those it published stay cached)."""
        if self.pool is not None:
            self.pool.release(self.table)
        self.table.clear()  # in place: the finalizer holds this list
        self.length = self.reserve_positions = 0
        self.prefix_keys.clear()

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
        for held in (as_bytes(pool.keys), as_bytes(pool.values)):
            held[:, target] = held[:, source]
        self.crop(start + len(positions))
