"""Benchmark questions: Spec-Bench ships with the package (specdec_core/data/spec_bench)."""

from __future__ import annotations

import json
from collections import defaultdict
from importlib import resources
from pathlib import Path

DEFAULT_QUESTIONS = Path(str(resources.files("specdec_core") / "data" / "spec_bench" / "question.jsonl"))


def load_questions(path: Path, categories: list[str], per_category: int) -> list[dict]:
    """The first `per_category` questions of each wanted category (`["all"]`: every category)."""
    if not path.exists():
        raise FileNotFoundError(f"questions file not found: {path}")
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    available = sorted({q["category"] for q in questions})
    wanted = available if categories == ["all"] else categories
    unknown = sorted(set(wanted) - set(available))
    if unknown:
        raise ValueError(f"unknown categories {unknown}; available: {available}")
    taken: dict[str, int] = defaultdict(int)
    selected = []
    for question in questions:
        if question["category"] in wanted and taken[question["category"]] < per_category:
            taken[question["category"]] += 1
            selected.append(question)
    return selected


def first_turn(question: dict) -> list[dict[str, str]]:
    """The chat messages of a question's first turn."""
    return [{"role": "user", "content": question["turns"][0]}]
