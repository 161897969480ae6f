"""tools/gpu_report.py on the CPU: without CUDA it says what it skips; on small models with
--device cpu it runs every section that needs no GPU."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from specdec_core.tools.cli_app import app

from helpers.tiny_models import tiny_llama


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tiny_llama(num_layers=3).config.save_pretrained(folder)  # a random EAGLE-3 layer reads 2, 1 and 0
    return f"random:{folder / 'config.json'}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a machine without CUDA gets")
def test_without_cuda_it_names_what_it_skips():
    result = CliRunner().invoke(app, ["gpu-report"])
    assert result.exit_code == 0, result.output
    assert "| device |" in result.output and "skipped: the GPU tests and the engine at real shapes" in result.output


def test_small_models_on_the_cpu_fill_every_table(tiny_source, tmp_path):
    out = tmp_path / "report.md"
    options = ["--target", tiny_source, "--draft", tiny_source, "--device", "cpu", "--dtype", "float32"]
    options += ["--concurrency", "1,3", "--prompt-tokens", "16", "--max-tokens", "12", "--out", str(out)]
    result = CliRunner().invoke(app, ["gpu-report", *options])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    lines = text.splitlines()
    columns = [cell.strip() for cell in next(line for line in lines if line.startswith("| steps |")).split("|")]
    decode_rows = [dict(zip(columns, line.split("|"))) for line in lines if line.startswith("| eager |")]
    # target, greedy+model, its 4 fixed acceptance lengths and greedy+eagle3@3 x 2 concurrencies (eager)
    assert [row["method"].strip() for row in decode_rows].count("greedy+eagle3@3") == 2 and len(decode_rows) == 14
    for row in decode_rows:
        # greedy speculation in fp32 on the CPU: every output is target-only's; the recorded
        # continuation keeps a - 1 drafts a step (12 tokens: every step whole)
        assert row["same as target"].strip() in ("1/1", "3/3")
        method = row["method"].strip()
        if method == "target" or "@" in method:
            assert float(row["accept len"]) == (float(method.partition("@")[2]) if "@" in method else 1.0)
    assert "| rows | ops | attention_ops |" in text
    assert "| tokens | ms_p50 | vs_one_token |" in text and "the drafters' `verify_cost` on this device: [" in text
    # the second prompt's shared 1,500 tokens are 93 full blocks of the prefix cache
    assert "of another that shares its first 1500 tokens" in text and "hits: 1488 of 1529 tokens" in text


def test_a_fixed_acceptance_method_needs_the_recording_run_first(tiny_source):
    options = ["--target", tiny_source, "--draft", tiny_source, "--device", "cpu", "--methods"]
    wide = {"COLUMNS": "300", "TERMINAL_WIDTH": "300"}  # the error box's message on one line
    result = CliRunner().invoke(app, ["gpu-report", *options, "greedy+model@2"], env=wide)
    assert result.exit_code == 2 and "needs greedy+model before it" in result.output
    result = CliRunner().invoke(app, ["gpu-report", *options, "target,greedy+model,greedy+pld@2"], env=wide)
    assert result.exit_code == 2 and "greedy+model@<acceptance length>" in result.output
    result = CliRunner().invoke(app, ["gpu-report", *options, "greedy+model,greedy+model@0"], env=wide)
    assert result.exit_code == 2 and "is 1 to K + 1 = 5" in result.output


def test_settings_a_model_refuses_are_a_usage_error_not_a_traceback(tiny_source):
    wide = {"COLUMNS": "300", "TERMINAL_WIDTH": "300"}
    options = ["--target", tiny_source, "--draft", tiny_source, "--device", "cpu", "--compile", "--compile-layers"]
    result = CliRunner().invoke(app, ["gpu-report", *options], env=wide)
    assert result.exit_code == 2 and "not both" in result.output


def test_at_a_temperature_every_method_samples_and_is_verified_by_rejection(tiny_source, tmp_path):
    out = tmp_path / "report.md"
    options = ["--target", tiny_source, "--draft", tiny_source, "--device", "cpu", "--dtype", "float32"]
    options += ["--concurrency", "2", "--prompt-tokens", "16", "--max-tokens", "8", "--out", str(out)]
    options += ["--methods", "target,greedy+model", "--temperature", "0.8"]
    result = CliRunner().invoke(app, ["gpu-report", *options])
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    columns = [cell.strip() for cell in next(line for line in lines if line.startswith("| steps |")).split("|")]
    decode_rows = [dict(zip(columns, line.split("|"))) for line in lines if line.startswith("| eager |")]
    assert [row["method"].strip() for row in decode_rows] == ["target", "rejection+model"]
    assert all(row["same as target"].strip() == "-" for row in decode_rows)  # sampled outputs differ by drafter
    assert "verified by rejection sampling" in out.read_text()
    wide = {"COLUMNS": "300", "TERMINAL_WIDTH": "300"}
    fixed = ["--methods", "target,greedy+model,greedy+model@2", "--temperature", "0.8"]
    refused = CliRunner().invoke(app, ["gpu-report", *options[:8], *fixed], env=wide)
    assert refused.exit_code == 2 and "needs --temperature 0" in refused.output
