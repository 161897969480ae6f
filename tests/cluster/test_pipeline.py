"""A target split into pipeline stages (specdec_core/models/pipeline.py), each stage's ranks processes
of their own over gloo: every rank's logits and policy features equal one process's, before and
after a rollback and in steps of several sessions (a step of 72 tokens runs as 2 micro-batches),
as 2 stages of 1 rank and 2 stages of 2 ranks (tensor parallel inside each); only the first
stage holds the embedding, only the last the LM head, split over its ranks."""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel import assert_every_rank_scores_as, assert_every_rank_steps_on_graphs, sharded_steps, steps

from specdec_core.models.loader import ModelSpec
from specdec_core.models.parallel import join_group, load_sharded_model, run_local_ranks
from specdec_core.models.pipeline import split_rows, stage_layers

from helpers.tiny_models import TINY_VOCAB, tiny_llama


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("pp") / "target"
    tiny_llama(seed=3, prepared=False, num_layers=3).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(("world_size", "pp", "attention", "graphs"), [(2, 2, "paged", True), (4, 2, "sdpa", False)])
def test_every_rank_of_a_pipeline_scores_as_one_process(checkpoint, world_size, pp, attention, graphs):
    """A stage's short rows take the paged kernel where asked (here under Triton's interpreter), and
    its micro-batches replay graphs of its layers (on the CPU, eagerly over their static buffers)."""
    with torch.no_grad():
        reference = steps(tiny_llama(seed=3, prepared=False, num_layers=3))
    outputs = sharded_steps(checkpoint, "transformers", world_size, pp, attention=attention, graphs=graphs)
    assert_every_rank_scores_as(outputs, reference)
    if graphs:
        assert_every_rank_steps_on_graphs(outputs, paged=attention == "paged")
    tp = world_size // pp
    for rank, (_, _, ends, *_) in outputs.items():
        first = rank < tp
        assert ends == ((TINY_VOCAB, None) if first else (None, TINY_VOCAB // tp)), rank


def test_stages_split_the_layers_the_first_ones_taking_the_remainder():
    assert [stage_layers(80, stage, 2) for stage in range(2)] == [range(0, 40), range(40, 80)]
    assert [stage_layers(7, stage, 3) for stage in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError, match="pp_size 4"):
        stage_layers(3, 0, 4)


def test_a_step_splits_into_consecutive_parts_of_about_equal_tokens():
    assert split_rows([5, 5, 5, 5], 2) == [range(0, 2), range(2, 4)]
    assert split_rows([3, 63, 6], 2) == [range(0, 2), range(2, 3)]  # a prompt chunk beside verify rows
    assert split_rows([5, 512], 2) == [range(0, 1), range(1, 2)]  # every part keeps a row
    assert split_rows([1] * 7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_rows([9], 1) == [range(0, 1)]


def test_a_tied_head_is_the_last_stages_embedding(tmp_path):
    """Tied (as Llama-3.2-1B), the last stage holds the embedding whole as its head, and so does
    the first, to embed the tokens."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama(seed=4, prepared=False, num_layers=3)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        reference = steps(AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    outputs = sharded_steps(str(tmp_path), "transformers", 2, 2)
    assert_every_rank_scores_as(outputs, reference)
    assert [outputs[rank][2] for rank in (0, 1)] == [(TINY_VOCAB, None), (TINY_VOCAB, TINY_VOCAB)]


def test_a_truncated_model_ends_on_the_last_stage_of_its_kept_layers(checkpoint):
    """`num_layers` 2 of the 3-layer checkpoint over 2 stages: the second stage holds layer 1,
    the norm and the head, as one process truncated to 2 layers."""
    from specdec_core.models.loader import truncate_layers

    reference_model = tiny_llama(seed=3, prepared=False, num_layers=3)
    truncate_layers(reference_model, 2)
    with torch.no_grad():
        reference = steps(reference_model)
    outputs = sharded_steps(checkpoint, "transformers", 2, 2, num_layers=2)
    assert_every_rank_scores_as(outputs, reference)
    assert outputs[1][2] == (None, TINY_VOCAB)


@pytest.mark.parametrize("pp", [1, 2])
def test_pipeline_step_times_a_step_whole_and_a_micro_batch_a_stage(checkpoint, pp):
    """`specdec pipeline-step` on 2 stages (a process each), or one process: a row per step
    shape, whole and (stages only) split."""
    from typer.testing import CliRunner

    from specdec_core.tools.cli_app import app

    arguments = ["pipeline-step", "--target", checkpoint, "--pp", str(pp), "--steps", "4x9,2x1", "--repeats", "1"]
    result = CliRunner().invoke(app, arguments, terminal_width=200)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "tokens" in line]
    assert len(lines) == 2 and "4 x 9 tokens" in lines[0] and "2 x 1 tokens" in lines[1], result.output
    assert "whole ms" in result.output and ("a micro-batch a stage ms" in result.output) == (pp > 1)


def test_pipeline_step_shapes_are_sessions_by_tokens():
    from specdec_core.tools.measuring.pipeline_step import step_shapes

    assert step_shapes("8x11,8x1") == [(8, 11), (8, 1)]
    for bad in ("8", "8x0", "ax2", ""):
        with pytest.raises(ValueError, match="sessions x tokens"):
            step_shapes(bad)


def heads_rank(rank: int, world_size: int, port: int, checkpoint: str, medusa_dir: str, eagle3_dir: str):
    """A rank of 2 stages: the kinds of the heads it holds from "auto" (the shipped heads, here
    the tiny Medusa heads and EAGLE-3 layer), and why it refuses the EAGLE-3 layer named."""
    from specdec_core.heads import loading

    torch.set_num_threads(1)
    join_group(rank, world_size, "127.0.0.1", port, timeout_s=120)
    model = load_sharded_model(ModelSpec(source=checkpoint), "transformers", 2)
    loading.SHIPPED_HEADS = {"tiny": [medusa_dir, eagle3_dir]}
    kinds = sorted(loading.load_heads("auto", "tiny", model))
    try:
        loading.load_heads(eagle3_dir, "tiny", model)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return kinds, refusal


def test_a_target_in_stages_holds_the_shipped_medusa_heads_and_refuses_an_eagle3_layer(checkpoint, tmp_path):
    """An EAGLE-3 layer reads layers that the stages split between them: "auto" leaves it out
    (the embedded target's shipped layer must not stop cluster/local-pp2.yaml from starting), a
    named one is refused with a message; the Medusa heads load on every stage."""
    from transformers import AutoModelForCausalLM

    from specdec_core.heads.medusa import MedusaHeads

    from helpers.eagle3_heads import write_eagle3

    target = AutoModelForCausalLM.from_pretrained(checkpoint)
    MedusaHeads(target.config.hidden_size, target.config.vocab_size, 2, own_lm_head=False).save(tmp_path / "medusa")
    eagle3_dir = write_eagle3(tmp_path / "eagle3", target, "authors")
    outcomes = run_local_ranks(2, heads_rank, checkpoint, str(tmp_path / "medusa"), str(eagle3_dir), timeout_s=180)
    for kinds, refusal in outcomes:
        assert kinds == ["medusa"]
        assert refusal is not None and "holds Medusa heads only" in refusal
