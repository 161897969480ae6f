"""OpenAI's function tools on chat completions, served as vLLM serves them. The tools go to the
chat template. `tool_choice` picks how the answer calls them:
- a named function: the grammar writes that function's arguments (its `parameters` schema), and
  the answer is one call of it;
- `"required"`: the grammar writes a JSON array of at least one `{"name", "parameters"}` call
  of the given tools;
- `"auto"` (the default with tools): the model writes freely, and its family's parser
  (tool_parsers.py) finds the calls in its text; a model without one gets a 400;
- `"none"`: plain text, the tools still shown to the model.
The answer's message carries `tool_calls` (its arguments as JSON text), and `finish_reason` is
`tool_calls` where the model chose to call (`auto`, `required`), `stop` for a named function
(OpenAI's)."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from specdec_core.api.errors import SpecdecError
from specdec_core.structured.constraint_spec import StructuredOutput

from .tool_parsers import PARSERS, ParsedCall, ParsedOutput, parser_for, settled_content


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON schema; none: no arguments")
    strict: Optional[bool] = None  # the schema is always enforced where the grammar writes the call


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


def template_tools(tools: Optional[list[Tool]]) -> Optional[list[dict[str, Any]]]:
    """The tools as the chat template reads them (transformers' `tools`)."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]
NO_ARGUMENTS = {"type": "object", "properties": {}}


class ToolFields(BaseModel):
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: bool = Field(True, description="false: at most one call an answer")

    @model_validator(mode="after")
    def _choice_among_tools(self):
        mode = self.tool_mode
        if mode in ("named", "required") and not self.tools:
            raise PydanticCustomError("tools", f"tool_choice {mode} needs tools", {"param": "tool_choice"})
        if mode == "named" and self.tool_choice.function.name not in self.tool_names:
            message = f"tool_choice names {self.tool_choice.function.name!r}, not among the tools"
            raise PydanticCustomError("tools", message, {"param": "tool_choice"})
        if len(set(self.tool_names)) != len(self.tool_names):
            raise PydanticCustomError("tools", "tools must have distinct names", {"param": "tools"})
        return self

    @property
    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or ()]

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named (OpenAI's default: auto with tools, none without)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if not self.tools and self.tool_choice in (None, "auto"):
            return "none"  # nothing to call: plain text, as OpenAI answers
        return self.tool_choice or "auto"

    def tool_definitions(self) -> Optional[list[dict[str, Any]]]:
        return template_tools(self.tools)

    def tool_grammar(self) -> Optional[StructuredOutput]:
        """What the grammar writes for a named or required tool choice (None: the model is free)."""
        parameters = {tool.function.name: tool.function.parameters or NO_ARGUMENTS for tool in self.tools or ()}
        # compact JSON (no whitespace between tokens, vLLM's disable_any_whitespace): a grammar
        # free in whitespace lets a model pad its call until max_tokens
        if self.tool_mode == "named":
            return StructuredOutput(json_schema=parameters[self.tool_choice.function.name], disable_any_whitespace=True)
        if self.tool_mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,  # a call is its name and its arguments
            }
            for name, schema in parameters.items()
        ]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel_tool_calls:
            array["maxItems"] = 1
        return StructuredOutput(json_schema=array, disable_any_whitespace=True)

    def parsed_tool_calls(self, text: str, parser: Optional[str]) -> ParsedOutput:
        """The answer's content and calls, by the request's tool choice (`parser`: the model's,
        for auto)."""
        mode = self.tool_mode
        if mode == "named":
            return ParsedOutput(None, [ParsedCall(self.tool_choice.function.name, text)])
        if mode == "required":
            try:
                calls = json.loads(text)
            except (ValueError, RecursionError):  # cut off by max_tokens: no whole call to give
                return ParsedOutput(text, [])
            calls = [ParsedCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in calls]
            return ParsedOutput(None, calls)
        if mode == "auto" and parser is not None:
            parsed = PARSERS[parser].parse(text)
            return parsed if self.parallel_tool_calls else ParsedOutput(parsed.content, parsed.calls[:1])
        return ParsedOutput(text, [])

    def finish_reason(self, parsed: ParsedOutput, engine_reason: Optional[str]) -> Optional[str]:
        """`tool_calls` where the model chose to call; a named call ends as the engine says."""
        return "tool_calls" if parsed.calls and self.tool_mode != "named" else engine_reason


def auto_tool_parser(request: ToolFields, frontend: Any) -> Optional[str]:
    """The parser of a chat whose tool choice is auto: its model's (tool_parsers.py), or a 400
    naming the model's family where its chat template shows no format specdec parses. A parser
    whose tags may be special tokens has the request keep them in its text (vLLM's)."""
    if request.tool_mode != "auto":
        return None
    if frontend.tokenizer is None:
        raise SpecdecError('tool_choice "auto" reads the model\'s text: this engine has no tokenizer', "tool_choice")
    parser = parser_for(frontend.tokenizer.chat_template)
    if parser is None:
        message = (
            f'tool_choice "auto" needs a tool-call parser: the chat template of this {frontend.model_family} model '
            "shows neither Llama 3.x's nor Hermes' tool-call format; name a function in tool_choice, "
            'or use "required"'
        )
        raise SpecdecError(message, "tool_choice")
    if PARSERS[parser].keeps_special_tokens:  # the parser's tags are in the text it reads
        request.skip_special_tokens = False
    return parser


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def openai_call(call: ParsedCall) -> dict[str, Any]:
    """OpenAI's tool call object, a fresh id."""
    return {"id": call_id(), "type": "function", "function": vars(call)}


def tool_call_message(parsed: ParsedOutput) -> dict[str, Any]:
    """OpenAI's assistant message of a parsed answer (content null beside calls, as OpenAI's)."""
    calls = [openai_call(call) for call in parsed.calls]
    return {"role": "assistant", "content": parsed.content, **({"tool_calls": calls} if calls else {})}


class ToolCallStream:
    """One streamed choice's text as OpenAI's deltas under a tool choice: a named call's
    arguments as they come; otherwise content while it is content for sure (settled_content),
    and at the end, the calls found in the whole answer."""

    def __init__(self, fields: ToolFields, parser: Optional[str]):
        self.fields, self.parser = fields, parser
        self.text, self.sent = "", 0  # the answer so far, and how much of it went out
        self.named_head_sent = False

    def delta(self, piece: str, engine_reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """The delta of the next `piece` of text, and the choice's finish reason (None: going on)."""
        self.text += piece
        if self.fields.tool_mode == "named":
            call: dict[str, Any] = {"index": 0, "function": {"arguments": self.text[self.sent :]}}
            if not self.named_head_sent:
                call.update(id=call_id(), type="function")
                call["function"]["name"] = self.fields.tool_choice.function.name
                self.named_head_sent = True
            self.sent = len(self.text)
            return {"tool_calls": [call]}, engine_reason
        if engine_reason is None:
            held = 0 if self.fields.tool_mode == "required" else settled_content(self.parser, self.text)
            return self.content_to(max(held, self.sent)), None
        parsed = self.fields.parsed_tool_calls(self.text, self.parser)
        if not parsed.calls:
            return self.content_to(len(self.text)), engine_reason
        # the content before the calls that this last piece brought (Hermes' text before its tag)
        content = self.content_to(max(self.sent, settled_content(self.parser, self.text))) if parsed.content else {}
        calls = [{"index": index, **openai_call(call)} for index, call in enumerate(parsed.calls)]
        return {**content, "tool_calls": calls}, self.fields.finish_reason(parsed, engine_reason)

    def content_to(self, end: int) -> dict[str, Any]:
        content, self.sent = self.text[self.sent : end], end
        return {"content": content} if content else {}
