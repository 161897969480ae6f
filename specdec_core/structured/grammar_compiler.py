"""Grammars compiled by llguidance for one tokenizer, cached across requests: each constraint is
compiled (and checked) once into a matcher, which every request copies. llguidance rather than
xgrammar: both roll back committed tokens, but xgrammar needs triton, where llguidance has no
dependency and computes each mask on demand."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import any_to_lark

from ..api.errors import SpecdecError
from .constraint_spec import StructuredOutput
from .grammar_state import GrammarState

CACHED_GRAMMARS = 256


def llguidance_grammar(spec: StructuredOutput) -> str:
    """The constraint as an llguidance grammar."""
    if spec.json_schema is not None or spec.json_object:
        schema = spec.json_schema if spec.json_schema is not None else {"type": "object"}
        options = {"whitespace_flexible": not spec.disable_any_whitespace}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(text) for text in spec.choice))
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int):
        """`vocab_size`: the model's rows, which may exceed the tokenizer's (padding: never allowed)."""
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self.compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def state(self, spec: StructuredOutput) -> GrammarState:
        """`spec`'s grammar at the output's start, on this vocabulary."""
        return GrammarState(self.matcher(spec), self.vocab_size)

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher of `spec` at the output's start; SpecdecError (a 400) if it does not compile."""
        key = spec.model_dump_json()
        if key not in self.compiled:
            try:
                grammar = llguidance_grammar(spec)
            except ValueError as error:
                raise SpecdecError(f"structured_output: {error}", "structured_output") from error
            compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise SpecdecError(f"structured_output: {compiled.get_error()}", "structured_output")
            self.compiled[key] = compiled
            if len(self.compiled) > CACHED_GRAMMARS:
                self.compiled.popitem(last=False)
        self.compiled.move_to_end(key)
        return self.compiled[key].deep_copy()
