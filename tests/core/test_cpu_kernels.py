"""A CPU draft's kernels: int4 codes, each chunk length on its chosen kernel, the choice measured
once per machine and cached, and the AVX2 path (torch and oneDNN held to AVX2 by their variables)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec_core import GenerationRequest, SpeculativeEngine
from specdec_core.api.sampling import SamplingParams
from specdec_core.models.kernels import kernel_choice
from specdec_core.models.kernels.chunked import ChunkedLinear, DenseKernel, describe, kernel_for, kernels_by_chunk
from specdec_core.models.kernels.int4 import Int4Kernel, int4_candidates, quantize_int4

from helpers.tiny_models import repeating_prompt, tiny_llama

INT4_THEN_BF16 = ((12, "int4"), (256, "bf16"))


def fixed(table):
    """A `ChooseKernels` that gives every linear `table`, less the kernels it has not (the head's int4)."""
    return lambda linear, candidates: tuple((rows, name) for rows, name in table if name in candidates)


def test_int4_kernel_matches_its_dequantized_weights_within_half_a_step():
    """Int4Kernel computes x W'^T + b with W' its de-quantized values; W' is within half a
    quantization step of W, and a weight already on a per-group 4-bit grid (a Q4_1 checkpoint's)
    comes back up to bf16 rounding."""
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 48).to(torch.bfloat16)
    int4, values = Int4Kernel.quantize(linear)
    groups = linear.weight.float().view(48, 2, 32)
    half_step = ((groups.amax(-1) - groups.amin(-1)) / 30)[..., None]
    assert ((values.view(48, 2, 32) - groups).abs() <= half_step * 1.02 + 1e-2).all()
    x = torch.randn(20, 64, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        for num_rows in (1, 3, 20):
            reference = x[:num_rows].float() @ values.T + linear.bias.float()
            torch.testing.assert_close(int4(x[:num_rows]).float(), reference, atol=3e-2, rtol=3e-2)

    codes = torch.randint(0, 16, (32, 4, 32), generator=generator).float()
    codes[..., 0], codes[..., 1] = 0, 15  # min-max rounding recovers the grid when both ends occur
    scale, low = torch.rand(32, 4, 1, generator=generator) / 50, torch.randn(32, 4, 1, generator=generator) / 10
    on_grid = torch.nn.Linear(128, 32, bias=False)
    with torch.no_grad():
        on_grid.weight.copy_((codes * scale + low).view(32, 128))
    torch.testing.assert_close(Int4Kernel.quantize(on_grid)[1], on_grid.weight, atol=2e-3, rtol=1e-2)
    with pytest.raises(ValueError, match="in_features % 32"):
        Int4Kernel.quantize(torch.nn.Linear(24, 40))


def test_chunked_linear_runs_each_chunk_on_its_lengths_kernel_and_rows_alike_alone_or_together():
    """A chunk of n rows runs the table's kernel for n (a kernel's weights zeroed show which ran);
    in a forward over several chunks each row comes out bitwise as its chunk alone."""
    assert [kernel_for(INT4_THEN_BF16, n) for n in (1, 12, 13, 256, 999)] == ["int4", "int4", "bf16", "bf16", "bf16"]
    assert describe(INT4_THEN_BF16) == "int4 up to 12 rows, bf16 beyond"
    assert describe(((1, "fp32"), (8, "fp32"))) == "fp32"
    linear = torch.nn.Linear(64, 48).to(torch.bfloat16)
    candidates = int4_candidates(linear)
    chunked = ChunkedLinear(linear, candidates, INT4_THEN_BF16, torch.bfloat16)
    assert set(chunked.kernels) == {"int4", "bf16"}  # the fp32 copy is not kept
    x = torch.randn(1, 30, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        lengths = [3, 20, 7]
        alone = [chunked(part) for part in x.split(lengths, dim=1)]
        with kernels_by_chunk(lengths):
            together = chunked(x)
        assert torch.equal(together, torch.cat(alone, dim=1))
        short, long = x[:, :12], x[:, :13]
        expected_short = chunked(short)
        chunked.kernels["bf16"] = Zeros()  # shows which rows run it
        assert torch.equal(chunked(short), expected_short) and not chunked(long).any()
        with kernels_by_chunk(lengths):
            mixed = chunked(x)
        assert torch.equal(mixed[:, :3], alone[0]) and not mixed[:, 3:23].any()


class Zeros(torch.nn.Module):
    def forward(self, rows):
        return rows.new_zeros(rows.shape[0], 48)


def test_kernel_tables_take_the_fastest_drop_the_hopeless_and_are_measured_once_per_machine(tmp_path, monkeypatch):
    """measure_table keeps the fastest candidate at each row count and stops timing one that is
    HOPELESS times slower and losing ground (not one that is catching up); the tables are cached
    per machine: a second load times nothing."""
    timed: list[tuple[int, tuple[str, ...]]] = []

    def fake_times(kernels, rows):  # int4 fast for few rows (bf16 6x behind, then catching up); fp32 hopeless
        timed.append((rows.shape[0], tuple(sorted(kernels))))
        n = rows.shape[0]
        times = {"int4": 1.0 * n, "bf16": 6.0 + 0.2 * n, "fp32": 5.0 if n < 4 else 100.0 * n}
        return {name: times[name] for name in kernels}

    monkeypatch.setattr(kernel_choice, "fastest_times", fake_times)
    linear = torch.nn.Linear(64, 48).to(torch.bfloat16)
    choose = kernel_choice.measured_tables(tmp_path)
    table = choose(linear, int4_candidates(linear))
    assert [kernel_for(table, n) for n in (1, 4, 5, 8)] == ["int4", "int4", "bf16", "bf16"]  # 5: as 8, measured
    assert kernel_for(table, 256) == "bf16"
    assert all("fp32" not in names for rows, names in timed if rows > 4)
    assert set(timed[0][1]) == {"int4", "bf16", "fp32"}
    (stored,) = (tmp_path / "kernels").glob("*.json")
    facts = json.loads(stored.read_text())["machine"]
    assert facts["isa"] == torch.backends.cpu.get_cpu_capability() and facts["threads"] == str(torch.get_num_threads())
    timed.clear()
    assert kernel_choice.measured_tables(tmp_path)(linear, int4_candidates(linear)) == table
    assert timed == []


def test_a_kernel_that_fails_here_is_left_out():
    class Missing(torch.nn.Module):
        def forward(self, rows):
            raise NotImplementedError("no such kernel on this CPU")

    dense = DenseKernel(torch.randn(48, 64), None, torch.float32)
    table = kernel_choice.measure_table(64, torch.bfloat16, {"missing": Missing(), "fp32": dense})
    assert {name for _, name in table} == {"fp32"}


def test_int4_draft_runs_chunked_kernels_and_keeps_greedy_speculation_identical(tiny_target):
    """`quantize_int4` makes the body linears and the head of a bf16 copy chunked linears (the
    head without int4), and that draft leaves greedy output token-identical through both model
    drafters while drafts get accepted."""
    from specdec_core.models.kernels import prepare_model

    draft = tiny_llama(prepared=False).to(torch.bfloat16)  # the target's weights (same seed)
    quantize_int4(draft, fixed(((4, "int4"), (8, "fp32"), (256, "bf16"))))
    prepare_model(draft)
    layer = draft.model.layers[0]
    assert set(layer.self_attn.k_proj.kernels) == {"int4", "fp32", "bf16"}
    assert set(draft.lm_head.kernels) == {"fp32", "bf16"}
    engine = SpeculativeEngine(tiny_target, None, draft)
    for drafter in ("model", "mla"):
        for seed in range(2):
            prompt = repeating_prompt(seed)
            reference = engine.complete(request(prompt, "none"))
            speculative = engine.complete(request(prompt, drafter))
            assert speculative.token_ids == reference.token_ids
            assert speculative.metrics["spec_decode_num_accepted_tokens"] > 0


def test_a_cpu_without_int4_or_onednn_kernels_runs_the_draft_on_torch_matmul(tiny_target, tmp_path, monkeypatch):
    """Where torch has no int4 CPU kernel and oneDNN packs nothing (as on some aarch64 builds),
    the int4 draft loads on the kernels that remain, torch's matmul in bf16 or fp32, and stays
    lossless."""
    from specdec_core.models.kernels import chunked, int4, prepare_model

    def no_int4(linear):
        raise NotImplementedError("no int4 CPU kernel in this build")

    monkeypatch.setattr(int4.Int4Kernel, "quantize", no_int4)
    monkeypatch.setattr(chunked, "pack_weight", lambda weight: None)
    draft = tiny_llama(prepared=False).to(torch.bfloat16)
    quantize_int4(draft, kernel_choice.measured_tables(tmp_path))
    prepare_model(draft)
    kernels = [
        kernel for module in draft.modules() if isinstance(module, ChunkedLinear) for kernel in module.kernels.values()
    ]
    assert kernels and {kernel.library for kernel in kernels} == {"matmul"}
    engine = SpeculativeEngine(tiny_target, None, draft)
    prompt = repeating_prompt(0)
    assert engine.complete(request(prompt, "mla")).token_ids == engine.complete(request(prompt, "none")).token_ids


def request(prompt_ids, drafter):
    return GenerationRequest(
        prompt_ids=prompt_ids,
        sampling=SamplingParams(max_tokens=24),
        drafter={"name": drafter, "params": {"prefill_cost": 0.0}} if drafter != "none" else {"name": "none"},
        num_draft_tokens=8,
    )


def x86_with_avx2() -> bool:
    try:
        return " avx2 " in f" {Path('/proc/cpuinfo').read_text().replace(chr(10), ' ')} "
    except OSError:
        return False


@pytest.mark.skipif(not x86_with_avx2(), reason="needs an x86 CPU with AVX2 (Linux)")
def test_the_avx2_path_packs_no_bf16_chooses_among_what_runs_and_stays_lossless(tmp_path):
    """With ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 (what a CPU without AVX-512
    runs) oneDNN packs fp32 only, so a draft's bf16 kernel is torch's matmul; the draft's kernels
    are measured there (the tables cached under that ISA) and greedy speculation through them
    gives target-only greedy's tokens."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    tests_dir = str(Path(__file__).parents[1])
    result = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "helpers" / "avx2_draft.py"), tests_dir, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["isa"] == "AVX2" and report["packs"] == ["torch.float32"]
    assert set(report["kernels"]) <= {"int4", "bf16", "fp32"} and report["bf16_library"] in ([], ["matmul"])
    (stored,) = (tmp_path / "kernels").glob("*.json")
    assert json.loads(stored.read_text())["machine"]["isa"] == "AVX2"
    outputs = report["outputs"]
    assert outputs["model"] == outputs["none"] and outputs["mla"] == outputs["none"]


def test_the_draft_costs_key_ignores_what_cannot_change_a_cpu_pairs_costs():
    """cuda_graphs has no bearing on a CPU pair: a spec that sets it finds the costs measured
    without it (a changed key would measure them again, and a lossy policy's block lengths follow
    them)."""
    from specdec_core.calibration.draft_costs import draft_costs_path
    from specdec_core.models.loader import ModelSpec

    default = draft_costs_path(ModelSpec(), ModelSpec(dtype="int4"), None)
    assert draft_costs_path(ModelSpec(cuda_graphs=False), ModelSpec(dtype="int4", cuda_graphs=False), None) == default
    assert draft_costs_path(ModelSpec(num_layers=2), ModelSpec(dtype="int4"), None) != default
    # compiled layers run other kernels: their own costs
    assert draft_costs_path(ModelSpec(compile_layers=True), ModelSpec(dtype="int4"), None) != default
