"""shard_loader.py: a rank reads only its part of a checkpoint: its stage's layers, renumbered,
and its contiguous part of each sharded tensor (the 2-rank sharded model is tested in
tests/cluster/test_tensor_parallel.py and test_pipeline.py)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from specdec_core.models.shard_loader import Checkpoint, load_shard, stage_names

from helpers.tiny_models import repeating_prompt, tiny_llama


def test_a_rank_reads_its_contiguous_part_of_a_tensor(tmp_path):
    weight = torch.arange(7 * 4, dtype=torch.float32).reshape(7, 4)
    save_file({"w": weight}, tmp_path / "model.safetensors")
    checkpoint = Checkpoint(tmp_path, torch.device("cpu"))
    assert torch.equal(checkpoint.read("w"), weight)
    # 7 rows over 2 ranks: 4 and 3 (transformers' split); columns over 4 ranks: one each
    assert torch.equal(checkpoint.read("w", 0, (1, 2)), weight[4:])
    assert torch.equal(checkpoint.read("w", 1, (2, 4)), weight[:, 2:3])


def test_a_stage_holds_its_layers_renumbered_and_everything_outside_the_layers():
    stored = dict.fromkeys(
        ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"]
        + ["model.layers.13.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"]
    )
    assert stage_names(stored, range(3, 14)) == {
        "model.embed_tokens.weight": "model.embed_tokens.weight",
        "model.layers.0.mlp.up_proj.weight": "model.layers.3.mlp.up_proj.weight",
        "model.layers.10.self_attn.q_proj.weight": "model.layers.13.self_attn.q_proj.weight",
        "model.norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    }


def test_a_stage_of_a_plain_checkpoint_runs_its_layers_as_the_whole_model_does(tmp_path):
    """The second of two stages, fed the first layer's output, gives the whole model's logits."""
    whole = tiny_llama(seed=5, prepared=False)
    whole.save_pretrained(tmp_path)
    stage = load_shard(str(tmp_path), torch.float32, torch.device("cpu"), layers=range(1, 2))
    assert len(stage.model.layers) == 1 and stage.model.layers[0].self_attn.layer_idx == 0
    tokens = torch.tensor([repeating_prompt(4)])
    with torch.no_grad():
        want = whole(tokens).logits
        positions = torch.arange(tokens.shape[1])[None]
        embeddings = whole.model.rotary_emb(whole.model.embed_tokens(tokens), positions)
        first = whole.model.layers[0](
            whole.model.embed_tokens(tokens),
            attention_mask=None,
            position_embeddings=embeddings,
            position_ids=positions,
        )
        got = stage(inputs_embeds=first).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
