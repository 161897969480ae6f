"""The request fields that ask for structured output, as OpenAI and vLLM clients send them:
OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`,
`regex`, `choice`, `grammar`, `json_object`) and its older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar`. At most one of them may ask; each maps onto one
StructuredOutput."""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from specdec_core.structured.constraint_spec import StructuredOutput


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Optional[str] = None
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: Optional[bool] = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str = Field(pattern="^(text|json_object|json_schema)$")
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            message = "json_schema goes with type json_schema"
            raise PydanticCustomError("response_format", message, {"param": "response_format"})
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object."""

    model_config = ConfigDict(extra="forbid")

    json_: Optional[Union[dict[str, Any], str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = None


def schema_of(value: Union[dict[str, Any], str], field: str) -> dict[str, Any]:
    """A JSON schema given as an object or as its text."""
    try:
        schema = json.loads(value) if isinstance(value, str) else value
    except ValueError as error:
        raise PydanticCustomError("structured", f"{field}: not JSON ({error})", {"param": field}) from error
    if not isinstance(schema, dict):
        raise PydanticCustomError("structured", f"{field}: a JSON schema is an object", {"param": field})
    return schema


class StructuredFields(BaseModel):
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    @model_validator(mode="after")
    def _one_source(self):
        self.structured_output()  # a conflict or a malformed schema is a 400 at parsing
        return self

    def structured_output(self) -> Optional[StructuredOutput]:
        asked: dict[str, dict[str, Any]] = {}
        if self.response_format is not None and self.response_format.type != "text":
            fmt = self.response_format
            asked["response_format"] = (
                {"json_object": True} if fmt.type == "json_object" else {"json_schema": fmt.json_schema.schema_}
            )
        if self.structured_outputs is not None:
            given = self.structured_outputs.model_dump(exclude_none=True, by_alias=True)
            if "json" in given:
                given["json_schema"] = schema_of(given.pop("json"), "structured_outputs.json")
            asked["structured_outputs"] = given
        if self.guided_json is not None:
            asked["guided_json"] = {"json_schema": schema_of(self.guided_json, "guided_json")}
        for field, kind in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                asked[field] = {kind: getattr(self, field)}
        if len(asked) > 1:
            fields = ", ".join(asked)
            raise PydanticCustomError("structured", f"ask for one structured output, not {fields}", {"param": fields})
        if not asked:
            return None
        ((field, constraint),) = asked.items()
        try:
            return StructuredOutput(**constraint)
        except ValueError as error:
            raise PydanticCustomError("structured", f"{field}: {error}", {"param": field}) from error
