"""`specdec plan`: per-rank memory of a sharded target from its config (memory.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specdec_core.planning.memory import GIB, load_model_config, plan, shipped_configs, smallest_layout
from specdec_core.tools.cli_app import app

# Llama-3.1-8B by hand: hidden 4096, MLP 14336, 32 layers, 32 query and 8 KV heads of 128, vocab 128256
EMBEDDING = 128256 * 4096
LAYER_LINEARS = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)  # q, o; k, v; gate, up, down
NORMS = 32 * 2 * 4096 + 4096


def test_shipped_configs_cover_the_cluster_models():
    assert shipped_configs() == [
        "llama-3.1-405b-instruct",
        "llama-3.1-70b-instruct",
        "llama-3.1-8b-instruct",
        "llama-3.2-1b-instruct",
    ]


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_llama_8b_bf16_matches_a_hand_computation(tp):
    result = plan(load_model_config("llama-3.1-8b-instruct"), tp, gpu_gib=80, max_len=8192, max_batch=4)
    assert result.parameters.total == LAYER_LINEARS + 2 * EMBEDDING + NORMS == 8_030_261_248
    # layer linears and the untied LM head split over the ranks; the embedding and norms on every rank
    assert result.weight_bytes == 2 * (LAYER_LINEARS / tp + EMBEDDING / tp + EMBEDDING + NORMS)
    assert result.kv_bytes_per_token == 2 * 32 * (8 // tp) * 128 * 2  # K and V, layers, KV heads per rank, bf16
    assert result.kv_bytes_per_request == result.kv_bytes_per_token * 8192
    assert result.kv_bytes == 4 * result.kv_bytes_per_request
    assert result.headroom_bytes == 80 * GIB - result.total_bytes and result.fits


def test_fp8_halves_the_layer_linears_only_and_405b_needs_fp8_or_more_memory():
    config = load_model_config("llama-3.1-405b-instruct")
    bf16, fp8 = plan(config, 8, 80), plan(config, 8, 80, dtype="fp8")
    counts = bf16.parameters
    assert bf16.weight_bytes - fp8.weight_bytes == counts.layer_linears / 8
    assert not bf16.fits and fp8.fits and plan(config, 8, 141).fits
    assert smallest_layout(config, 80, max_pp=1) is None  # tp stops at the 8 KV heads
    assert smallest_layout(config, 80, max_pp=1, dtype="fp8") == (8, 1)


def test_stages_split_the_layers_and_the_ends_go_to_the_first_and_last():
    """pp 2 of Llama-3.1-8B: each stage 16 layers, so half the layer linears and KV per rank;
    the first stage holds the embedding, the last the (untied) LM head split over its ranks: the
    first needs more. Tied (Llama-3.2-1B), the last holds the embedding as its head."""
    config = load_model_config("llama-3.1-8b-instruct")
    for tp in (1, 4):
        one, two = plan(config, tp, 80, max_len=8192), plan(config, tp, 80, max_len=8192, pp=2)
        assert two.kv_bytes_per_token == one.kv_bytes_per_token / 2
        assert two.weight_bytes == 2 * (LAYER_LINEARS / 2 / tp + EMBEDDING + NORMS)
        assert one.weight_bytes - two.weight_bytes == 2 * (LAYER_LINEARS / 2 / tp + EMBEDDING / tp)
    tied = load_model_config("llama-3.2-1b-instruct")
    counts = plan(tied, 1, 80).parameters
    assert counts.lm_head == 0 and plan(tied, 1, 80, pp=2).weight_bytes == 2 * (
        counts.layer_linears / 2 + counts.embedding + counts.replicated
    )
    with pytest.raises(ValueError, match="pp_size 33"):
        plan(config, 1, 80, pp=33)


def test_405b_layouts_bf16_on_h200_fp8_on_h100_and_two_h100_nodes():
    config = load_model_config("llama-3.1-405b-instruct")
    settings = {"max_len": 8192, "max_batch": 8}
    assert plan(config, 8, 141, **settings).fits  # bf16, one 8xH200 node
    assert plan(config, 8, 80, dtype="fp8", **settings).fits  # FP8, one 8xH100 node
    assert plan(config, 8, 80, pp=2, **settings).fits  # bf16, two 8xH100 nodes
    assert not plan(config, 8, 80, **settings).fits
    # the fewest stages first (vLLM's recipe for 405B on H100s: tp 8 x pp 2), not the fewest GPUs (tp 4 x pp 3)
    assert smallest_layout(config, 80, **settings) == (8, 2)


def test_tp_must_split_the_heads():
    config = load_model_config("llama-3.1-8b-instruct")
    with pytest.raises(ValueError, match="query heads"):
        plan(config, 3, 80)
    with pytest.raises(ValueError, match="valid: 1, 2, 4, 8"):
        plan(config, 16, 80)


def test_plan_command_prints_the_figures_and_the_smallest_layout():
    result = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-70b-instruct", "--tp", "8", "--gpu-mem", "80"])
    assert result.exit_code == 0, result.output
    assert "18.14 GiB" in result.output and "40.0 KiB" in result.output
    assert "smallest layout that fits" in result.output and "tp 4 x pp 1" in result.output
    arguments = ["plan", "--model", "llama-3.1-405b-instruct", "--tp", "8", "--gpu-mem", "80", "--max-len", "8192"]
    too_small = CliRunner().invoke(app, arguments)
    assert too_small.exit_code == 1 and "tp 8 x pp 1 does not fit" in too_small.output
    assert "use tp 8 x pp 2 (16 GPUs)" in too_small.output
    assert CliRunner().invoke(app, [*arguments, "--pp", "2"]).exit_code == 0
    bad = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b-instruct", "--tp", "3"])
    assert bad.exit_code == 2 and "query heads" in bad.output
    missing = CliRunner().invoke(app, ["plan", "--model", "/nonexistent/config.json"])
    assert missing.exit_code == 2 and "llama-3.1-8b-instruct" in missing.output
