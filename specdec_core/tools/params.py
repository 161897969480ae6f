"""Command-line settings as text: `key=value` pairs and comma lists whose items may hold commas
inside brackets (a bench method's own parameters, a JSON list)."""

from __future__ import annotations

import json
from typing import Any

OPENING, CLOSING = "([{", ")]}"


def parse_value(text: str) -> Any:
    """`k=v` values: JSON when it parses (numbers, bools, lists, strings in quotes), `inf`, else text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return float(text)
        except ValueError:
            return text


def parse_params(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs -> {key: value}; raises ValueError naming a pair without `=`."""
    params = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"expected key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        params[key.strip()] = parse_value(value.strip())
    return params


def split_top_level(text: str, separator: str = ",") -> list[str]:
    """`text` split at each `separator` outside brackets and quotes; empty items dropped."""
    items, current, depth, quoted = [], [], 0, False
    for char in text:
        if char == '"':
            quoted = not quoted
        elif not quoted and char in OPENING:
            depth += 1
        elif not quoted and char in CLOSING:
            depth -= 1
        if char == separator and depth == 0 and not quoted:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]
