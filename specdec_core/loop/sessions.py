"""The two per-request sessions the speculative loop drives. Their calls that can wait on a
worker are awaited, so that the served coordinator (deployments/) runs many requests' loops on
one event loop over gRPC proxies. Local objects (`TargetScorer`, the drafters) are synchronous:
`Immediate` puts one behind the same calls, and `run_immediately` drives a loop over local
sessions without any event loop, since none of its awaits ever waits."""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Optional, Protocol, Sequence, TypeVar

from ..api.sampling import SamplingParams
from ..heads.contract import HeadGuesses
from ..policies import AcceptancePolicy
from ..policies.sampled_chains import Check
from ..trees.tree import Topology
from .stage_types import DraftBlock, Prefilled, TargetBlock, Verdict

Item = TypeVar("Item")


class TargetSession(Protocol):
    async def reset(
        self,
        prompt_ids: Sequence[int],
        policy: AcceptancePolicy,
        sampling: SamplingParams,
        heads_kind: Optional[str] = None,
    ) -> Prefilled:
        """Prefill the prompt (all but its last token, which the first `score` feeds; what the
        prefix cache holds of it is not computed again); `heads_kind`: run the target's heads of
        that kind beside it, for `guess`. Returns the prompt's scores when `sampling.prompt_logprobs` asks
        for them, and its prefix cache use."""

    async def score(self, tokens: Sequence[int], draft: Optional[DraftBlock] = None) -> TargetBlock:
        """Target logits for `[last committed, d_1..d_K]` (plus the policy's target features).
        `draft`: the block d_1..d_K came from, for a session that decides the verdict itself
        (`TargetBlock.verdict`; a served target worker's, which reads the drafts' probabilities)."""

    async def score_tree(
        self, tokens: Sequence[int], tree: Topology, draft: Optional[DraftBlock] = None
    ) -> TargetBlock:
        """Target logits for `[last committed, nodes...]` of a candidate tree (logits only)."""

    def commit(self, num_keep: int) -> None:
        """Keep the first `num_keep` scored tokens in the KV cache; roll back the rest."""

    def commit_path(self, nodes: Sequence[int]) -> None:
        """After `score_tree`: keep the root and the accepted path's nodes; drop the rest."""

    async def guess(self, root_token: int, tree: str) -> Optional[HeadGuesses]:
        """With multi-token heads: their node tokens of tree `tree` after the last committed
        position (the heads drafter's source, drafters/heads.py)."""


class DraftSession(Protocol):
    async def reset(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Start a request on this prompt (the drafter draws from `sampling.generator("draft")`)."""

    async def propose(self, max_tokens: int, batch_rows: int = 1, after: Sequence[int] = ()) -> DraftBlock:
        """Up to `max_tokens` draft tokens (none: the step is a plain one-token target step);
        `batch_rows`: the sessions the target's last step held, which prices a block; `after`:
        tokens the target verifies meanwhile, drafted after as if committed (run_ahead.py; a
        draft model's drafters only)."""

    def commit(self, new_tokens: Sequence[int]) -> None:
        """The tokens the verifier committed: accepted drafts, then its correction or bonus."""


# The loop's verify: a request's own policy call (`decide_alone`), or lockstep.py's, which decides a
# step's sampled chains together (policies/sampled_chains.py)
Decide = Callable[[Check], Awaitable[Verdict]]


async def decide_alone(check: Check) -> Verdict:
    return check.verdict()


class Immediate:
    """A local session (a TargetScorer or a drafter) behind the loop's awaited calls."""

    def __init__(self, session: Any):
        self.session = session

    async def reset(self, *args: Any, **kwargs: Any) -> Any:
        return self.session.reset(*args, **kwargs)

    async def score(self, tokens: Sequence[int], draft: Optional[DraftBlock] = None) -> TargetBlock:
        return self.session.score(tokens)

    async def score_tree(
        self, tokens: Sequence[int], tree: Topology, draft: Optional[DraftBlock] = None
    ) -> TargetBlock:
        return self.session.score_tree(tokens, tree)

    def commit_path(self, nodes: Sequence[int]) -> None:
        self.session.commit_path(nodes)

    async def propose(self, max_tokens: int, batch_rows: int = 1, after: Sequence[int] = ()) -> DraftBlock:
        if after:  # a draft model's drafter (the others draft inline, never ahead)
            return self.session.propose(max_tokens, batch_rows, after)
        return self.session.propose(max_tokens, batch_rows)

    async def guess(self, root_token: int, tree: str) -> Optional[HeadGuesses]:
        return self.session.guess(root_token, tree)

    def commit(self, kept: Any) -> None:
        self.session.commit(kept)


def run_immediately(items: AsyncIterator[Item]) -> Iterator[Item]:
    """Iterate an async generator whose awaits all complete at once (local sessions)."""
    try:
        while True:
            step = items.__anext__()
            try:
                step.send(None)
            except StopIteration as done:
                yield done.value
            except StopAsyncIteration:
                return
            else:  # raised where it waited, so the loop's own cleanup runs
                step.throw(RuntimeError("a local session's call waited: run it on an event loop"))
    finally:  # closing early (a consumer that stops reading) runs the loop's own cleanup
        closing = items.aclose()
        try:
            closing.send(None)
        except StopIteration:
            pass
