"""Draft-model drafter with its own KV cache, and FLy's multi-level acceleration (MLA).

`model`: the draft LM proposes one token per forward (argmax at T = 0, a sample of the warped
distribution otherwise), optionally stopping early when its top probability falls below
`confidence_threshold`. By default the block length adapts (`block_length`) with each draft
forward priced at `draft_cost` target steps: a draft that agrees 98% of the time but costs
0.8 of a target step drafts ~5 tokens, not 15, since a token drafted past the first rejection
costs a forward and earns nothing.

`mla`: prompt lookup guesses a continuation and the draft model checks
it greedily in the same forward, so one draft forward yields (matched guesses + 1) tokens;
the proposal equals the plain greedy draft, only cheaper. MLA proposals are deterministic
(one-hot draft distribution) also at T > 0. Under load (a target step of several sessions) its
two levels compete: where the lookup alone, unchecked, earns more per unit of cost than a
checked draft (whose forwards are priced per session), mla proposes the lookup as `pld` would,
with no draft forward, so a loaded mla falls back to pld rather than to plain decoding.

The draft cache is reconciled with the committed context by longest common prefix, so any
commit (including loosely accepted or corrected tokens) rolls back exactly.

A proposal is written as a generator (`drafting`) of the forwards it needs, so that a draft
worker can run the forwards of many sessions' proposals in lockstep, one ragged forward per
round (`propose_together`); a session's proposal comes out as it would alone."""

from __future__ import annotations

from typing import ClassVar, Generator, Optional, Sequence

import torch

from ..api.sampling import MAX_TOKENS, argmax, sample, sampling_probs
from ..loop.stage_types import DraftBlock
from ..runtime.kv_pool import PagedKV
from ..structured.grammar_state import GrammarState
from .block_length import (
    AcceptanceEstimate,
    BlockChoice,
    best_block,
    cost_per_draft,
    draft_pays,
    learning_block,
)
from .draft_rounds import DraftForward, ScoredForward, propose_together
from .drafter_base import Drafter, DraftSource, ahead_outcome, common_prefix_length, sync_cache
from .first_level import first_level
from .model_params import ModelDrafterParams, MultiLevelParams
from .model_tree import ModelTreeDrafter, draft_together
from .suffix_cache import SuffixCache


class ModelDrafter(Drafter):
    name = "model"
    Params = ModelDrafterParams
    drafts_from = DraftSource.DRAFT_MODEL
    deterministic: ClassVar[bool] = False  # True: proposals never sampled (one-hot p_d)
    drafts_ahead = True
    guesses: ClassVar[bool] = False  # True: each forward checks a lookup's guess (`lookup`)

    def __init__(self, model: torch.nn.Module, params: Optional[ModelDrafterParams] = None):
        super().__init__(params)
        self.model = model
        self.cache = PagedKV()
        self.cached_tokens: list[int] = []
        self.grammar: Optional[GrammarState] = None

    @property
    def follows_grammar(self) -> bool:
        return self.params.masked_by_grammar

    def follow_grammar(self, grammar: GrammarState) -> None:
        """Draw each drafted token from the draft's distribution masked by `grammar` (at the
        output's start; this drafter's own, advanced by its commits), as the target's rows are."""
        self.grammar = grammar

    def lookup(self, context: Sequence[int], max_tokens: int) -> list[int]:
        return []

    def reset(self, prompt_ids, sampling) -> None:
        super().reset(prompt_ids, sampling)
        self.cache = PagedKV.for_request(len(prompt_ids), sampling.max_tokens)
        self.cached_tokens = []
        # optimistic prior (mean 0.9, weight 2): a Beta(1, 1) start would price drafting as a
        # loss and crawl up from 1-token blocks
        self.estimate = AcceptanceEstimate(prior_accepted=1.8, prior_rejected=0.2)
        self.forwards = 0  # draft forwards in this request
        self.prompt_tokens = len(prompt_ids)
        self.uses_draft: Optional[bool] = None  # decided at the first proposal (`drafts_with_model`)
        self.drafted = 0
        self.last_proposal: list[int] = []
        self.ahead: tuple[Optional[list[int]], list[int]] = (None, [])  # (the tokens it assumed, its proposal)
        self.grammar_start = len(prompt_ids)  # the grammar starts with the output

    def block_limit(self, max_tokens: int, batch_rows: int) -> BlockChoice:
        """How many tokens to draft this step: alone at least 1, so the estimate keeps learning;
        under load 0 (no draft forward) where drafting does not pay."""
        if not self.params.adaptive or max_tokens <= 1:
            return BlockChoice(max_tokens, 1.0)
        cost = cost_per_draft(self.params.draft_cost, self.forwards, self.drafted)
        return learning_block(self.estimate.rate, max_tokens, self.params.verify_cost, cost, batch_rows)

    def drafts_with_model(self, max_tokens: int) -> bool:
        """Whether this request drafts with the model, decided at its first proposal, before the
        draft's prefill: where the draft cannot earn back the prefill of its prompt
        (block_length.draft_pays, alone, at the prior's acceptance) it drafts without it. The
        load is left to each step's block length: it passes."""
        if max_tokens < 1:  # no room for a draft this step: nothing to decide from
            return False
        if self.uses_draft is None:
            max_new = self.sampling.max_tokens
            remaining = MAX_TOKENS if max_new is None else max_new - (len(self.context) - self.prompt_tokens)
            value = best_block(self.estimate.rate, max_tokens, self.params.verify_cost, self.params.draft_cost).value
            pays = draft_pays(value, remaining, len(self.context), self.params.prefill_cost)
            self.uses_draft = pays or not self.params.adaptive
        return self.uses_draft

    def propose(self, max_tokens: int, batch_rows: int = 1, after: Sequence[int] = ()) -> DraftBlock:
        return propose_together(self.model, [self.drafting_after(after, max_tokens, batch_rows)])[0]

    def drafting_after(
        self, after: Sequence[int], max_tokens: int, batch_rows: int = 1
    ) -> Generator["DraftForward", "ScoredForward", DraftBlock]:
        """`drafting`, as if `after` (tokens the target is verifying now) were committed: a
        run-ahead proposal (run_ahead.py), the draft's guess of the target's next token and then
        a block of up to `max_tokens`. What the drafter learns from a proposal waits for the
        commit that shows whether this one was used."""
        if not after:
            return (yield from self.drafting(max_tokens, batch_rows))
        committed, proposal = len(self.context), self.last_proposal
        estimate = (self.estimate.accepted, self.estimate.rejected)
        self.context.extend(after)
        # its block is priced as if `after` were kept whole, the outcome it assumes
        self.estimate.update(proposal, [*after, -1])
        try:  # the plain draft model's chain, even where mla under load would answer by lookup alone
            block = yield from ModelDrafter.drafting(self, max_tokens, batch_rows, ahead=1)
        finally:
            del self.context[committed:]
            self.estimate.accepted, self.estimate.rejected = estimate
        self.ahead = (list(after), self.last_proposal)
        self.last_proposal = proposal
        return block

    def drafting(
        self, max_tokens: int, batch_rows: int = 1, ahead: int = 0
    ) -> Generator["DraftForward", "ScoredForward", DraftBlock]:
        """The proposal: yields each forward it needs and receives that forward's logits;
        `ahead` more tokens than its block, the first (run-ahead's guess of the target's next
        token) the draft's likeliest."""
        if not self.drafts_with_model(max_tokens):
            self.last_proposal = []
            return DraftBlock.empty()
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        token_probs: list[torch.Tensor] = []  # p_d of sampled tokens, for verification
        sampled = not self.sampling.greedy and not self.deterministic
        max_tokens = self.block_limit(max_tokens, batch_rows).length + ahead
        path_value = 1.0
        while len(tokens) < max_tokens:
            sequence = self.context + tokens
            sync_cache(self.cache, self.cached_tokens, sequence)
            pending = sequence[len(self.cached_tokens) :]
            guess = self.lookup(sequence, max_tokens - len(tokens) - 1)
            by_argmax = not sampled and self.grammar is None
            # a plain greedy chain drafts the rest of its block in one request: nothing between
            # its forwards needs the host (no guess to check, no threshold to test)
            thresholds = self.params.confidence_threshold or self.params.path_threshold
            follow = max_tokens - len(tokens) - 1 if by_argmax and not self.guesses and not thresholds else 0
            scored = yield DraftForward(self.cache, pending + guess, len(guess) + 1, by_argmax, follow)
            logits = scored.logits  # [len(guess) + 1 + follow, V]
            self.forwards += 1 + follow
            self.cached_tokens.extend(pending + guess + (scored.argmax_ids[:follow] if follow else []))
            usable = len(logits)
            if self.grammar is not None:  # after the uncommitted context (run-ahead's) and this block
                logits, usable = self.grammar.masked_chain(logits, sequence[self.grammar_start :], guess)
                if not usable:  # the grammar has ended: its stop is the verifier's to give
                    break
            if sampled:
                probs = sampling_probs(logits, self.sampling)
                # the guess of the target's next token is never verified as a draft: the likeliest
                predicted_ids = argmax(logits) if ahead and not tokens else sample(probs, self.generator)
                predicted = predicted_ids.tolist()
            elif self.grammar is not None:
                predicted = argmax(logits).tolist()
            else:  # read back with every session's in the round: nothing per session on the device
                predicted = scored.argmax_ids
            matched = common_prefix_length(guess, predicted, len(guess))
            kept, gated = min(matched + 1 + follow, usable), False
            if self.params.path_threshold > 0:  # keep up to the first token whose path value is <= tau
                values = path_value * logits[:kept].softmax(-1).amax(-1).double().cumprod(0)
                below = (values <= self.params.path_threshold).nonzero()
                if len(below):
                    kept, gated = int(below[0]) + 1, True
                path_value = float(values[kept - 1])
            tokens.extend(predicted[:kept])
            rows.append(logits[:kept])
            if self.grammar is not None and self.grammar.ends_within(self.context[self.grammar_start :] + tokens):
                gated = True  # the grammar has ended: nothing more to draft
            if sampled:
                token_probs.append(probs[:kept].gather(-1, predicted_ids[:kept, None]).squeeze(-1))
            threshold = self.params.confidence_threshold
            if gated or (threshold > 0 and logits[matched].softmax(-1).amax() < threshold):
                break
        self.last_proposal = tokens[:max_tokens]
        self.drafted += len(self.last_proposal)
        if not tokens:
            return DraftBlock.empty()
        return DraftBlock(
            tokens=torch.tensor(self.last_proposal, dtype=torch.long, device=self.model.device),
            ids=list(self.last_proposal),
            logits=torch.cat(rows)[:max_tokens],
            token_probs=torch.cat(token_probs)[:max_tokens] if sampled else None,
        )

    def commit(self, new_tokens: Sequence[int]) -> None:
        if self.last_proposal:
            self.estimate.update(self.last_proposal, new_tokens)
        # a run-ahead proposal was used when the verdict is the outcome it assumed: its tail is
        # the block proposed next
        (after, proposal), self.ahead = self.ahead, (None, [])
        used = after is not None and list(new_tokens) == ahead_outcome(after, proposal)
        self.last_proposal = proposal[1:] if used else []
        super().commit(new_tokens)
        if self.grammar is not None:
            self.grammar.commit(new_tokens)
            self.grammar_start = len(self.context)  # the context the grammar has consumed


class MultiLevelDrafter(ModelDrafter):
    name = "mla"
    Params = MultiLevelParams
    deterministic = True
    guesses = True
    reads_suffixes: ClassVar[bool] = True  # its first level may be suffix decoding (first_level.py)

    def __init__(
        self, model: torch.nn.Module, params: Optional[MultiLevelParams] = None, suffixes: Optional[SuffixCache] = None
    ):
        super().__init__(model, params)
        self.suffixes = suffixes

    def lookup(self, context: Sequence[int], max_tokens: int) -> list[int]:
        return self.lookups.guess(context, max_tokens)

    def reset(self, prompt_ids, sampling) -> None:
        super().reset(prompt_ids, sampling)
        self.lookups = first_level(self.params, self.suffixes)
        self.lookups.reset(prompt_ids, sampling)

    def drafting(self, max_tokens: int, batch_rows: int = 1) -> Generator["DraftForward", "ScoredForward", DraftBlock]:
        if not self.drafts_with_model(max_tokens):  # the lookup level alone
            self.last_proposal = []
            return self.lookups.propose(max_tokens, batch_rows)
        if batch_rows > 1 and self.params.adaptive:
            key, guess, lookup_value = self.lookups.choose(max_tokens, batch_rows)
            if guess and lookup_value > self.block_limit(max_tokens, batch_rows).value:
                self.last_proposal = []
                return self.lookups.proposed(key, guess)
        return (yield from super().drafting(max_tokens, batch_rows))

    def commit(self, new_tokens: Sequence[int]) -> None:
        self.lookups.commit(new_tokens)
        super().commit(new_tokens)


def propose_step(
    model: Optional[torch.nn.Module], proposals: Sequence[tuple[Drafter, int, int, Sequence[int]]]
) -> list[DraftBlock]:
    """One draft step over drafter sessions, each with its `(max_tokens, batch_rows, after)`
    (`after`: run-ahead's assumed tokens, drafters that draft ahead only): the chain model
    drafters' forwards (sessions of `model`) in lockstep, the tree model drafters' likewise, the
    others propose on their own."""
    blocks: list[Optional[DraftBlock]] = [None] * len(proposals)
    for kind, run_together in ((ModelDrafter, propose_together), (ModelTreeDrafter, draft_together)):
        indices = [index for index, (drafter, *_) in enumerate(proposals) if isinstance(drafter, kind)]
        draftings = [
            drafter.drafting_after(after, *limits) for drafter, *limits, after in map(proposals.__getitem__, indices)
        ]
        for index, block in zip(indices, run_together(model, draftings) if draftings else ()):
            blocks[index] = block
    return [
        block if block is not None else drafter.propose(*limits, *([after] if after else []))
        for block, (drafter, *limits, after) in zip(blocks, proposals)
    ]
