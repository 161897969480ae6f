"""A step's sampled verdicts decided together (`Check.decided_together`): its chains by
sampled_chains.py, its trees by sampled_trees.py, each kind in a fixed number of operations and one
read back whatever the number of requests."""

from __future__ import annotations

from typing import Sequence

from ..loop.stage_types import Verdict
from .sampled_chains import Check, decide_chains
from .sampled_trees import decide_trees


def decide_together(checks: Sequence[Check]) -> list[Verdict]:
    """Each check's verdict, in order, as it would be alone."""
    verdicts: list = [None] * len(checks)
    for is_tree, decide in ((False, decide_chains), (True, decide_trees)):
        indices = [index for index, check in enumerate(checks) if (check.draft.tree is not None) == is_tree]
        if indices:
            for index, verdict in zip(indices, decide([checks[index] for index in indices])):
                verdicts[index] = verdict
    return verdicts
