"""Run-ahead drafting: the draft drafts block t+1 while the target verifies block t.

When a draft model proposes block t (d_1..d_K), the next proposal starts at once, before the
verdict, from the outcome the draft expects: all of d_1..d_K accepted, then the target's next
token guessed by the draft itself. That ahead proposal is `[g, e_1..e_K']`, g the guess (the
draft's likeliest token). When the verdict commits exactly `d_1..d_K, g`, `e_1..e_K'` is block
t+1 and goes to the target with no draft call in between; otherwise it is dropped and the draft
proposes anew from the verdict. A tree drafter's block t assumes its top-1 path kept whole: its
ahead proposal is `[g, then a tree after g]`.

Only that one outcome is pre-drafted. A draft that proposes K tokens for a target that keeps
them all is the case worth hiding (it is when speculation pays most, and mla's blocks are
accepted whole most of the time at low load), while each other outcome (every shorter accept
length, SGLang's decoupled drafter) costs draft forwards that compete with the target for the
same cores here, and a miss costs only the proposal the sequential loop would have made anyway.

Exactness: a block is verified by the target whether or not it was drafted ahead, so greedy
output is target-only output. Sampled drafts of an ahead proposal are drawn from the draft's
distribution after `d_1..d_K, g`, which is where they are used, so the lossless policies keep
the target's distribution; a request's draws follow its own tokens only (the ahead proposal
always runs, and is always awaited before the next call), so a seed reproduces its output,
though not the output without run-ahead (the draft's generator is also drawn by dropped ones).

Forwarded blocks: where the target worker decides the verdict itself, the draft worker also sends
the ahead proposal straight to it, which, when its verdict on block t is the one the proposal
assumed, scores block t+1 before the server asks (deployments/workers/forwarded_blocks.py). The
target decides where the policy's verdict follows from the target's rows alone (greedy, and
rejection at T = 0: `decided_by_target_rows`; `target_outcome`, on the rows the server receives,
so it is the server's verdict exactly), and where it decides a session's sampled verdicts
(target/verdicts.py: the server takes its verdict). The other lossy policies' verdicts (easd,
ears, dropmatch, fly) stay with the server, so their ahead blocks go to the target from it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Optional, Sequence

import torch

from ..api.sampling import SamplingParams
from ..drafters.drafter_base import ahead_outcome, assumed_tokens
from ..policies import AcceptancePolicy
from ..trees.topologies import default_bank
from ..trees.tree import Topology
from .sessions import DraftSession
from .stage_types import DraftBlock, TargetBlock, Verdict


@dataclass
class Ahead:
    block: list[int]  # block t's tokens, which it assumed accepted
    proposal: Awaitable[tuple[DraftBlock, float, float]]  # [g, e_1..], and when the draft began and ended
    launched: float  # when the loop went on (a local proposal has run by then: nothing of it hidden)


async def timed(proposal: Coroutine[Any, Any, DraftBlock]) -> tuple[DraftBlock, float, float]:
    began = time.perf_counter()
    block = await proposal
    return block, began, time.perf_counter()


class RunAhead:
    """A `DraftSession` over a draft model's session (local or remote) that drafts ahead.
    `start(coroutine)` runs a proposal beside the loop's next awaits and returns an awaitable of
    its result (served: an asyncio task, so the draft works while the target verifies)."""

    def __init__(self, session: DraftSession, start: Callable[[Coroutine], Awaitable]):
        self.session, self.start = session, start
        self.ahead: Optional[Ahead] = None
        self.committed: list[int] = []  # the last verdict's tokens
        self.used = self.discarded = 0  # ahead proposals
        self.hidden_s = 0.0  # draft time the target's verify covered

    async def reset(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        await self.session.reset(prompt_ids, sampling)

    async def propose(self, max_tokens: int, batch_rows: int = 1) -> DraftBlock:
        block = await self.pre_drafted(max_tokens)
        if block is None:
            block = await self.session.propose(max_tokens, batch_rows)
        if block.num_tokens:
            tokens = assumed_tokens(block)
            proposal = self.start(timed(self.session.propose(max_tokens, batch_rows, tokens)))
            self.ahead = Ahead(tokens, proposal, time.perf_counter())
        return block

    async def pre_drafted(self, max_tokens: int) -> Optional[DraftBlock]:
        """The ahead proposal's block when the last verdict was the outcome it assumed."""
        if self.ahead is None:
            return None
        ahead, self.ahead = self.ahead, None
        waited = time.perf_counter()
        proposal, began, ended = await ahead.proposal
        self.hidden_s += max(0.0, min(ended, waited) - max(began, ahead.launched))
        if proposal.num_tokens > 1 and self.committed == ahead_outcome(ahead.block, proposal.tokens.tolist()):
            self.used += 1
            return next_block(proposal, max_tokens)
        self.discarded += 1
        return None

    def commit(self, new_tokens: Sequence[int]) -> None:
        self.committed = list(new_tokens)
        self.session.commit(new_tokens)

    async def settle(self) -> None:
        """Wait for a proposal still running (the request ended first): the session is released
        after it, and its errors are not lost."""
        if self.ahead is not None:
            ahead, self.ahead = self.ahead, None
            await ahead.proposal

    def summary(self) -> dict:
        return {"used": self.used, "discarded": self.discarded, "draft_ms_hidden": round(self.hidden_s * 1e3, 1)}


def next_block(proposal: DraftBlock, max_tokens: int) -> DraftBlock:
    """A used ahead proposal past its guess, at most `max_tokens` (a tree: that deep)."""
    if max_tokens <= 0:  # the request's last token: a plain step
        return DraftBlock.empty()
    if proposal.tree is None:
        return proposal.part(1, 1 + max_tokens)
    tree = default_bank().limited(proposal.tree.name, max_tokens)
    nodes = default_bank().node_index(tree.name, proposal.tree.name).to(proposal.tokens.device)
    return DraftBlock(tokens=proposal.tokens[1:][nodes], tree=tree)


def run_now(coroutine: Coroutine) -> Awaitable:
    """Run a local session's call to its end now (it never waits); returns an awaitable of its
    result: in process, `RunAhead`'s `start`, for the same tokens with no concurrency."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        value = done.value
    else:
        coroutine.close()
        raise RuntimeError("a local session's call waited: run it on an event loop")

    async def result():
        return value

    return result()


@dataclass(frozen=True)
class Outcome:
    """A verdict as the target worker applies it: the tokens it adds to the sequence (the kept
    drafts, then the next token) and the commit of the block scored (`commit_keep` tokens or a
    tree's `commit_path`, as on the wire)."""

    new_tokens: list[int]
    commit_keep: int = 0
    commit_path: tuple[int, ...] = ()


def target_outcome(
    policy: AcceptancePolicy,
    sampling: SamplingParams,
    tokens: Sequence[int],
    tree: Optional[Topology],
    rows: torch.Tensor,
) -> Outcome:
    """The verdict on a block `tokens` = [root, drafts..] (a chain, or `tree`'s nodes) whose
    target rows `[T, V]` are those the server receives, by a policy `decided_by_target_rows`:
    the server's own verdict, decided where the target runs."""
    draft = DraftBlock(torch.tensor(list(tokens[1:]), dtype=torch.long, device=rows.device), tree=tree)
    verify = policy.verify if tree is None else policy.verify_tree
    return verdict_outcome(verify(draft, TargetBlock(logits=rows), sampling, None), draft)


def verdict_outcome(verdict: Verdict, draft: DraftBlock) -> Outcome:
    """A verdict on `draft` as the target worker applies it."""
    new_tokens = [*verdict.kept_tokens(draft), verdict.next_token]
    if verdict.path is None:
        return Outcome(new_tokens, commit_keep=verdict.num_accepted + 1)
    return Outcome(new_tokens, commit_path=tuple(verdict.path))
