"""Tool calls in a model's free text (`tool_choice: "auto"`), one parser per model family's format,
as vLLM's `--tool-call-parser`: Llama 3.x's JSON (`llama3_json`) and Hermes' tags (`hermes`,
also Qwen 2.5/3's). A model's chat template shows which format it was trained on; a model
whose template shows neither has no parser, and `auto` is refused for it (a 400 naming its
family), while a named or `required` tool choice works for every model: the grammar writes
the calls."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Protocol, Union


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class ParsedOutput:
    content: Optional[str]  # the text beside the calls (None: nothing)
    calls: list[ParsedCall]


class ToolCallParser(Protocol):
    # its tags may be special tokens, which the output's text must then keep (vLLM's hermes parser)
    keeps_special_tokens: bool
    template_marks: tuple[str, ...]  # what a chat template holds when its model writes this format

    def parse(self, text: str) -> ParsedOutput: ...

    def settled(self, text: str) -> int:
        """How much of a streamed answer's `text` is content for sure (the rest may still become
        a call)."""
        ...


def json_call(text: str, argument_keys: tuple[str, ...]) -> Optional[ParsedCall]:
    """A call written as one JSON object `{"name": ..., <argument key>: {...}}`; None otherwise."""
    try:
        call = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = next((call[key] for key in argument_keys if key in call), {})
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(call["name"], json.dumps(arguments, ensure_ascii=False))


class Llama3JsonParser:
    """Llama 3.1-3.3's JSON tool calls: the answer is `{"name": ..., "parameters": {...}}` (or
    `arguments`), optionally after `<|python_tag|>`, several separated by `;`. Text that is not
    wholly such calls is content."""

    TAG = "<|python_tag|>"
    keeps_special_tokens = False  # its calls parse without the tag, and <|eom_id|> stays out
    template_marks = (TAG, "ipython")

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        calls = [json_call(part, ("parameters", "arguments")) for part in split_calls(body)]
        if not calls or None in calls:
            return ParsedOutput(text, [])
        return ParsedOutput(None, calls)

    def settled(self, text: str) -> int:
        """Nothing of an answer that starts as a call; all of any other."""
        body = text.lstrip()
        return 0 if body.startswith(("{", self.TAG)) or self.TAG.startswith(body) else len(text)


def split_calls(body: str) -> list[str]:
    """`{...}; {...}` as its JSON objects' texts (a `;` inside a string is not a separator)."""
    decoder, parts, index = json.JSONDecoder(), [], 0
    while index < len(body):
        try:
            _, end = decoder.raw_decode(body, index)
        except (ValueError, RecursionError):
            return [body]  # not JSON objects: json_call refuses it whole
        parts.append(body[index:end])
        index = end
        while index < len(body) and body[index] in " \n\t;":
            index += 1
    return parts


class HermesParser:
    """Hermes' tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the
    text before the first block is content. A block cut off at the end (max_tokens) counts if its
    JSON is whole."""

    TAG = "<tool_call>"
    keeps_special_tokens = True  # the tag is one in Hermes 2 Pro's vocabulary
    template_marks = (TAG,)
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.TAG)
        if start < 0:
            return ParsedOutput(text, [])
        calls = [json_call(block, ("arguments", "parameters")) for block in self.CALL.findall(text[start:])]
        if None in calls:
            return ParsedOutput(text, [])
        content = text[:start].strip()
        return ParsedOutput(content or None, calls)

    def settled(self, text: str) -> int:
        """The text before the first tag, a partial tag at its end held back."""
        start = text.find(self.TAG)
        if start >= 0:
            return start
        size = min(len(self.TAG) - 1, len(text))
        return len(text) - next((part for part in range(size, 0, -1) if text.endswith(self.TAG[:part])), 0)


# a chat template is matched against them in this order
PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}


def parser_for(chat_template: Union[str, dict[str, str], None]) -> Optional[str]:
    """The parser whose format `chat_template` shows (named templates: any of them), None where
    it shows none."""
    text = "\n".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template or ""
    return next((name for name, parser in PARSERS.items() if any(mark in text for mark in parser.template_marks)), None)


def settled_content(parser: Optional[str], text: str) -> int:
    """How much of a streamed answer's `text` is content for sure: all of it without a parser."""
    return len(text) if parser is None else PARSERS[parser].settled(text)
