"""Multi-token heads (specdec_core/heads.py): Medusa's published checkpoint format loads and
computes what Medusa's own module computes, and heads saved here load back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec_core.heads import MedusaHeads


class PublishedResBlock(nn.Module):
    """Medusa's block as its checkpoints were made (medusa/model/medusa_model.py)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def published_heads(hidden_size: int, vocab_size: int, num_heads: int, num_layers: int) -> nn.ModuleList:
    """Medusa's head list: one block object repeated per layer (shared weights), then a projection."""
    torch.manual_seed(0)
    heads = nn.ModuleList(
        nn.Sequential(*([PublishedResBlock(hidden_size)] * num_layers), nn.Linear(hidden_size, vocab_size, bias=False))
        for _ in range(num_heads)
    )
    for parameter in heads.parameters():
        nn.init.normal_(parameter, std=0.2)
    return heads


@pytest.mark.parametrize("num_layers", [1, 2])
def test_a_published_medusa_checkpoint_loads_and_gives_medusas_logits(tmp_path, num_layers):
    published = published_heads(hidden_size=16, vocab_size=40, num_heads=3, num_layers=num_layers)
    torch.save(published.state_dict(), tmp_path / "medusa_lm_head.pt")
    heads = MedusaHeads.load(tmp_path)
    assert (heads.num_heads, heads.num_layers, heads.hidden_size, heads.vocab_size) == (3, num_layers, 16, 40)
    hidden = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = torch.stack([head(hidden) for head in published])
        assert torch.allclose(heads(hidden), expected, atol=1e-6)


def test_heads_saved_here_load_back_and_a_foreign_file_is_refused(tmp_path):
    heads = MedusaHeads(hidden_size=8, vocab_size=20, num_heads=2, num_layers=1)
    for parameter in heads.parameters():
        nn.init.normal_(parameter)
    heads.save(tmp_path / "heads", base_model="tiny")
    again = MedusaHeads.load(tmp_path / "heads")
    hidden = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(again(hidden), heads(hidden))
    assert (tmp_path / "heads" / "config.json").read_text().count('"medusa_num_heads": 2') == 1
    torch.save({"lm_head.weight": torch.zeros(2, 2)}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="not a Medusa head state dict"):
        MedusaHeads.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no medusa_lm_head.pt"):
        MedusaHeads.load(tmp_path / "missing")
