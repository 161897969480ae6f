"""Run by test_cpu_kernels.py in a process held to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA):
a tiny int4 draft with its kernels measured there, and greedy outputs of target-only, `model`
and `mla` decoding, printed as JSON. argv: the tests directory (where `helpers` is), the cache root."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[1])
from specdec_core import GenerationRequest, SpeculativeEngine  # noqa: E402
from specdec_core.models.kernels import prepare_model  # noqa: E402
from specdec_core.models.kernels.chunked import ChunkedLinear  # noqa: E402
from specdec_core.models.kernels.int4 import quantize_int4  # noqa: E402
from specdec_core.models.kernels.kernel_choice import measured_tables  # noqa: E402
from specdec_core.models.kernels.linear import packable_dtypes  # noqa: E402

from helpers.tiny_models import repeating_prompt, tiny_llama  # noqa: E402

target = tiny_llama()
draft = tiny_llama(prepared=False).to(torch.bfloat16)
quantize_int4(draft, measured_tables(Path(sys.argv[2])))
prepare_model(draft)
chunked = [module for module in draft.modules() if isinstance(module, ChunkedLinear)]
engine = SpeculativeEngine(target, None, draft)
outputs = {}
for drafter in ("none", "model", "mla"):
    params = {} if drafter == "none" else {"prefill_cost": 0.0}
    outputs[drafter] = [
        engine.complete(
            GenerationRequest(
                prompt_ids=repeating_prompt(seed),
                sampling={"max_tokens": 24},
                drafter={"name": drafter, "params": params},
                num_draft_tokens=8,
            )
        ).token_ids
        for seed in range(2)
    ]
print(
    json.dumps(
        {
            "isa": torch.backends.cpu.get_cpu_capability(),
            "packs": [str(dtype) for dtype in packable_dtypes()],
            "kernels": sorted({name for module in chunked for _, name in module.table}),
            "bf16_library": sorted({module.kernels["bf16"].library for module in chunked if "bf16" in module.kernels}),
            "outputs": outputs,
        }
    )
)
