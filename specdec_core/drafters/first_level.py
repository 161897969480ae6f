"""FLy's first level (multi-level acceleration): the lookup whose guesses a draft model checks
in one forward (`mla`, `mla_tree`), and which under load `mla` proposes alone. Either prompt
lookup over the request's own tokens (`pld`) or suffix decoding over its own and earlier
requests' (`suffix`): a session of that drafter over the same context, learning from its own
proposals."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, model_validator

from .pld import AdaptiveLookupParams, PromptLookupDrafter, PromptLookupParams
from .suffix import SuffixDrafter, SuffixLookupParams, SuffixParams
from .suffix_cache import SuffixCache, require_arctic

FirstLevel = Union[PromptLookupDrafter, SuffixDrafter]


class FirstLevelParams(PromptLookupParams, SuffixLookupParams):
    lookup: Literal["pld", "suffix"] = Field(
        "pld", description="the first level: prompt lookup, or suffix decoding (its suffix_* and spec settings)"
    )

    @model_validator(mode="after")
    def _suffix_installed(self):
        if self.lookup == "suffix":
            require_arctic()
        return self


def first_level(params: FirstLevelParams, suffixes: Optional[SuffixCache]) -> FirstLevel:
    """A session of the first level `params.lookup`, with the fields of `params` that it takes
    (adaptive lengths priced by the same verify cost)."""
    if params.lookup == "pld":
        return PromptLookupDrafter(AdaptiveLookupParams(**fields_of(params, AdaptiveLookupParams)))
    return SuffixDrafter(SuffixParams(**fields_of(params, SuffixParams)), suffixes)


def fields_of(params: FirstLevelParams, level: type) -> dict:
    return params.model_dump(include=set(level.model_fields))
