"""The embedded default (real SmolLM2-135M-Instruct weights): greedy identity, the CLI and the
benchmark command end to end."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from specdec_core import GenerationRequest
from specdec_core.drafters import make_drafter, validate_drafter
from specdec_core.tools.cli_app import app

pytestmark = pytest.mark.needs_smollm2

PROMPTS = [
    "Repeat this sentence twice: the cat sat on the mat.",
    "List the planets of the solar system.",
    "Write a Python function that returns the sum of a list.",
]


# the draft's prices, fixed: by default they are this machine's (draft_costs.py), and a slow
# draft may rightly not be used at all
FIXED_PRICES = {"draft_cost": 0.5, "prefill_cost": 0.0}


@pytest.mark.parametrize("drafter", ["pld", "model", "mla", "heads"])
def test_greedy_speculation_is_identical_to_target_only_on_smollm2(smol_engine, drafter):
    num_accepted = 0
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        reference = smol_engine.complete(
            GenerationRequest(messages=messages, drafter={"name": "none"}, sampling={"max_tokens": 48})
        )
        speculative = smol_engine.complete(
            GenerationRequest(
                messages=messages,
                drafter={"name": drafter, "params": FIXED_PRICES if drafter in ("model", "mla") else {}},
                sampling={"max_tokens": 48},
                num_draft_tokens=6,
            )
        )
        assert speculative.token_ids == reference.token_ids
        assert speculative.text == reference.text and reference.text.strip()
        num_accepted += speculative.metrics["spec_decode_num_accepted_tokens"]
    # each drafter earns something over the prompts (not each prompt: pld finds no repeat in the
    # planets' list); for heads this checks that the shipped heads load by default
    assert num_accepted > 0


def test_stop_strings_truncate_text_and_stream_consistently(smol_engine):
    request = GenerationRequest(
        messages=[{"role": "user", "content": PROMPTS[1]}], sampling={"max_tokens": 64}, drafter={"name": "pld"}
    )
    full = smol_engine.complete(request).text
    stop = full.split()[3]
    request.sampling.stop = [stop]
    chunks = list(smol_engine.stream(request))
    text = "".join(chunk.text for chunk in chunks)
    assert text == full[: full.index(stop)]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].metrics is not None


def test_cli_generate_prints_text_and_metrics():
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "-p",
            PROMPTS[0],
            "--max-tokens",
            "16",
            "--drafter",
            "pld",
            "--policy",
            "fly",
            "--policy-param",
            "theta=0.5",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "mean_accept_len=" in result.output and "tokens=" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--policy", "ears", "--policy-param", "beta=-1"], "beta"),
        (["-k", "0"], "num_draft_tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--drafter", "nope"], "unknown drafter"),
        (["--policy-param", "novalue"], "expected key=value"),
    ],
)
def test_cli_rejects_bad_input_with_a_clear_message(args, message):
    result = CliRunner().invoke(app, ["generate", "-p", "hi", "--max-tokens", "4", *args])
    assert result.exit_code != 0
    assert message in result.output


def test_cli_rejects_empty_prompt():
    result = CliRunner().invoke(app, ["generate", "-p", "", "--no-chat"])
    assert result.exit_code == 2 and "must not be empty" in result.output


def test_bench_writes_json_and_plot(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--methods",
            "target,hf:prompt_lookup,hf:assisted,specdec:greedy+pld,specdec:fly+mla(draft_cost=0.5,prefill_cost=0)",
            "--categories",
            "summarization,math_reasoning",
            "--per-category",
            "1",
            "--max-new-tokens",
            "12",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 0
    rows = {(row["method"], row["category"]): row for row in report["results"]}
    assert len(rows) == 5 * 3
    keys = {
        "method",
        "category",
        "questions",
        "new_tokens",
        "tok_per_s",
        "speedup",
        "mean_accept_len",
        "identical_to_target",
        "target_nll",
        "verify_ms_p50",
    }
    assert all(keys <= set(row) for row in report["results"])
    assert rows[("target", "overall")]["speedup"] == 1.0
    assert rows[("specdec:greedy+pld", "overall")]["identical_to_target"] == 1.0
    assert rows[("hf:prompt_lookup", "overall")]["identical_to_target"] == 1.0
    fly = rows[("specdec:fly+mla(draft_cost=0.5,prefill_cost=0)", "overall")]
    assert fly["mean_accept_len"] > 2.0 and "loose" in fly  # mla drafts get accepted; FLy counts loose ones
    assert "loose" not in rows[("specdec:greedy+pld", "overall")]
    assert report["config"]["max_new_tokens"] == 12
    outputs = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert len(outputs) == 5 * 2 and {"prompt_ids", "token_ids", "seconds", "prefill_ms", "correct"} <= set(outputs[0])
    # GSM8K answers are checked (12 tokens rarely reach the answer: correct or not, but graded)
    assert rows[("target", "math_reasoning")]["accuracy"] in (0.0, 1.0)
    assert rows[("target", "summarization")]["accuracy"] is None
    assert (tmp_path / "quality.png").stat().st_size > 0
    ceiling = CliRunner().invoke(app, ["lookup-ceiling", str(tmp_path)])
    assert ceiling.exit_code == 0, ceiling.output
    assert "ngram_oracle_decode" in ceiling.output and "overall" in ceiling.output


def test_bench_runs_humaneval_with_its_execution_checks(tmp_path):
    methods = 'target,specdec:dropmatch(criteria=["naive"],dropout=0.2)+pld'
    args = ["bench", "--questions", "humaneval", "--per-category", "2", "--max-new-tokens", "8", "--methods", methods]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = {
        (row["method"], row["category"]): row for row in json.loads((tmp_path / "bench.json").read_text())["results"]
    }
    assert rows[("target", "humaneval")]["questions"] == 2
    assert rows[("target", "humaneval")]["correct"] == 0  # 8 tokens cannot complete a function
    assert "loose" in rows[('specdec:dropmatch(criteria=["naive"],dropout=0.2)+pld', "overall")]


def test_quality_compares_each_lossy_policy_with_its_lossless_base(tmp_path):
    args = [
        "quality",
        "--sets",
        "gsm8k",
        "--questions",
        "1",
        "--max-new-tokens",
        "8",
        "-k",
        "4",
        "--out",
        str(tmp_path),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "quality.json").read_text())["rows"]
    by_method = {(row["T"], row["method"]): row for row in rows}
    assert set(by_method) == {
        *(
            (0.0, method)
            for method in ("target", *(f"specdec:{name}+mla@4" for name in ("greedy", "easd", "dropmatch", "fly")))
        ),
        *(
            (0.9, method)
            for method in ("target", *(f"specdec:{name}+mla@4" for name in ("rejection", "ears", "typical")))
        ),
    }
    greedy, fly = by_method[(0.0, "specdec:greedy+mla@4")], by_method[(0.0, "specdec:fly+mla@4")]
    assert greedy["identical_to_target"] == 1.0 and greedy["nll_change_pct"] is None  # the base itself
    assert fly["nll_change_pct"] is not None and fly["correct_change"] is not None
    assert "loose" in fly["counters"] and "pardoned" in by_method[(0.9, "specdec:ears+mla@4")]["counters"]
    assert (tmp_path / "gsm8k-T0" / "bench.json").exists() and (tmp_path / "gsm8k-T0.9" / "quality.png").exists()
    assert "| gsm8k | 0 | specdec:fly+mla@4 |" in (tmp_path / "quality.md").read_text()


def test_lookup_ceiling_needs_a_greedy_bench_run(tmp_path):
    result = CliRunner().invoke(app, ["lookup-ceiling", str(tmp_path)])
    assert result.exit_code == 2 and "cannot read a bench run" in result.output
    (tmp_path / "bench.json").write_text(json.dumps({"config": {"temperature": 0.9}}))
    (tmp_path / "outputs.jsonl").write_text("")
    result = CliRunner().invoke(app, ["lookup-ceiling", str(tmp_path)])
    assert result.exit_code == 2 and "temperature 0" in result.output
    config = {
        "temperature": 0,
        "pld_max_ngram": 3,
        "pld_min_ngram": 1,
        "pld_tokens": 10,
        "drafter_params": {},
        "num_draft_tokens": 10,
    }
    (tmp_path / "bench.json").write_text(json.dumps({"config": config}))
    result = CliRunner().invoke(app, ["lookup-ceiling", str(tmp_path)])
    assert result.exit_code == 2 and "no outputs" in result.output


def test_bench_rejects_unknown_category(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--categories", "poetry", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown categories" in result.output


def test_bench_endpoint_needs_the_serving_side(tmp_path):
    """specdec_core's own CLI has no HTTP client: `--endpoint` works through the console script."""
    result = CliRunner().invoke(app, ["bench", "--endpoint", "http://127.0.0.1:9", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "needs the serving side" in result.output


def test_verify_cost_prints_the_block_cost_curve():
    arguments = ["verify-cost", "--max-tokens", "3", "--repeats", "1", "--context", "40", "--batch-sizes", "2"]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, result.output
    rows = [
        line.split("│")[1:-1]
        for line in result.output.splitlines()
        if line.startswith("│") and line.split("│")[1].strip().isdigit()
    ]
    assert [int(cells[0]) for cells in rows] == [1, 2, 3]
    assert float(rows[0][2]) == 1.0 and float(rows[0][4]) == 1.0  # the one-token forward is the unit
    assert len(rows[0]) == 7 and all(float(cells[6]) > 0 for cells in rows)  # target_B2: ms, vs one token
    printed = re.search(r"verify_cost=(\[.*\])'", result.output)  # ready to pass to the drafters
    draft_cost = re.search(r"draft_cost=([0-9.]+)'", result.output)
    assert printed and draft_cost, result.output
    assert float(draft_cost.group(1)) == pytest.approx(float(rows[0][3]) / float(rows[0][1]), abs=1e-3)
    make_drafter("pld", {"verify_cost": json.loads(printed.group(1))})
    validate_drafter("model", {"verify_cost": json.loads(printed.group(1)), "draft_cost": float(draft_cost.group(1))})
    bad = CliRunner().invoke(app, ["verify-cost", "--max-tokens", "8", "--context", "4", "--draft", "none"])
    assert bad.exit_code == 2 and "--context" in bad.output


def test_train_heads_and_frontier_run_end_to_end(tmp_path):
    """`train-heads` on ShareGPT (two prompts, a few steps) writes heads that `frontier` searches
    trees for; the bank file's trees then run in the bench."""
    heads_dir = tmp_path / "heads"
    args = ["train-heads", "--out", str(heads_dir), "--prompts", "2", "--continuation-tokens", "8"]
    result = CliRunner().invoke(app, [*args, "--set", "steps=3", "--set", "batch_positions=8", "--set", "holdout=0"])
    assert result.exit_code == 0, result.output
    assert (heads_dir / "medusa_lm_head.pt").exists() and json.loads((heads_dir / "train_log.json").read_text())[
        "after"
    ]
    frontier_dir = tmp_path / "frontier"
    args = ["frontier", "--tasks", "qa", "--prompts", "1", "--max-new-tokens", "8", "--budget", "4", "--rerank", "2"]
    result = CliRunner().invoke(app, [*args, "--taus", "0.5", "--heads", str(heads_dir), "--out", str(frontier_dir)])
    assert result.exit_code == 0, result.output
    bank = json.loads((frontier_dir / "qa.json").read_text())
    assert [row["nodes"] for row in bank["frontier"]] == [1, 2, 3, 4] and bank["best"] in bank["trees"]
    assert (frontier_dir / "qa.png").stat().st_size > 0
    method = f"specdec:greedy+heads(tree={bank['best']})"
    args = [
        "bench",
        "--categories",
        "qa",
        "--per-category",
        "1",
        "--max-new-tokens",
        "8",
        "--methods",
        f"target,{method}",
    ]
    bank_args = ["--trees", str(frontier_dir / "qa.json"), "--heads", str(heads_dir)]
    result = CliRunner().invoke(app, [*args, *bank_args, "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row for row in json.loads((tmp_path / "b" / "bench.json").read_text())["results"]}
    assert rows[method]["identical_to_target"] == 1.0
