"""Hydra's heads as its authors publish them (their module layout and file format), built from
trained Medusa heads: what the Hydra loader must read."""

from __future__ import annotations

import torch


class PublishedHydraBlock(torch.nn.Module):
    """Hydra's block as its checkpoints were made (hydra/model/hydra_heads): R x + SiLU(W x + b),
    R linear where the input carries `num_condition` token embeddings beside the state."""

    def __init__(self, hidden_size: int, num_condition: int = 0):
        super().__init__()
        in_features = hidden_size * (num_condition + 1)
        self.linear = torch.nn.Linear(in_features, hidden_size)
        self.res_connection = torch.nn.Linear(in_features, hidden_size) if num_condition else torch.nn.Identity()
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return self.res_connection(x) + self.act(self.linear(x))


class PublishedHydra(torch.nn.Module):
    """Hydra's grounded head module, whose state dict is its checkpoint (`hydra_lm_head.pt`): per
    head a first block over the state and the path's embeddings, then one block object repeated
    (shared weights), and a projection with a bias; Hydra++ (`prefix`, a one-layer base model)
    puts a dropout before each block and projection."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, prefix=None):
        super().__init__()
        if prefix is not None:
            self.prefix_embeding_layer = prefix  # sic, as Hydra names it
        drop = [torch.nn.Dropout(0.0)] if prefix is not None else []

        def head_blocks(head: int) -> list:
            later = PublishedHydraBlock(hidden_size)
            return [*drop, PublishedHydraBlock(hidden_size, head + 1), *([*drop, later] * (num_layers - 1))]

        self.hydra_mlp = torch.nn.ModuleList(torch.nn.Sequential(*head_blocks(head)) for head in range(num_heads))
        self.hydra_lm_head = torch.nn.ModuleList(
            torch.nn.Sequential(*drop, torch.nn.Linear(hidden_size, vocab_size))
            if drop
            else torch.nn.Linear(hidden_size, vocab_size)
            for _ in range(num_heads)
        )

    def save(self, directory, architecture: str) -> None:
        import json

        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), directory / "hydra_lm_head.pt")
        config = {"hydra_num_heads": len(self.hydra_mlp), "hydra_head_arch": architecture, "grounded_heads": True}
        (directory / "config.json").write_text(json.dumps({**config, "hidden_state_offset": 0}))


def hydra_from_medusa(heads, path_weight: float, seed: int = 0) -> PublishedHydra:
    """Hydra heads that compute Medusa `heads` (own projections, one block) from the state, plus
    `path_weight` times random weights on the path's embeddings (0: they ignore the path)."""
    hidden = heads.hidden_size
    hydra = PublishedHydra(hidden, heads.vocab_size, heads.num_heads, 1)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for head, (medusa, block, projection) in enumerate(zip(heads.heads, hydra.hydra_mlp, hydra.hydra_lm_head)):
            first = block[0]
            first.linear.weight.copy_(path_weight * torch.randn(first.linear.weight.shape, generator=generator))
            first.linear.weight[:, :hidden] = medusa[0].linear.weight
            first.linear.bias.copy_(medusa[0].linear.bias)
            first.res_connection.weight.zero_()
            first.res_connection.weight[:, :hidden] = torch.eye(hidden)
            first.res_connection.bias.zero_()
            projection.weight.copy_(medusa[1].weight)
            projection.bias.zero_()
    return hydra
