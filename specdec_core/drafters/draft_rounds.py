"""A draft worker's round: the next forward of every drafting session (each proposal written as a
generator of the forwards it needs, drafters/model.py) in one ragged forward and one LM head
call, so that sessions draft in lockstep and each session's proposal comes out as it would
alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, NamedTuple, Optional, Sequence

import torch

from ..api.sampling import argmax_lists
from ..loop.stage_types import DraftBlock
from ..models.kernels.chunked import kernels_by_chunk
from ..runtime.batching import forward_ragged
from ..runtime.kv_pool import PagedKV


class ScoredForward(NamedTuple):
    """What a `DraftForward` gets back: the logits of its last `keep` tokens `[keep, V]`, and
    their argmax, read back once for the whole round."""

    logits: torch.Tensor
    argmax_ids: Optional[list[int]]  # None where no proposal of the round takes the argmax


@dataclass
class DraftForward:
    """One forward a proposal needs: `tokens` after the cached ones; the logits of the last `keep`."""

    cache: PagedKV
    tokens: list[int]
    keep: int
    by_argmax: bool = True  # its tokens are the argmax of the logits (not sampled)


@torch.inference_mode()
def propose_together(model: torch.nn.Module, proposals: Sequence[Generator]) -> list[DraftBlock]:
    """Run proposals (`drafting` generators of sessions of `model`) in lockstep: each round is
    one ragged forward over the next forward of every proposal still drafting, and one LM head
    call over the rows they keep. Returns each proposal's block."""
    blocks: list[Optional[DraftBlock]] = [None] * len(proposals)
    waiting: dict[int, DraftForward] = {}

    def advance(index: int, scored: Optional[ScoredForward]) -> None:
        try:
            waiting[index] = proposals[index].send(scored)
        except StopIteration as done:
            blocks[index] = done.value
            waiting.pop(index, None)

    for index in range(len(proposals)):
        advance(index, None)
    while waiting:
        order = list(waiting)
        forwards = [waiting[index] for index in order]
        hidden, offsets = forward_ragged(
            model, [forward.cache for forward in forwards], [forward.tokens for forward in forwards]
        )
        kept = torch.cat([torch.arange(end - forward.keep, end) for forward, end in zip(forwards, offsets[1:])])
        keeps = [forward.keep for forward in forwards]
        with kernels_by_chunk(keeps):
            logits = model.lm_head(hidden[0, kept.to(hidden.device)]).float()  # [sum(keep), V]
        # one read back for the round, where a proposal takes its tokens by argmax
        top = argmax_lists(logits, keeps) if any(forward.by_argmax for forward in forwards) else [None] * len(keeps)
        for index, forward_logits, forward_top in zip(order, logits.split(keeps), top):
            advance(index, ScoredForward(forward_logits, forward_top))
    return blocks
