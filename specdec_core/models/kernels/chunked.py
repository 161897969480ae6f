"""`ChunkedLinear`: a draft's CPU linear over one set of weight values and several kernels (int4,
bf16, fp32), each chunk of rows on the kernel its length runs fastest on this machine
(kernel_choice.py measures which).

Why: which kernel wins depends on the CPU and the row count. With AVX-512, int4 wins a draft's
1-token step and packed bf16 a prompt; on AVX2 alone oneDNN cannot pack bf16, and a prompt on
torch's bf16 matmul cost 18x packed fp32 (docs/architecture.md, "Why the CPU kernels"). Only drafts choose by length: a
target's logits must not depend on its verify block's size, so it keeps one kernel (linear.py).

In a forward over several sequences' chunks (`kernels_by_chunk`) each row runs the kernel its
own chunk would alone; every kernel computes a row independently of the others, so a session's
result does not depend on its batch companions."""

from __future__ import annotations

import bisect
import functools
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from .linear import pack_weight, packed_matmul

# (rows, kernel name) by rising rows: a chunk of n rows runs the kernel of the first entry with
# at least n rows, the last entry's beyond
KernelTable = tuple[tuple[int, str], ...]

# a linear's candidate kernels by name, each built on demand: a linear builds those its table
# names, and the measurement all of them, once per shape
Candidates = dict[str, Callable[[], torch.nn.Module]]

# the lengths of the chunks whose rows a forward's linears get, in order; None: one chunk per call
CHUNK_LENGTHS: ContextVar[Optional[Sequence[int]]] = ContextVar("chunk_lengths", default=None)


def kernel_for(table: KernelTable, num_rows: int) -> str:
    index = bisect.bisect_left([rows for rows, _ in table], num_rows)
    return table[min(index, len(table) - 1)][1]


def describe(table: KernelTable) -> str:
    """ "int4 up to 8 rows, fp32 beyond": the table's runs of one kernel."""
    runs: list[tuple[int, str]] = []
    for rows, name in table:
        if runs and runs[-1][1] == name:
            runs[-1] = (rows, name)
        else:
            runs.append((rows, name))
    if len(runs) == 1:
        return runs[0][1]
    parts = [f"{name} up to {rows} row{'s' if rows > 1 else ''}" for rows, name in runs[:-1]]
    return ", ".join(parts) + f", {runs[-1][1]} beyond"


class DenseKernel(torch.nn.Module):
    """x W^T + b with W held in `dtype`: oneDNN on a packed copy where it packs that dtype here,
    torch's matmul elsewhere; activations are converted to `dtype` and back."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
        super().__init__()
        weight = weight.detach().to(dtype)
        self.packed = pack_weight(weight)  # only the copy a kernel reads is kept
        self.weight = weight if self.packed is None else None
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.dtype = dtype

    @property
    def library(self) -> str:
        return "matmul" if self.packed is None else "oneDNN"

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        x = rows.to(self.dtype)
        if self.packed is None:
            return torch.nn.functional.linear(x, self.weight, self.bias).to(rows.dtype)
        return packed_matmul(x, self.packed, self.bias).to(rows.dtype)


class ChunkedLinear(torch.nn.Module):
    """`linear` with its rows on the kernel `table` names for the length of their chunk. Kernels
    take and give `[N, *]` rows in `dtype` (the model's activations); only those of `candidates`
    that the table names are built."""

    def __init__(self, linear: torch.nn.Linear, candidates: Candidates, table: KernelTable, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.table = table
        self.kernels = torch.nn.ModuleDict(
            {name: candidates[name]() for name in dict.fromkeys(name for _, name in table)}
        )
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError("a draft's chunked linears run on CPU only")
        rows = x.reshape(-1, x.shape[-1]).to(self.dtype)  # [N, in]
        lengths = CHUNK_LENGTHS.get() or (rows.shape[0],)
        if sum(lengths) != rows.shape[0]:
            raise RuntimeError(f"{rows.shape[0]} rows in chunks of {lengths}: chunk lengths describe other rows")
        plan = row_plan(self.table, tuple(lengths))
        if isinstance(plan, str):
            out = self.kernels[plan](rows)
        else:
            out = rows.new_empty(rows.shape[0], self.out_features)
            for name, chosen in plan:
                out[chosen] = self.kernels[name](rows[chosen])
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)


@functools.lru_cache(maxsize=256)
def row_plan(table: KernelTable, lengths: tuple[int, ...]) -> Union[str, list[tuple[str, torch.Tensor]]]:
    """The kernel of chunks of `lengths` rows: one name where all run one kernel, else each
    kernel with the mask `[N]` of its rows. Computed once per step for all of a forward's linears."""
    names = [kernel_for(table, length) for length in lengths]
    if len(set(names)) == 1:
        return names[0]
    row_names = [name for name, length in zip(names, lengths) for _ in range(length)]
    return [(name, torch.tensor([row == name for row in row_names])) for name in dict.fromkeys(names)]


@contextmanager
def kernels_by_chunk(chunk_lengths: Sequence[int]) -> Iterator[None]:
    """Chunked linears in this block pick each row's kernel by the length of its own chunk."""
    token = CHUNK_LENGTHS.set(tuple(chunk_lengths))
    try:
        yield
    finally:
        CHUNK_LENGTHS.reset(token)


def kernel_summary(model: torch.nn.Module) -> str:
    """What a draft's chunked linears run, per shape: "576x1536 (30): int4 up to 8 rows, fp32
    beyond; ...; LM head: bf16 (bf16 on oneDNN, fp32 on oneDNN)"; "" for a model without any."""
    head = model.get_output_embeddings()
    tables: dict[str, tuple[KernelTable, int]] = {}
    libraries: dict[str, str] = {}
    for module in model.modules():
        if isinstance(module, ChunkedLinear):
            role = "LM head" if module is head else f"{module.in_features}x{module.out_features}"
            tables[role] = (module.table, tables.get(role, (None, 0))[1] + 1)
            libraries.update(
                {name: kernel.library for name, kernel in module.kernels.items() if hasattr(kernel, "library")}
            )
    if not tables:
        return ""
    parts = [f"{role} ({count}): {describe(table)}" for role, (table, count) in tables.items()]
    return (
        "; ".join(parts) + " (" + ", ".join(f"{name} on {library}" for name, library in sorted(libraries.items())) + ")"
    )
