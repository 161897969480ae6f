"""A target split into pipeline stages (specdec_core/pipeline.py), each stage's ranks processes
of their own over gloo: every rank's logits and policy features equal one process's, before and
after a rollback and in steps of several sessions (a step of 72 tokens runs as 2 micro-batches),
as 2 stages of 1 rank and 2 stages of 2 ranks (tensor parallel inside each); only the first
stage holds the embedding, only the last the LM head, split over its ranks."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, tiny_llama
from test_tensor_parallel import assert_every_rank_scores_as, sharded_steps, steps

from specdec_core.pipeline import split_rows, stage_layers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("pp") / "target"
    tiny_llama(seed=3, prepared=False, num_layers=3).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(("world_size", "pp"), [(2, 2), (4, 2)])
def test_every_rank_of_a_pipeline_scores_as_one_process(checkpoint, world_size, pp):
    with torch.no_grad():
        reference = steps(tiny_llama(seed=3, prepared=False, num_layers=3))
    outputs = sharded_steps(checkpoint, "transformers", world_size, pp)
    assert_every_rank_scores_as(outputs, reference)
    tp = world_size // pp
    for rank, (_, _, ends) in outputs.items():
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
    from specdec_core.loader import truncate_layers

    reference_model = tiny_llama(seed=3, prepared=False, num_layers=3)
    truncate_layers(reference_model, 2)
    with torch.no_grad():
        reference = steps(reference_model)
    outputs = sharded_steps(checkpoint, "transformers", 2, 2, num_layers=2)
    assert_every_rank_scores_as(outputs, reference)
    assert outputs[1][2] == (None, TINY_VOCAB)
