"""Acceptance policies, one file each, registered by name with validated parameters."""

from __future__ import annotations

from typing import Any, Optional

from ..api.errors import SpecdecError, validate_params
from .dropmatch import DropMatchPolicy
from .ears import EarsPolicy
from .easd import EasdPolicy
from .fly import FlyPolicy
from .greedy import GreedyPolicy
from .policy_base import AcceptancePolicy, PolicyParams
from .rejection import RejectionPolicy
from .typical import TypicalPolicy

POLICIES: dict[str, type[AcceptancePolicy]] = {
    cls.name: cls
    for cls in (GreedyPolicy, RejectionPolicy, TypicalPolicy, EasdPolicy, EarsPolicy, DropMatchPolicy, FlyPolicy)
}
# every counter some policy reports (a bench table's columns)
POLICY_COUNTERS = tuple(sorted({counter for cls in POLICIES.values() for counter in cls.counters}))


class PolicyError(SpecdecError):
    """Unknown policy name or invalid policy parameters."""

    param = "policy"


def make_policy(name: str, params: Optional[dict[str, Any]] = None) -> AcceptancePolicy:
    """Build a policy by registry name; raises PolicyError with a readable message."""
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}")
    policy_cls = POLICIES[name]
    try:
        return policy_cls(validate_params(policy_cls.Params, params, f"policy {name!r}"))
    except SpecdecError as error:
        raise PolicyError(str(error)) from None


__all__ = ["AcceptancePolicy", "PolicyParams", "POLICIES", "POLICY_COUNTERS", "PolicyError", "make_policy"]
