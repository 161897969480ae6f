"""A worker rank's CPU priority while it loads and while it serves."""

from __future__ import annotations

import os
import resource

# A rank loads its model at the lowest CPU priority and serves it at a normal process's: where it
# shares cores with another worker (the draft restarting beside the target on this project's
# 2-core VMs), a loading rank otherwise stalls the serving rank's OpenMP team
# (docs/architecture.md, "Why the CPU kernels"). Ray runs its workers' threads at nice 15;
# serving at 0 needs the right to (root, CAP_SYS_NICE or RLIMIT_NICE), and without it a rank
# keeps Ray's priority throughout.
STARTING_NICENESS, SERVING_NICENESS = 19, 0


def may_raise_priority_to(niceness: int) -> bool:
    """Whether this process may raise its threads back to `niceness` after lowering them."""
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - niceness


def set_priority(niceness: int) -> None:
    """Every thread of this process (Linux nice values are per thread) at `niceness`, as far as
    this process may set it."""
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            os.setpriority(os.PRIO_PROCESS, int(task), niceness)
        except (PermissionError, ProcessLookupError):
            pass
