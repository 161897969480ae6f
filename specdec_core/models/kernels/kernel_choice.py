"""Which kernel a draft's linear runs for each chunk length, measured once per machine.

At a draft's first load on a machine, each distinct linear (shape and candidate kernels) times
its candidates at row counts from 1 to 256 and keeps the fastest at each; the tables are cached
as JSON in the specdec cache (`kernels/`), keyed by what decides the result: the CPU model, the
ISA torch and oneDNN run (ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA lower it), the dtypes oneDNN
packs, torch's version and thread count. Later loads read the cache; deleting the file measures
again. Kernels that fail on this machine (a build without one) are left out, so the choice falls
back to what runs."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch

from ...calibration.cache_files import write_atomically
from .chunked import Candidates, KernelTable
from .linear import packable_dtypes

ROW_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32, 64, 128, 256)
REPEATS = 5  # a kernel's time at a row count: the fastest of this many calls, after one warm-up
# a kernel this many times the best, and further behind than at the row count before, is not
# timed at larger ones (torch's bf16 matmul of a prompt on AVX2 took seconds)
HOPELESS = 4.0


def machine() -> dict[str, str]:
    """What the measured tables depend on."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu or platform.machine(),
        "arch": platform.machine(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "onednn_packs": ",".join(str(dtype).removeprefix("torch.") for dtype in packable_dtypes()),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
    }


def signature(linear: torch.nn.Linear, candidates: Candidates) -> str:
    bias = "+bias" if linear.bias is not None else ""
    return f"{linear.in_features}x{linear.out_features}{bias}:{','.join(sorted(candidates))}"


def fastest_times(kernels: dict[str, torch.nn.Module], rows: torch.Tensor) -> dict[str, float]:
    """Each kernel's fastest of REPEATS calls on `rows`, the kernels taking turns within each
    repeat so that a busy stretch of the machine slows them alike; one that raises is left out."""
    runnable = {}
    for name, kernel in kernels.items():
        try:
            kernel(rows)  # warm-up
        except (RuntimeError, NotImplementedError):
            continue
        runnable[name] = kernel
    best = dict.fromkeys(runnable, float("inf"))
    for _ in range(REPEATS):
        for name, kernel in runnable.items():
            start = time.perf_counter()
            kernel(rows)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


@torch.inference_mode()
def measure_table(in_features: int, dtype: torch.dtype, candidates: dict[str, torch.nn.Module]) -> KernelTable:
    """The fastest candidate at each of ROW_COUNTS; one losing ground past HOPELESS drops out."""
    generator = torch.Generator().manual_seed(0)
    alive, table = dict(candidates), []
    previous: dict[str, float] = {}  # each kernel's time over the best's at the last row count
    for num_rows in ROW_COUNTS:
        rows = torch.randn(num_rows, in_features, generator=generator).to(dtype)  # [N, in]
        times = fastest_times(alive, rows)
        if not times:
            raise RuntimeError(f"no kernel of {sorted(candidates)} runs a {in_features}-wide linear here")
        best = min(times, key=times.get)
        table.append((num_rows, best))
        ratios = {name: seconds / times[best] for name, seconds in times.items()}
        alive = {
            name: alive[name]
            for name in times
            if ratios[name] < HOPELESS or ratios[name] <= previous.get(name, float("inf"))
        }
        previous = ratios
    return tuple(table)


def measured_tables(cache_root: Path) -> Callable[[torch.nn.Linear, Candidates], KernelTable]:
    """A `ChooseKernels` that reads this machine's tables from `cache_root`/kernels/, measuring
    and storing the ones it lacks."""
    facts = machine()
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root / "kernels" / f"{key}.json"
    tables: dict[str, KernelTable] = {}
    if path.exists():
        stored = json.loads(path.read_text())
        tables = {name: tuple((rows, kernel) for rows, kernel in table) for name, table in stored["tables"].items()}

    def choose(linear: torch.nn.Linear, candidates: Candidates) -> KernelTable:
        name = signature(linear, candidates)
        if name not in tables:
            kernels = {kernel: build() for kernel, build in candidates.items()}
            tables[name] = measure_table(linear.in_features, linear.weight.dtype, kernels)
            write_atomically(path, json.dumps({"machine": facts, "tables": tables}, indent=1))
        return tables[name]

    return choose
