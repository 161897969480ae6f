"""vLLM's `/tokenize` and `/detokenize`: a text or a chat as the engine encodes it (its chat
template, its special tokens), and token ids as text. Agent frameworks and gateways call them to
count and cut prompts before they send them."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from specdec_core.api.errors import SpecdecError, check_token_ids
from specdec_core.loop.frontend import Frontend

from .chat_messages import ChatMessage
from .tool_calls import Tool, template_tools


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    tools: Optional[list[Tool]] = Field(None, description="with messages: the functions the template shows")
    add_special_tokens: Optional[StrictBool] = Field(None, description="default: true for a prompt, false for a chat")
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("prompt", "send a prompt or messages", {"param": "prompt"})
        if self.tools is not None and self.messages is None:
            raise PydanticCustomError("tools", "tools go with messages", {"param": "tools"})
        return self

    def reply(self, frontend: Frontend) -> dict[str, Any]:
        messages = None if self.messages is None else [message.for_template() for message in self.messages]
        tools = template_tools(self.tools)
        tokens = frontend.tokenize(self.prompt, messages, self.add_special_tokens, self.add_generation_prompt, tools)
        strings = frontend.tokenizer.convert_ids_to_tokens(tokens) if self.return_token_strs else None
        return {"count": len(tokens), "max_model_len": frontend.max_positions, "tokens": tokens, "token_strs": strings}


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    tokens: list[int]

    def reply(self, frontend: Frontend) -> dict[str, Any]:
        if frontend.tokenizer is None:
            raise SpecdecError("this engine has no tokenizer", "tokens")
        check_token_ids(self.tokens, frontend.vocab_size, "tokens")
        return {"prompt": frontend.decode(self.tokens)}
