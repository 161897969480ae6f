"""Drafters by name: `none`, `pld`, `suffix`, `suffix_tree`, `model`, `mla`, `model_tree`,
`mla_tree`, `heads`, `eagle3` (docs/policies.md)."""

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
from .suffix import SuffixDrafter, SuffixTreeDrafter
from .suffix_cache import SuffixCache

# HeadsDrafter is no Drafter: it asks the target session for its heads' guesses (async)
DRAFTERS: dict[str, type] = {
    cls.name: cls
    for cls in (
        NoDrafter,
        PromptLookupDrafter,
        SuffixDrafter,
        SuffixTreeDrafter,
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
    suffixes: Optional[SuffixCache] = None,
) -> Any:
    """Drafter `name` over what it drafts from: `draft_model`, or the request's `target` session
    (whose heads it asks; such a drafter is itself an awaitable `DraftSession`); those that
    read suffix trees (`reads_suffixes`) over the process's `suffixes`."""
    validated = validate_drafter(name, params)
    cls = DRAFTERS[name]
    shared = {"suffixes": suffixes} if getattr(cls, "reads_suffixes", False) else {}
    if cls.drafts_from is DraftSource.TARGET_HEADS:
        if target is None:
            raise DrafterError(f"drafter {name!r} reads the target's heads: it is made beside the target session")
        return cls(target, validated)
    if cls.drafts_from is DraftSource.DRAFT_MODEL:
        if draft_model is None:
            raise DrafterError(f"drafter {name!r} needs a draft model, and none is loaded")
        return cls(draft_model, validated, **shared)
    return cls(validated, **shared)


__all__ = [
    "DRAFTERS",
    "DraftSource",
    "Drafter",
    "DrafterError",
    "SuffixCache",
    "drafter_source",
    "make_drafter",
    "validate_drafter",
]
