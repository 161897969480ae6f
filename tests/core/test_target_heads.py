"""heads/loading.py: which heads a target holds. `auto` keeps the shipped heads that fit the target
as configured (its kept layers, its stages) and says which it left out and why; named heads that
do not fit (hidden size, vocabulary, layers, stages) are refused, from their files alone."""

from __future__ import annotations

import logging
import re

import pytest

from specdec_core.heads.loading import TargetShape, heads_shape, load_heads, refusal, shipped_heads
from specdec_core.heads.medusa import MedusaHeads
from specdec_core.models.loader import ModelSpec, load_configs, load_model
from specdec_core.models.sources import EMBEDDED

from helpers.eagle3_heads import write_eagle3
from helpers.published_hydra import PublishedHydra
from helpers.tiny_models import tiny_llama


@pytest.mark.needs_smollm2
@pytest.mark.parametrize(
    ("num_layers", "stages", "left_out"),
    [
        (None, 1, None),
        (20, 1, r"eagle3: the EAGLE-3 layer reads target layers \[2, 15, 27\]; the target keeps 20 layers"),
        (None, 2, "eagle3: the EAGLE-3 layer reads hidden states .* a target in stages holds Medusa heads only"),
    ],
)
def test_auto_keeps_the_shipped_heads_that_fit_the_embedded_target_as_configured(num_layers, stages, left_out):
    """The embedded target whole holds both; cut to 20 layers (a documented config) or in stages,
    the EAGLE-3 layer, which reads its layers 2, 15 and 27, is left out and the Medusa heads kept."""
    target = TargetShape.of_config(load_configs(ModelSpec())[0], num_layers, stages)
    told: list[str] = []
    kept = shipped_heads(EMBEDDED, target, told.append)
    assert [directory.rsplit("/", 1)[-1] for directory in kept] == ["smollm2-135m-instruct"] + (
        [] if left_out else ["smollm2-135m-instruct-eagle3"]
    )
    if left_out is None:
        assert told == []
    else:
        assert len(told) == 1 and told[0].startswith("target_heads auto leaves out ")
        assert re.search(left_out, told[0]), told


@pytest.mark.needs_smollm2
def test_the_embedded_target_cut_to_20_layers_loads_the_medusa_heads_and_logs_the_layer_left_out(caplog):
    model = load_model(ModelSpec(num_layers=20))
    with caplog.at_level(logging.WARNING, logger="specdec_core.heads.loading"):
        held = load_heads("auto", EMBEDDED, model)
    assert list(held) == ["medusa"]
    assert "target_heads auto leaves out" in caplog.text and "the target keeps 20 layers" in caplog.text


def medusa_dir(tmp_path, hidden: int, vocab: int, own_lm_head: bool):
    MedusaHeads(hidden, vocab, 2, own_lm_head=own_lm_head).save(tmp_path / "medusa")
    return str(tmp_path / "medusa")


def test_named_heads_are_refused_where_they_do_not_fit_and_say_why(tmp_path):
    target = tiny_llama(num_layers=8)
    shape = TargetShape.of_config(target.config)
    eagle3 = str(write_eagle3(tmp_path / "eagle3", target, "speculators"))  # it names the layers it reads
    hydra = PublishedHydra(64, 512, 2, 1)
    hydra.save(tmp_path / "hydra", "mlp")
    fitting = {
        "medusa": medusa_dir(tmp_path / "shared", 64, 512, own_lm_head=False),
        "hydra": str(tmp_path / "hydra"),
        "eagle3": eagle3,
    }
    for kind, directory in fitting.items():
        assert heads_shape(directory, shape).kind == kind and refusal(directory, shape) is None
    assert heads_shape(fitting["medusa"], shape).vocab_size is None  # the target's LM head projects
    cases = [
        (medusa_dir(tmp_path / "wide", 32, 512, True), shape, "Medusa heads read target states of size 32; .* is 64"),
        (
            medusa_dir(tmp_path / "vocab", 64, 300, True),
            shape,
            "vocabulary of the Medusa heads is 300; the target's is 512",
        ),
        (str(tmp_path / "hydra"), TargetShape(64, 500, 8), "vocabulary of the Hydra heads is 512; the target's is 500"),
        (str(tmp_path / "hydra"), TargetShape(64, 512, 8, stages=2), "token embeddings, which only a pipeline's first"),
        (eagle3, TargetShape(64, 512, 5), r"reads target layers \[2, 4, 5\]; the target keeps 5 layers"),
        (eagle3, TargetShape(64, 512, 8, stages=2), "a target in stages holds Medusa heads only"),
    ]
    for directory, target_shape, reason in cases:
        problem = refusal(directory, target_shape)
        assert problem is not None and problem.startswith(directory), problem
        assert re.search(reason, problem), (reason, problem)
    assert refusal(fitting["medusa"], TargetShape(64, 512, 8, stages=2)) is None  # Medusa heads fit stages


def test_an_eagle3_layer_that_embeds_with_the_targets_embedding_needs_its_size():
    from specdec_core.heads.loading import HeadsShape, fit_refusal

    borrowing = HeadsShape("eagle3", 64, 512, (2, 4, 5), embedding_size=32)
    assert "embeds its tokens at size 32 with the target's embedding, of size 64" in fit_refusal(
        borrowing, TargetShape(64, 512, 8)
    )
    assert fit_refusal(HeadsShape("eagle3", 64, 512, (2, 4, 5), embedding_size=64), TargetShape(64, 512, 8)) is None


def test_loading_named_heads_onto_a_target_they_do_not_fit_is_refused(tmp_path):
    target = tiny_llama(num_layers=4)
    with pytest.raises(ValueError, match="Medusa heads read target states of size 32"):
        load_heads(medusa_dir(tmp_path, 32, 512, True), "tiny", target)
    held = load_heads(medusa_dir(tmp_path / "fits", 64, 512, True), "tiny", target)
    assert list(held) == ["medusa"] and held["medusa"].vocab_size == 512
