"""tools/step_ops.py: the operations a verify step dispatches, counted."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from specdec_core.tools.cli_app import app
from specdec_core.tools.measuring.step_ops import OpCounter, count_step_ops

from helpers.tiny_models import tiny_llama


def test_the_counter_counts_each_dispatched_operation():
    with OpCounter() as counter:
        x = torch.ones(3)
        torch.nn.functional.scaled_dot_product_attention(x.view(1, 1, 1, 3), x.view(1, 1, 1, 3), x.view(1, 1, 1, 3))
        (x + x).sum()
    assert counter.ops["add"] == 1 and counter.ops["sum"] == 1 and counter.attention_ops >= 1


def test_a_step_calls_attention_once_per_layer_whatever_its_rows():
    """The issue's bar: the operations of a 64-row step are at most 1.5 times a 1-row step's."""
    model = tiny_llama(num_layers=3)
    counts = [count_step_ops(model, rows, tokens_per_row=5, history=16) for rows in (1, 4, 64)]
    assert [count["attention_ops"] for count in counts] == [3, 3, 3] and counts[0]["rows"] == 1
    assert counts[0]["ops"] < counts[2]["ops"] <= 1.5 * counts[0]["ops"]


def test_step_ops_command_prints_json(tmp_path):
    tiny_llama(num_layers=2).config.save_pretrained(tmp_path)
    source = f"random:{tmp_path / 'config.json'}"
    result = CliRunner().invoke(app, ["step-ops", "--model", source, "--rows", "1,2", "--history", "8", "--json"])
    assert result.exit_code == 0, result.output
    counts = json.loads(result.output.strip().splitlines()[-1])
    assert [count["rows"] for count in counts] == [1, 2] and counts[0]["attention_ops"] == 2


def test_compile_check_finds_one_graph_and_names_where_a_step_would_break(monkeypatch):
    """The step compiles as one graph on the CPU kernels too (the packed linears step aside
    under compile); a break in the attention is reported at its source line."""
    import specdec_core.runtime.ragged_attention as ragged_attention
    from specdec_core.tools.measuring.compile_check import explain_step

    report = explain_step(tiny_llama(num_layers=2), rows=3)
    assert (report["graphs"], report["graph_breaks"], report["breaks_by_line"]) == (1, 0, {})
    attend = ragged_attention.attend

    def attend_with_a_break(*args):
        torch._dynamo.graph_break()
        return attend(*args)

    monkeypatch.setattr(ragged_attention, "attend", attend_with_a_break)
    report = explain_step(tiny_llama(num_layers=2), rows=3)
    assert report["graph_breaks"] > 0
    (where,) = report["breaks_by_line"]
    assert where.startswith("test_step_ops.py:") and "attend_with_a_break" in where and "graph_break()" in where
