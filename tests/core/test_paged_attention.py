"""kernels/paged_attention.py under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1
without CUDA): every new token's attention over its row's keys, read through the block tables,
equals SDPA over the row's gathered keys under the same mask, for chains, trees, one-token rows
and long histories split across programs. The same kernel on CUDA: tests/core/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from specdec_core.models.kernels.paged_attention import paged_attention  # noqa: E402 - after the skip

from helpers.paged_rows import causal, random_paged_arguments, sdpa_reference, tree_mask  # noqa: E402


@pytest.mark.parametrize(
    "seq_lens, masks, heads, kv_heads, splits",
    [
        ([37], [causal(5)], 4, 2, 4),  # a verify block of K + 1 = 5
        ([1], [causal(1)], 4, 4, 2),  # a first token: its own key only; a split left empty
        ([300], [causal(1)], 8, 2, 16),  # one token over a long history, split 16 ways
        ([40, 7, 129], [causal(5), tree_mask(), causal(1)], 6, 2, 3),  # ragged rows, a tree, G = 3
    ],
)
def test_the_kernel_equals_sdpa_over_the_gathered_keys(seq_lens, masks, heads, kv_heads, splits):
    arguments = random_paged_arguments(seq_lens, masks, heads, kv_heads, head_dim=16, seed=len(seq_lens) + heads)
    output = paged_attention(**arguments, num_splits=splits)  # [N, H, D]
    torch.testing.assert_close(output, sdpa_reference(arguments), atol=2e-5, rtol=2e-5)


def test_a_model_on_the_paged_kernel_decodes_as_on_sdpa(tiny_engine):
    """The kernel wired into the step (paged_layout.py, ragged_attention.py): a verify step's
    logits equal SDPA's, and greedy speculation over it equals its own target-only decoding,
    chains and trees, eager and over static buffers (a graphed step's padding: use_step_graphs
    without recording, the CPU's stand-in)."""
    from specdec_core import GenerationRequest, SpeculativeEngine
    from specdec_core.runtime.ragged_attention import use_paged_attention
    from specdec_core.runtime.step_graphs import use_step_graphs
    from specdec_core.target.scorer import forward_rows
    from specdec_core.tools.measuring.step_ops import verify_rows

    from helpers.tiny_models import repeating_prompt, tiny_llama, tiny_profile

    sdpa, paged = tiny_llama(num_layers=2), tiny_llama(num_layers=2)
    use_paged_attention(paged)
    for model in (sdpa, paged):
        model.rows = verify_rows(model, 3, 5, 40)
    blocks = [forward_rows(model.rows) for model in (sdpa, paged)]
    for expected, got in zip(*blocks):
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-4, rtol=1e-4)
    for graphs, drafters in ((False, ("none", "model")), (True, ("none", "model_tree"))):
        target = tiny_llama(num_layers=2)
        use_paged_attention(target)
        if graphs:
            use_step_graphs(target, record=False)
        engine = SpeculativeEngine(target, None, tiny_engine.draft_model, profile=lambda *_: tiny_profile())
        for drafter in drafters:
            request = GenerationRequest(
                prompt_ids=repeating_prompt(3),
                drafter={"name": drafter},
                num_draft_tokens=4,
                sampling={"max_tokens": 8},
            )
            tokens = engine.complete(request).token_ids
            if drafter == "none":
                target_only = tokens
            assert tokens == target_only, (graphs, drafter)
