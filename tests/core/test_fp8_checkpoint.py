"""FP8 checkpoints (specdec_core/models/fp8_checkpoint.py, kernels/fp8.py): a tiny random Llama written
by the test in each format loads through `load_model`, de-quantized on the CPU, and gives the
logits of its original within FP8's rounding; layouts the loader does not know are refused."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_core.models.kernels.fp8 import FP8, dequantize, quantize_rows
from specdec_core.models.loader import ModelSpec, load_model

from helpers.fp8_checkpoints import FORMATS, write_fp8_checkpoint
from helpers.tiny_models import repeating_prompt, tiny_llama


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_an_fp8_checkpoint_loads_de_quantized_with_its_originals_logits(tmp_path, name):
    original = tiny_llama(seed=2, prepared=False)
    expected = write_fp8_checkpoint(original, tmp_path, FORMATS[name])
    model = load_model(ModelSpec(source=str(tmp_path), dtype="float32", device="cpu"))
    for linear, weight in expected.items():
        assert torch.equal(model.get_submodule(linear).weight, weight)
    reference = tiny_llama(seed=2, prepared=False)  # the original with the checkpoint's weights
    for linear, weight in expected.items():
        reference.get_submodule(linear).weight.data.copy_(weight)
    tokens = torch.tensor([repeating_prompt(3)])
    with torch.inference_mode():
        got, want, exact = (m(tokens).logits[0] for m in (model, reference, original))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # FP8's rounding (3 mantissa bits: within 1/16 of each weight) moves the logits by about 3%
    # (2.9-3.1% in the three formats when written): tolerance 5%, relative to their norm
    assert (got - exact).norm() < 0.05 * exact.norm()
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.8  # 22 of 24 positions when written


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}},
            },
            "group_0",
        ),
        ({**FORMATS["compressed-tensors channel"], "format": "marlin-24"}, "marlin-24"),
    ],
)
def test_an_fp8_layout_it_does_not_know_is_refused_with_a_message(tmp_path, quantization, named):
    original = tiny_llama(seed=2, prepared=False)
    original.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError, match=f"{named}.*specdec loads fbgemm_fp8"):
        load_model(ModelSpec(source=str(tmp_path), dtype="float32", device="cpu"))


def test_rows_quantize_to_e4m3_within_its_rounding():
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    weight[3] = 0.0  # an all-zero row keeps a positive scale
    codes, scale = quantize_rows(weight)
    assert codes.dtype == FP8 and scale.shape == (8, 1) and bool((scale > 0).all())
    back = dequantize(codes, scale, torch.float32)
    assert torch.equal(back[3], weight[3])
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, or of the row's scale near zero
    assert bool(((back - weight).abs() <= weight.abs() / 16 + scale).all())
