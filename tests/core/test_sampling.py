"""The warp's top-p (api/sampling.py `nucleus`): looked for among a row's top entries on the CPU,
it keeps exactly what a sort of the whole vocabulary keeps."""

from __future__ import annotations

import pytest
import torch

from specdec_core.api import sampling
from specdec_core.api.sampling import SamplingParams, nucleus, warp_logits

VOCAB = 10_000  # past both candidate counts (256, 4,096)


def rows(scales: list[float], seed: int = 0) -> torch.Tensor:
    """`[len(scales), VOCAB]` logits, sharper the larger the scale. A row's nucleus at top_p 0.5,
    0.9, 0.99: at scale 8, 1, 3 and 7 tokens; at 2, 162, 2,135 and 6,090; at 0.5, 3,070, 7,830
    and 9,664 (so every candidate count decides some case, and the full sort others)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randn(VOCAB, generator=generator) * scale for scale in scales])


def sorted_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The rule by softmax over each row's whole sorted vocabulary (the warp's before `nucleus`)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))


def assert_the_same_up_to_rounding(kept: torch.Tensor, logits: torch.Tensor, top_p: float) -> None:
    """`kept` keeps what `sorted_nucleus` keeps, but where a token's mass before it lies within
    float rounding of top_p (the two sum the same masses differently)."""
    differ = kept.isfinite() != sorted_nucleus(logits, top_p).isfinite()
    sorted_probs, order = logits.softmax(-1).sort(-1, descending=True)
    before = torch.empty_like(sorted_probs).scatter_(-1, order, sorted_probs.cumsum(-1) - sorted_probs)  # [..., V]
    assert ((before[differ] - top_p).abs() < 1e-5).all()


@pytest.mark.parametrize("scales", [[8.0, 8.0], [8.0, 2.0], [2.0, 2.0], [8.0, 0.5], [0.5], [8.0, 2.0, 0.5, 8.0]])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_the_nucleus_among_the_top_entries_is_the_whole_sorts(scales, top_p, monkeypatch):
    """Whichever candidate count decides each row (its own: a row's nucleus does not widen another's
    search), the kept tokens are the full sort's, bit for bit, in any batch shape, and the rule's:
    the nucleus is minimal (its mass reaches top_p, without its least likely token it does not)."""
    logits = rows(scales)
    kept = nucleus(logits, top_p)
    if len(scales) == 4:  # rows decided at 256, 4,096 and by the full sort, as [2, 2, V]
        assert torch.equal(nucleus(logits.view(2, 2, VOCAB), top_p), kept.view(2, 2, VOCAB))
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", ())
    assert torch.equal(kept, nucleus(logits, top_p))
    assert_the_same_up_to_rounding(kept, logits, top_p)
    probs = logits.softmax(-1)
    for row, kept_row in zip(probs, kept):
        mass = row[kept_row.isfinite()]
        assert mass.sum() >= top_p - 1e-5 and mass.sum() - mass.min() < top_p + 1e-5


def test_the_warp_applies_the_nucleus_after_temperature_and_top_k():
    logits = rows([4.0, 1.0], seed=3)
    warp = SamplingParams(temperature=0.7, top_k=300, top_p=0.8)
    expected = logits / 0.7
    expected = expected.masked_fill(expected < expected.topk(300).values[:, -1:], float("-inf"))
    warped = warp_logits(logits, warp)
    assert torch.equal(warped.isfinite() <= expected.isfinite(), torch.ones_like(warped, dtype=torch.bool))
    assert_the_same_up_to_rounding(warped, expected, 0.8)
    assert torch.equal(warped[warped.isfinite()], expected[warped.isfinite()])
