"""A draft worker's round: the next forward of every drafting session (each proposal written as a
generator of the forwards it needs, drafters/model.py) in one ragged forward and one LM head
call, so that sessions draft in lockstep and each session's proposal comes out as it would
alone.

A forward may ask for `follow` more forwards, each of one token: the argmax of its previous
forward's last row, fed back on the device. A greedy chain of K drafts is then one request, and
its tokens come back to the host once, when its last forward is done, not once a forward: the
host lays out the next round while the device still runs this one. Where every chain of a round
is past its first forward, their next forwards up to the nearest chain's end run as one CUDA
graph, if the model has graphs (runtime/chained_steps.py): one layout and one launch for them all."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Generator, NamedTuple, Optional, Sequence

import torch

from ..api.sampling import argmax
from ..loop.stage_types import DraftBlock
from ..models.kernels.chunked import kernels_by_chunk
from ..runtime.batching import forward_ids
from ..runtime.chained_steps import chains_in_one_graph, run_chain
from ..runtime.kv_pool import PagedKV
from ..runtime.ragged_attention import on_device
from .drafter_base import InLockstep


class ScoredForward(NamedTuple):
    """What a `DraftForward` gets back: the logits of its last `keep` tokens and of each followed
    forward's token `[keep + follow, V]`, and their argmax, read back once."""

    logits: torch.Tensor
    argmax_ids: Optional[list[int]]  # None where the forward does not take the argmax


@dataclass
class DraftForward:
    """One forward a proposal needs: `tokens` after the cached ones; the logits of the last `keep`;
    then `follow` forwards of one token each, the argmax of the previous one's last row."""

    cache: PagedKV
    tokens: list[int]
    keep: int
    by_argmax: bool = True  # its tokens are the argmax of the logits (not sampled)
    follow: int = 0

    def __post_init__(self) -> None:
        if self.follow and not self.by_argmax:
            raise ValueError("a followed forward's token is the argmax of the one before")


@dataclass
class Chain:
    """A `DraftForward` in progress: the outputs of its 1 + follow forwards run so far."""

    forward: DraftForward
    logits: list[torch.Tensor] = field(default_factory=list)  # [keep, V], then [n, V] n followed forwards
    argmax_ids: list[torch.Tensor] = field(default_factory=list)  # the same rows' argmax, on the device
    forwards: int = 0  # forwards run so far

    @property
    def length(self) -> int:
        """The next forward's tokens."""
        return len(self.forward.tokens) if not self.logits else 1

    @property
    def keep(self) -> int:
        """The next forward's rows kept."""
        return self.forward.keep if not self.logits else 1

    @property
    def remaining(self) -> int:
        """Forwards still to run."""
        return 1 + self.forward.follow - self.forwards

    def add(self, logits: torch.Tensor, argmax_ids: Optional[torch.Tensor], forwards: int) -> None:
        """The outputs of its next `forwards` forwards: `logits` `[rows, V]`, their argmax `[rows]`."""
        self.logits.append(logits)
        if self.forward.by_argmax:
            self.argmax_ids.append(argmax_ids)
        self.forwards += forwards


@torch.inference_mode()
def propose_together(model: torch.nn.Module, proposals: Sequence[Generator]) -> list[DraftBlock]:
    """Run proposals (`drafting` generators of sessions of `model`) in lockstep: each round is
    one ragged forward over the next forward of every proposal still drafting, and one LM head
    call over the rows they keep. Returns each proposal's block."""
    rounds = InLockstep(proposals, Chain)
    waiting = rounds.asked  # [index] the chain of each proposal still drafting
    while waiting:
        chains = list(waiting.values())
        steps = chained_steps(model, chains)
        if steps > 1:
            first = {"tokens": torch.cat([chain.argmax_ids[-1][-1:] for chain in chains])}  # [B] on the device
            caches = [chain.forward.cache for chain in chains]
            logits, top = run_chain(model.model, caches, first, functools.partial(argmax_step, model), "argmax", steps)
            logits = logits.float()  # [steps, B, V]
            for index, chain in enumerate(chains):
                chain.add(logits[:, index], top[:, index], steps)
        else:
            logits, top = draft_round(model, chains)
            keeps = [chain.keep for chain in chains]  # before this round's outputs join them
            tops = top.split(keeps) if top is not None else [None] * len(chains)
            for chain, chain_logits, chain_top in zip(chains, logits.split(keeps), tops):
                chain.add(chain_logits, chain_top, 1)
        # one read back for the round, of every chain it ends that takes its tokens by argmax
        ending = [index for index, chain in waiting.items() if not chain.remaining]
        taking = [index for index in ending if waiting[index].forward.by_argmax]
        read = torch.cat([row for index in taking for row in waiting[index].argmax_ids]).tolist() if taking else []
        for index in ending:
            chain = waiting[index]
            ids = None
            if chain.forward.by_argmax:
                count = sum(len(row) for row in chain.argmax_ids)
                ids, read = read[:count], read[count:]
            chain_logits = chain.logits[0] if len(chain.logits) == 1 else torch.cat(chain.logits)
            rounds.answer(index, ScoredForward(chain_logits, ids))
    return rounds.results


def chained_steps(model: torch.nn.Module, chains: Sequence[Chain]) -> int:
    """How many forwards the round runs as one graph: up to the nearest chain's end, where every
    chain is past its first forward (one token each, fed by argmax) and the model can; else 1."""
    if not all(chain.logits for chain in chains):
        return 1
    steps = min(chain.remaining for chain in chains)
    return steps if steps > 1 and chains_in_one_graph(model.model, len(chains)) else 1


def argmax_step(model: torch.nn.Module, step: dict, carried: dict) -> tuple[dict, tuple[torch.Tensor, torch.Tensor]]:
    """A chained forward (chained_steps.ChainStep): the tokens `[N_p]` carried in, their logits
    `[N_p, V]` and argmax `[N_p]` out, the argmax carried to the next. The logits stay in the
    model's dtype (a graph's outputs are held for each shape it records; float is exact after)."""
    hidden = model.model(input_ids=carried["tokens"][None], **step).last_hidden_state  # [1, N_p, H]
    logits = model.lm_head(hidden[0])
    tokens = argmax(logits)  # the float logits' argmax: widening is exact
    return {"tokens": tokens}, (logits, tokens)


def draft_round(model: torch.nn.Module, chains: Sequence[Chain]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One forward over every chain's next forward: the logits of the rows they keep
    `[sum(keep), V]` and their argmax `[sum(keep)]` (None where no chain takes it), on the device."""
    lengths = [chain.length for chain in chains]
    # [1, N]; a followed forward's token is its chain's last argmax, already on the device
    tokens = [token for chain in chains for token in (chain.forward.tokens if not chain.logits else [0])]
    input_ids = on_device(torch.tensor([tokens]), model.device)
    starts = itertools.accumulate(lengths, initial=0)  # where each row's tokens start among the N
    followed = [(start, chain) for start, chain in zip(starts, chains) if chain.logits]
    if followed:
        places = on_device(torch.tensor([start for start, _ in followed]), model.device)
        input_ids[0, places] = torch.cat([chain.argmax_ids[-1][-1:] for _, chain in followed])
    hidden, offsets = forward_ids(model, [chain.forward.cache for chain in chains], lengths, input_ids)
    keeps = [chain.keep for chain in chains]
    kept = torch.cat([torch.arange(end - keep, end) for keep, end in zip(keeps, offsets[1:])])
    with kernels_by_chunk(keeps):
        logits = model.lm_head(hidden[0, on_device(kept, hidden.device)]).float()  # [sum(keep), V]
    return logits, argmax(logits) if any(chain.forward.by_argmax for chain in chains) else None
