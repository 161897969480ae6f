"""A step's sampled verdicts decided together (`Check.decided_together`): its chains by
sampled_chains.py, its trees by sampled_trees.py, each kind in a fixed number of operations
whatever the number of requests, and all of them read back at once."""

from __future__ import annotations

from typing import Sequence

from ..loop.stage_types import Verdict
from .sampled_chains import Check, chains_decided, read_back
from .sampled_trees import trees_decided


def decide_together(checks: Sequence[Check]) -> list[Verdict]:
    """Each check's verdict, in order, as it would be alone."""
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
