"""The drafter interface: a per-request session that proposes tokens and learns what was kept."""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any, Callable, ClassVar, Generator, Sequence

from pydantic import BaseModel, ConfigDict

from ..api.sampling import SamplingParams
from ..loop.stage_types import DraftBlock
from ..runtime.kv_pool import PagedKV


class DraftSource(Enum):
    """What a drafter drafts from, declared by its class: the one factory (drafters/__init__.py)
    builds it from that, and the engines place it by it."""

    NOTHING = "nothing"  # drafts nothing: no session anywhere
    CONTEXT = "context"  # the request's own tokens (lookups)
    DRAFT_MODEL = "draft_model"  # a draft model's forwards: built over it, on the draft worker when served
    TARGET_HEADS = "target_heads"  # the target's heads: it asks the target session for their guesses


def common_prefix_length(first: Sequence[int], second: Sequence[int], limit: int) -> int:
    """How many leading tokens the two sequences share, at most `limit`."""
    length = 0
    while length < limit and first[length] == second[length]:
        length += 1
    return length


def ahead_outcome(after: Sequence[int], proposal: Sequence[int]) -> list[int]:
    """The verdict under which a proposal drafted after `after` is used: `after` kept whole,
    then the proposal's first token (its guess of the target's next one); its tail is then the
    next block."""
    return [*after, *proposal[:1]]


def assumed_tokens(block: DraftBlock, offset: int = 0) -> list[int]:
    """What a block's ahead proposal assumes the target keeps, after its first `offset` tokens: a
    chain whole, a tree's top-1 path."""
    tokens = block.tokens[offset:]
    if block.tree is None:
        return tokens.tolist()
    return tokens[[node - 1 for node in block.tree.top1_path[1:]]].tolist()


def sync_cache(cache: PagedKV, cached: list[int], sequence: Sequence[int]) -> None:
    """Crop a draft cache (holding the tokens `cached`, kept in step) to its longest prefix
    shared with `sequence`, leaving >= 1 token of it to feed."""
    shared = common_prefix_length(cached, sequence, min(len(cached), len(sequence) - 1))
    cache.crop(shared)
    del cached[shared:]


class DrafterParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Drafter(ABC):
    """A `DraftSession` (loop/sessions.py): `reset(prompt, sampling)`, then per step
    `propose(max_tokens)` and `commit(new_tokens)` with the tokens the verifier committed
    (accepted drafts + the correction/bonus token)."""

    name: ClassVar[str]
    Params: ClassVar[type[DrafterParams]] = DrafterParams
    drafts_from: ClassVar[DraftSource] = DraftSource.CONTEXT
    proposes_trees: ClassVar[bool] = False  # True: its blocks are candidate trees (DraftBlock.tree)
    # True: proposes after tokens not yet committed (`after`, run_ahead.py): a draft model's
    # drafters; lookups are cheap enough to draft inline
    drafts_ahead: ClassVar[bool] = False
    # True: masks its proposals with the request's grammar (`follow_grammar`), so they stay
    # inside it; the loop cuts the others' at their first forbidden token
    follows_grammar: ClassVar[bool] = False
    # True: built over the process's suffix trees (suffix_cache.py), which make_drafter passes
    reads_suffixes: ClassVar[bool] = False

    def __init__(self, params: DrafterParams | None = None):
        self.params = params if params is not None else self.Params()
        self.context: list[int] = []

    def reset(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        self.context = list(prompt_ids)
        self.sampling = sampling
        self.generator = sampling.generator("draft")

    @abstractmethod
    def propose(self, max_tokens: int, batch_rows: int = 1) -> DraftBlock: ...

    def commit(self, new_tokens: Sequence[int]) -> None:
        self.context.extend(new_tokens)


class NoDrafter(Drafter):
    """Proposes nothing: every step is a plain one-token target step (target-only decoding
    through the same loop)."""

    name = "none"
    drafts_from = DraftSource.NOTHING

    def propose(self, max_tokens: int, batch_rows: int = 1) -> DraftBlock:
        return DraftBlock.empty()


class InLockstep:
    """Generators run in lockstep, each asking for one forward at a time (a draft step's proposals):
    `asked` holds what each still drafting asks next (as `wrap` makes it), `results` what each
    returned once done."""

    def __init__(self, generators: Sequence[Generator], wrap: Callable[[Any], Any] = lambda asked: asked):
        self.generators, self.wrap = generators, wrap
        self.asked: dict[int, Any] = {}
        self.results: list[Any] = [None] * len(generators)
        for index in range(len(generators)):
            self.answer(index, None)

    def answer(self, index: int, answer: Any) -> None:
        """Send generator `index` the answer to what it asked; it asks again or is done."""
        try:
            self.asked[index] = self.wrap(self.generators[index].send(answer))
        except StopIteration as done:
            self.results[index] = done.value
            self.asked.pop(index, None)
