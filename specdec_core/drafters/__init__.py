"""Drafters by name: `none`, `pld`, `model`, `mla`, `model_tree`, `mla_tree`, `heads`, `eagle3`
(docs/policies.md)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..api.errors import SpecdecError, validate_params
from .drafter_base import Drafter, DraftSource, NoDrafter
from .eagle3 import Eagle3Drafter
from .head_trees import HeadsDrafter
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
        Eagle3Drafter,
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


def drafter_source(name: str) -> DraftSource:
    """What drafter `name` drafts from (an unknown name: DrafterError)."""
    validate_drafter(name)
    return DRAFTERS[name].drafts_from


def make_drafter(
    name: str,
    params: Optional[dict[str, Any]] = None,
    draft_model: Optional[torch.nn.Module] = None,
    target: Optional[Any] = None,
) -> Any:
    """Drafter `name` over what it drafts from: `draft_model`, or the request's `target` session
    (whose heads it asks; such a drafter is itself an awaitable `DraftSession`)."""
    validated = validate_drafter(name, params)
    source = DRAFTERS[name].drafts_from
    if source is DraftSource.TARGET_HEADS:
        if target is None:
            raise DrafterError(f"drafter {name!r} reads the target's heads: it is made beside the target session")
        return DRAFTERS[name](target, validated)
    if source is DraftSource.DRAFT_MODEL:
        if draft_model is None:
            raise DrafterError(f"drafter {name!r} needs a draft model, and none is loaded")
        return DRAFTERS[name](draft_model, validated)
    return DRAFTERS[name](validated)


__all__ = ["DRAFTERS", "DraftSource", "Drafter", "DrafterError", "drafter_source", "make_drafter", "validate_drafter"]
