"""tools/gpu_report.py on the CPU: without CUDA it says what it skips; on small models with
--device cpu it runs every section that needs no GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from typer.testing import CliRunner

from specdec_core.tools.cli import app


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tiny_llama(num_layers=2).config.save_pretrained(folder)
    return f"random:{folder / 'config.json'}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a machine without CUDA gets")
def test_without_cuda_it_names_what_it_skips():
    result = CliRunner().invoke(app, ["gpu-report"])
    assert result.exit_code == 0, result.output
    assert "| device |" in result.output and "skipped: the GPU tests and the engine at real shapes" in result.output


def test_small_models_on_the_cpu_fill_every_table(tiny_source, tmp_path):
    out = tmp_path / "report.md"
    options = ["--target", tiny_source, "--draft", tiny_source, "--device", "cpu", "--dtype", "float32"]
    options += ["--concurrency", "1,3", "--prompt-tokens", "16", "--max-tokens", "6", "--out", str(out)]
    result = CliRunner().invoke(app, ["gpu-report", *options])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    decode_rows = [line for line in text.splitlines() if line.startswith(("| target |", "| greedy+"))]
    assert len(decode_rows) == 6  # 3 methods x 2 concurrencies
    # greedy speculation in fp32 on the CPU: every output is target-only's
    assert all(row.rstrip(" |").endswith(("1/1", "3/3")) for row in decode_rows)
    assert "| rows | ops | attention_ops |" in text
    assert "| tokens | ms_p50 | vs_one_token |" in text and "the drafters' `verify_cost` on this device: [" in text
    # the second prompt's shared 1,500 tokens are 93 full blocks of the prefix cache
    assert "of another that shares its first 1500 tokens" in text and "hits: 1488 of 1529 tokens" in text
