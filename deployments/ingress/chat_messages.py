"""A chat's messages as OpenAI clients send them (text or text parts; an assistant's earlier tool
calls, a tool's result), and as the chat template reads them."""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from specdec_core.api.request import Role


class CalledFunction(BaseModel):
    name: str
    arguments: Union[str, dict[str, Any]] = Field("{}", description="JSON text (OpenAI's), or an object")

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, arguments):
        """Arguments as the object templates write with `tojson` (vLLM parses the text too)."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except (ValueError, RecursionError) as error:
                raise ValueError(f"tool call arguments are not JSON: {error}") from error
        if not isinstance(arguments, dict):
            raise ValueError("tool call arguments are a JSON object")
        return arguments


class EarlierCall(BaseModel):
    id: Optional[str] = None
    type: str = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    role: Role
    content: Optional[Union[str, list[dict[str, Any]]]] = Field(
        None, description="text, or a list of text parts (none: an assistant's message of tool calls)"
    )
    tool_calls: Optional[list[EarlierCall]] = Field(None, description="an assistant's earlier calls")
    tool_call_id: Optional[str] = Field(None, description="a tool message's: the call it answers")
    name: Optional[str] = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        if isinstance(content, list):
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
        return content

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("content", "a message needs content (or an assistant's tool_calls)", {})
        return self

    def text(self) -> str:
        """Text parts are joined by newlines, as vLLM does."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part["text"] for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it: tool calls' arguments as objects (templates
        write them with `tojson`), a tool result with its call's id."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        for field in ("tool_call_id", "name"):
            if getattr(self, field) is not None:
                message[field] = getattr(self, field)
        return message
