"""tools/step_profile.py: where a step's time goes, by kernel kind (the kinds, and the command on
the CPU, where it reports the wall time and the operations; CUDA's columns are gpu-report's)."""

from __future__ import annotations

from typer.testing import CliRunner

from specdec_core.tools.cli_app import app
from specdec_core.tools.measuring.step_profile import kernel_kind, top_kernels

from helpers.tiny_models import tiny_llama


def test_kernels_are_sorted_into_kinds_by_name():
    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "gemm",
        "nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT": "gemm",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
        "void pytorch_flash::flash_fwd_kernel<...>": "attention",
        "triton_poi_fused_add_mul_0": "triton",
        "void at::native::index_elementwise_kernel<128, 4, ...>": "copy",
        "Memcpy HtoD (Pageable -> Device)": "copy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel...>": "pointwise",
        "void at::native::reduce_kernel<512, 1, ...MeanOps...>": "pointwise",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "copy",
        "some_new_kernel": "other",
    }
    assert {name: kernel_kind(name) for name in names} == names


def test_top_kernels_rank_by_device_time():
    kernels = {"a_gemm": (50.0, 2), "flash_fwd": (80.0, 1), "elementwise": (5.0, 30)}
    ranked = top_kernels(kernels, count=2)
    assert [row["kernel"] for row in ranked] == ["flash_fwd", "a_gemm"] and ranked[1]["calls"] == 2


def test_step_profile_runs_both_models_on_the_cpu(tmp_path):
    tiny_llama(num_layers=2).config.save_pretrained(tmp_path)
    source = f"random:{tmp_path / 'config.json'}"
    options = ["--target", source, "--draft", source, "--dtype", "float32", "--rows", "1,3", "--history", "8"]
    result = CliRunner().invoke(app, ["step-profile", *options])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("| target") or line.startswith("| draft")]
    # each model at each row count, eager (no CUDA: no graphs); a 3-row step dispatches more operations
    assert [line.split(" | ")[:4] for line in lines] == [
        ["| target", "1", "5", "eager"],
        ["| target", "3", "5", "eager"],
        ["| draft", "1", "1", "eager"],
        ["| draft", "3", "1", "eager"],
    ]
    ops = [int(line.split(" | ")[6].strip(" |")) for line in lines]
    assert ops[1] > ops[0] > 0 and ops[3] > ops[2] > 0


def test_a_draft_chain_is_profiled_as_one_graph_where_the_draft_can_chain():
    """The profile's chain row (profile_chain): a paged draft over graphs' buffers (the CPU's
    stand-in, the kernel under Triton's interpreter) runs K - 1 forwards as one chain; an eager
    draft has no chain row."""
    from specdec_core.runtime.model_runner import runner_of, use_paged_attention, use_step_graphs
    from specdec_core.tools.measuring.step_profile import profile_chain

    eager, chained = tiny_llama(num_layers=1), tiny_llama(num_layers=1)
    use_paged_attention(chained)
    graphs = use_step_graphs(chained, record=False)
    assert profile_chain(eager, 2, 3, history=8, repeats=1) is None
    profiled = profile_chain(chained, 2, 3, history=8, repeats=1)
    assert profiled["row"]["model"] == "draft chain of 3" and profiled["row"]["rows"] == 2
    assert profiled["row"]["wall ms"] > 0 and profiled["row"]["aten ops"] > 0
    assert [kind for kind, *_ in graphs.graphs if kind != "step"] == [("chain", "argmax", 3)]
    assert runner_of(chained.model).pool.keys is not None
