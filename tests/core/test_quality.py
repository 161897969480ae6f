"""Quality measurement: the bench's answer checks (GSM8K final numbers, HumanEval executed in a
sandboxed child) and EASD's default threshold, the target's own calibration (calibration/target_profile.py)."""

from __future__ import annotations

import json
import math
from decimal import Decimal

import pytest
import torch

from specdec_core.calibration.questions import DEFAULT_QUESTIONS, HUMANEVAL, load_questions
from specdec_core.tools.benchmarks.grading import Grader, check_humaneval, extract_code, final_number, gsm8k_correct


@pytest.mark.parametrize(
    "text, number",
    [
        ("So she earns 18 dollars a day.", "18"),
        ("The total is $1,250.", "1250"),
        ("He pays $400 for supplies and 50% more, so 600 + 400 = 1000", "1000"),
        ("It drops to -3 degrees.", "-3"),
        ("Each costs 2.50, so the answer is 7.5.", "7.5"),
        ("#### 72\nThat is my final answer after 3 checks.", "72"),
        ("The answer is 1,000,000", "1000000"),
        ("No numbers here.", None),
    ],
)
def test_gsm8k_final_number(text, number):
    assert final_number(text) == (Decimal(number) if number else None)


def test_gsm8k_answers_compare_by_value_with_the_reference():
    reference = "He pays 400*.5=$<<400*.5=200>>200 more\nSo it cost 600+400=$<<600+400=1000>>1000.\n#### 1000"
    assert gsm8k_correct("Travel costs $1,000.", reference)
    assert gsm8k_correct("so 1000.00", reference)
    assert not gsm8k_correct("It costs 1000 dollars, or 999 after the discount", reference)
    assert not gsm8k_correct("I don't know.", reference)
    grade = Grader()
    question = load_questions(DEFAULT_QUESTIONS, ["math_reasoning"], 1)[0]
    assert grade(question, "The answer is 1000.") is True and grade(question, "It is 600.") is False
    summarization = {"category": "summarization", "turns": ["..."], "reference": ["a summary"]}
    assert grade(summarization, "anything") is None  # no checkable answer


@pytest.fixture(scope="module")
def humaneval_problem():
    questions = load_questions(HUMANEVAL, ["all"], 200)
    assert len(questions) == 164 and questions[0]["category"] == HUMANEVAL
    return questions[0]["humaneval"]  # has_close_elements


def test_humaneval_checks_pass_a_canonical_solution_and_fail_a_wrong_one(humaneval_problem):
    assert check_humaneval(humaneval_problem, humaneval_problem["canonical_solution"]) == "passed"
    assert check_humaneval(humaneval_problem, "    return False\n").startswith("failed")
    syntax_error = check_humaneval(humaneval_problem, "    return (\n")
    assert syntax_error.startswith("failed")


def test_humaneval_stops_a_solution_that_loops_forever(humaneval_problem):
    assert check_humaneval(humaneval_problem, "    while True:\n        pass\n", timeout_s=1.0) == "timed out"


def test_humaneval_check_has_no_network(humaneval_problem):
    reach_out = "    import socket\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n    return True\n"
    assert check_humaneval(humaneval_problem, reach_out).startswith("failed")


def test_code_is_taken_from_a_chat_answer(humaneval_problem):
    entry_point = humaneval_problem["entry_point"]
    body = (
        f"def {entry_point}(numbers, threshold):\n"
        "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
    )
    answer = f"Here is the function:\n```python\nimport math\n\n{body}```\nIt compares every pair."
    completion = extract_code(answer, entry_point)
    assert completion.startswith("\n") and f"def {entry_point}" in completion and "compares" not in completion
    assert check_humaneval(humaneval_problem, completion) == "passed"
    truncated = f"```python\n{body}"  # the answer ran out of tokens before the closing fence
    assert check_humaneval(humaneval_problem, extract_code(truncated, entry_point)) == "passed"
    grade = Grader()
    question = {"category": HUMANEVAL, "humaneval": humaneval_problem}
    assert grade(question, answer) is True and grade(question, answer) is True
    assert len(grade.verdicts) == 1  # the same code is checked once


# ---------------------------------------------------------------- EASD's default threshold


@pytest.mark.needs_smollm2  # SmolLM2's tokenizer and chat template build the calibration prompts
def test_easd_without_tau_h_uses_the_targets_calibrated_value_cached_per_model(tmp_path, monkeypatch):
    import specdec_core.calibration.target_profile as profile_module
    from specdec_core import GenerationRequest, ModelSpec, SpeculativeEngine
    from specdec_core.calibration.profile_types import CalibrationSettings
    from specdec_core.calibration.target_profile import calibration_prompts
    from specdec_core.models.loader import load_tokenizer
    from specdec_core.policies.easd import calibrate_tau_h

    from helpers.tiny_models import tiny_llama

    tokenizer = load_tokenizer(ModelSpec())
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    model = tiny_llama(seed=5, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    spec = ModelSpec(source=str(tmp_path / "target"))

    engine = SpeculativeEngine.from_specs(spec)
    settings = CalibrationSettings()
    entropies = []  # the paper's rule, computed directly: transformers' own greedy generate
    with torch.no_grad():
        for prompt_ids in calibration_prompts(engine.frontend, settings):
            ids = torch.tensor([list(prompt_ids)])
            generated = engine.target_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=settings.max_new_tokens,
                eos_token_id=sorted(engine.frontend.eos_ids),
                pad_token_id=tokenizer.eos_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
            for step_logits in generated.logits:  # the raw logits of each step, the last one's EOS included
                logits = step_logits[0].float()
                entropies.append(float(-(logits.softmax(-1) * logits.log_softmax(-1)).sum()))
    expected = calibrate_tau_h(torch.tensor(entropies), settings.top_fraction)

    messages, sampling = [{"role": "user", "content": "hi"}], {"max_tokens": 4}
    request = GenerationRequest(messages=messages, sampling=sampling, policy={"name": "easd"})
    metrics = engine.complete(request).metrics
    assert metrics["policy"]["name"] == "easd"
    assert metrics["policy"]["params"]["tau_h"] == pytest.approx(expected, abs=1e-4)
    cached = list((tmp_path / "cache" / "profiles").glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["num_entropies"] == len(entropies)

    def measure_again(*args, **kwargs):
        raise AssertionError("the second load must read the cached profile")

    monkeypatch.setattr(profile_module, "measure_profile", measure_again)
    again = SpeculativeEngine.from_specs(spec)
    assert again.complete(request).metrics["policy"]["params"]["tau_h"] == metrics["policy"]["params"]["tau_h"]
    explicit = GenerationRequest(
        messages=messages, sampling=sampling, policy={"name": "easd", "params": {"tau_h": math.inf}}
    )
    assert again.complete(explicit).metrics["policy"]["params"]["tau_h"] == "Infinity"  # JSON has no inf
