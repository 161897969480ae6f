"""What a request's output must match (vLLM's `structured_outputs`): exactly one of a JSON schema,
any JSON object, a regex, a list of choices or a grammar (Lark, llguidance's dialect, or GBNF).
Part of SamplingParams, as in vLLM, so a worker knows the server changes its rows."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class StructuredOutput(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: Optional[dict[str, Any]] = Field(None, description="a JSON schema the output is an instance of")
    json_object: bool = Field(False, description="any JSON object")
    regex: Optional[str] = Field(None, min_length=1)
    choice: Optional[list[str]] = Field(None, min_length=1, description="the output is one of these strings")
    grammar: Optional[str] = Field(None, min_length=1, description="Lark (llguidance's dialect) or GBNF (::=)")
    disable_any_whitespace: bool = Field(False, description="JSON without whitespace between its tokens (vLLM's)")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise PydanticCustomError(
                "structured_output", f"give exactly one of {', '.join(KINDS)}", {"param": "structured_output"}
            )
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))
