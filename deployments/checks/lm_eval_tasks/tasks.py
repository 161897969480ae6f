"""lm-evaluation-harness tasks over data this package ships, for `specdec clients-check` and for
anyone's own `lm_eval --include_path <this directory>`:

- `specdec_gsm8k` (generate_until): Spec-Bench's `math_reasoning` questions (GSM8K's), asked as
  `specdec bench` asks them (the question alone as the user turn, up to 128 new tokens, no stop
  string) and graded by the bench's own rule (tools/grading.py), so that its accuracy is the
  bench's on the same questions;
- `specdec_mc` (multiple_choice, lm-eval's log-likelihood path): 40 general-knowledge questions
  with four choices each, written for this check."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

from specdec_core.calibration.questions import DEFAULT_QUESTIONS, load_questions
from specdec_core.tools.benchmarks.grading import gsm8k_correct

MC_FILE = Path(__file__).with_name("specdec_mc.jsonl")


def gsm8k_questions(**_) -> dict[str, datasets.Dataset]:
    questions = load_questions(DEFAULT_QUESTIONS, ["math_reasoning"], per_category=1 << 20)
    rows = [{"question": q["turns"][0], "reference": q["reference"][0]} for q in questions]
    return {"test": datasets.Dataset.from_list(rows)}


def grade_gsm8k(doc: dict, results: list[str]) -> dict[str, float]:
    return {"accuracy": float(gsm8k_correct(results[0], doc["reference"]))}


def mc_questions(**_) -> dict[str, datasets.Dataset]:
    rows = [json.loads(line) for line in MC_FILE.read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
