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
        ([90, 41], [causal(40), causal(1)], 4, 2, 2),  # a row of 40 new tokens: two programs' worth
    ],
)
def test_the_kernel_equals_sdpa_over_the_gathered_keys(seq_lens, masks, heads, kv_heads, splits):
    arguments = random_paged_arguments(seq_lens, masks, heads, kv_heads, head_dim=16, seed=len(seq_lens) + heads)
    output = paged_attention(**arguments, num_splits=splits)  # [N, H, D]
    torch.testing.assert_close(output, sdpa_reference(arguments), atol=2e-5, rtol=2e-5)


def test_a_graphed_steps_padding_row_comes_out_zero_and_leaves_the_rows_alone():
    """paged_layout.py pads a graphed step with one row of no keys holding the padding tokens,
    more of them than the widest real row: the kernel covers every token without the rows'
    lengths, gives the padding 0 and the real rows what it gives them alone."""
    arguments = random_paged_arguments([37], [causal(5)], 4, 2, head_dim=16, seed=3)
    alone = paged_attention(**arguments)
    padding = 11
    padded = {
        **arguments,
        "query": torch.cat([arguments["query"], torch.randn(padding, 4, 16)]),
        "block_tables": torch.cat([arguments["block_tables"], torch.zeros_like(arguments["block_tables"])]),
        "seq_lens": torch.cat([arguments["seq_lens"], torch.zeros(1, dtype=torch.int32)]),
        "query_start": torch.tensor([0, 5, 5 + padding], dtype=torch.int32),
        "new_mask": torch.cat([arguments["new_mask"], torch.zeros(padding, 5, dtype=torch.int8)]),
    }
    output = paged_attention(**padded)
    assert torch.equal(output[:5], alone) and torch.equal(output[5:], torch.zeros(padding, 4, 16))


def test_a_model_on_the_paged_kernel_decodes_as_on_sdpa(tiny_engine):
    """The kernel wired into the step (paged_layout.py, ragged_attention.py): a verify step's
    logits equal SDPA's, and greedy speculation over it equals its own target-only decoding,
    chains and trees, eager and over static buffers (a graphed step's padding: use_step_graphs
    without recording, the CPU's stand-in)."""
    from specdec_core import GenerationRequest, SpeculativeEngine
    from specdec_core.runtime.model_runner import use_paged_attention, use_step_graphs
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


def test_a_model_spec_chooses_the_paged_kernel_on_cuda_and_sdpa_on_the_cpu(tmp_path):
    """`attention: auto` (the default) is the paged kernel on CUDA and SDPA on the CPU; `paged`
    loads a model on it (here under the interpreter); a compiled step cannot hold it."""
    from specdec_core.models.loader import ModelSpec, load_model
    from specdec_core.runtime.model_runner import runner_of

    from helpers.tiny_models import tiny_llama

    tiny_llama(num_layers=1).config.save_pretrained(tmp_path)
    source = f"random:{tmp_path / 'config.json'}"
    assert not ModelSpec(source=source, device="cpu").paged_attention
    assert ModelSpec(source=source, device="cuda").paged_attention
    assert not ModelSpec(source=source, device="cuda", compile=True).paged_attention
    assert not ModelSpec(source=source, device="cuda", attention="sdpa").paged_attention
    assert runner_of(load_model(ModelSpec(source=source, device="cpu", attention="paged")).model).paged
    assert not runner_of(load_model(ModelSpec(source=source, device="cpu")).model).paged
    with pytest.raises(ValueError, match="not inside a compiled step"):
        ModelSpec(source=source, device="cuda", compile=True, attention="paged")
    # a head size the kernel's matrix products cannot take: paged refuses it, auto would keep SDPA
    config = tiny_llama(num_layers=1).config
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim = 72, 3, 3, 24
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="head size 24 is not a power of two"):
        load_model(ModelSpec(source=source, device="cpu", attention="paged"))
