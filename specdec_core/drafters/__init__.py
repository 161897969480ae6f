"""Drafters by name: `none`, `pld`, `model`, `mla`, `model_tree`, `mla_tree`, `heads`
(docs/policies.md)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import SpecdecError, validate_params
from .base import Drafter, NoDrafter
from .heads import HeadsDrafter
from .model import ModelDrafter, MultiLevelDrafter
from .model_tree import ModelTreeDrafter, MultiLevelTreeDrafter
from .pld import PromptLookupDrafter

# HeadsDrafter is no Drafter: it asks the target session for its heads' guesses (async)
DRAFTERS: dict[str, type] = {
    cls.name: cls
    for cls in (
        NoDrafter,
        PromptLookupDrafter,
        ModelDrafter,
        MultiLevelDrafter,
        ModelTreeDrafter,
        MultiLevelTreeDrafter,
        HeadsDrafter,
    )
}


class DrafterError(SpecdecError):
    """Unknown drafter, bad parameters, or a model drafter without a draft model."""

    param = "drafter"


def validate_drafter(name: str, params: Optional[dict[str, Any]] = None):
    """The drafter's validated params; raises DrafterError with a readable message."""
    if name not in DRAFTERS:
        raise DrafterError(f"unknown drafter {name!r}; valid drafters: {', '.join(sorted(DRAFTERS))}")
    try:
        return validate_params(DRAFTERS[name].Params, params, f"drafter {name!r}")
    except SpecdecError as error:
        raise DrafterError(str(error)) from None


def make_drafter(
    name: str, params: Optional[dict[str, Any]] = None, draft_model: Optional[torch.nn.Module] = None
) -> Drafter:
    validated = validate_drafter(name, params)
    if DRAFTERS[name] is HeadsDrafter:
        raise DrafterError("drafter 'heads' reads the target's heads: it is made beside the target session")
    if DRAFTERS[name].needs_model:
        if draft_model is None:
            raise DrafterError(f"drafter {name!r} needs a draft model, and none is loaded")
        return DRAFTERS[name](draft_model, validated)
    return DRAFTERS[name](validated)


__all__ = ["DRAFTERS", "Drafter", "DrafterError", "HeadsDrafter", "make_drafter", "validate_drafter"]
