"""The chain model drafters' parameters (`model`, `mla`): block_length's prices and their own stops."""

from __future__ import annotations

from pydantic import Field

from .block_length import DraftCostParams
from .first_level import FirstLevelParams


class ModelDrafterParams(DraftCostParams):
    # the embedded pair's on an AVX-512 CPU, replaced by this machine's like draft_cost
    prefill_cost: float = Field(
        0.02,
        ge=0.0,
        le=100.0,
        description="one prompt token of the draft's prefill, in 1-token target steps: a request whose "
        "prompt the draft cannot earn back drafts without it (model: plain steps; mla: prompt lookup)",
    )
    confidence_threshold: float = Field(
        0.0, ge=0.0, le=1.0, description="stop drafting when the draft's top prob is below this"
    )
    path_threshold: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="entropy-gated K: stop once the path value (the product of the draft's top-1 probs "
        "so far, EntMTP's score over a chain) is at or below this; 0: off",
    )

    masked_by_grammar: bool = Field(
        True,
        description="under a request's structured output, draw drafts from the draft's masked distribution; "
        "false: blind drafts the verifier cuts at their first forbidden token (what masking buys: "
        "`specdec structured-bench`)",
    )


class MultiLevelParams(ModelDrafterParams, FirstLevelParams):
    pass
