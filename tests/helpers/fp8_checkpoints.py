"""Tiny FP8 checkpoints for tests (test_fp8_checkpoint.py, the sharded and GPU tests): a model
saved with its decoder linears in FP8, in each format the loader reads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec_core.models.kernels.fp8 import dequantize, quantize_rows

FORMATS = {
    "fbgemm_fp8": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    "compressed-tensors channel": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    },
}
FORMATS["compressed-tensors tensor"] = json.loads(json.dumps(FORMATS["compressed-tensors channel"]))
FORMATS["compressed-tensors tensor"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"


def quantized(weight: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and scales `[out, 1]` (per row) or `[1]` (one for the tensor)."""
    if not per_tensor:
        return quantize_rows(weight)
    codes, scale = quantize_rows(weight.reshape(1, -1))
    return codes.reshape(weight.shape), scale.reshape(1)


def write_fp8_checkpoint(model, directory: Path, quantization: dict) -> dict[str, torch.Tensor]:
    """`model` saved with its decoder linears in FP8 under `quantization`; returns the
    de-quantized weight of each converted linear, by name."""
    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    per_tensor = "tensor" in json.dumps(quantization.get("config_groups", {}))
    expected = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            codes, scale = quantized(module.weight.detach(), per_tensor)
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = codes, scale
            if quantization["quant_method"] == "compressed-tensors":
                tensors[f"{name}.input_scale"] = torch.ones(1)  # static scale: read, not used
            expected[name] = dequantize(codes, scale, torch.float32)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return expected
