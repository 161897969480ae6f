"""A step's sampled verdicts decided together (`Check.decided_together`): its chains by
sampled_chains.py, its trees by sampled_trees.py, each kind in a fixed number of operations
whatever the number of requests, and all of them read back at once. On the CPU, where there is
no launch to save, a step's checks go in parts of at most `CPU_ENTRIES` row entries (a check
larger than that alone): one `[M, V]` over 64 sessions' rows makes every temporary an allocation
of 100 MB that the warp's operations stream through, which made the whole 1.5x slower than the
sessions decided one by one (`specdec served-rows --sessions`)."""

from __future__ import annotations

from typing import Sequence

from ..loop.stage_types import Verdict
from .sampled_chains import Check, chains_decided, read_back
from .sampled_trees import trees_decided

CPU_ENTRIES = 1 << 20  # target row entries decided at once on the CPU: 4 MB of float32 rows


def decide_together(checks: Sequence[Check]) -> list[Verdict]:
    """Each check's verdict, in order, as it would be alone."""
    if not checks or checks[0].target.logits.device.type != "cpu":
        return decided_at_once(checks)
    parts, entries = [[]], 0
    for check in checks:
        if parts[-1] and entries + check.target.logits.numel() > CPU_ENTRIES:
            parts.append([])
            entries = 0
        parts[-1].append(check)
        entries += check.target.logits.numel()
    return [verdict for part in parts for verdict in decided_at_once(part)]


def decided_at_once(checks: Sequence[Check]) -> list[Verdict]:
    """`decide_together` in one pass over all of `checks`."""
    kinds = [
        (indices, decide)
        for is_tree, decide in ((False, chains_decided), (True, trees_decided))
        if (indices := [index for index, check in enumerate(checks) if (check.draft.tree is not None) == is_tree])
    ]
    verdicts: list = [None] * len(checks)
    decided = read_back([decide([checks[index] for index in indices]) for indices, decide in kinds])
    for (indices, _), kind_verdicts in zip(kinds, decided):
        for index, verdict in zip(indices, kind_verdicts):
            verdicts[index] = verdict
    return verdicts
