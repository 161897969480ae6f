"""One request's grammar on its speculative loop. Before scoring, a draft is cut at its first
token the grammar forbids (so no policy, however loose, can accept one). After scoring, each
row's forbidden tokens go to -inf: row r after the committed tokens and d_1..d_r, found by
walking the matcher through the drafts and rolling it back, so the correction or bonus token is
drawn from the masked distribution. The matcher consumes only what the verdict commits: a
rejected draft is never in its state, as it is never in the KV cache."""

from __future__ import annotations

from typing import Optional, Sequence

import llguidance
import numpy as np
import torch

from ..loop.stage_types import DraftBlock, TargetBlock


class GrammarState:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def fork(self) -> "GrammarState":
        """An independent copy at the same point (a draft model's, following its own commits)."""
        return GrammarState(self.matcher.deep_copy(), self.vocab_size)

    def allowed(self, width: Optional[int] = None) -> torch.Tensor:
        """`[width]` bool (default: the vocabulary): the tokens the grammar allows next; a row
        wider than the tokenizer's vocabulary (padding) allows none of the extra ones."""
        width = width or self.vocab_size
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.zeros(width, dtype=torch.bool)
        known = min(width, self.vocab_size, len(bits))
        allowed[:known] = torch.from_numpy(bits[:known].astype(bool))
        return allowed

    def masked_chain(
        self, logits: torch.Tensor, prefix: Sequence[int], guess: Sequence[int]
    ) -> tuple[torch.Tensor, int]:
        """A draft model's `logits` `[R, V]` for the positions after `prefix` (drafted, not yet
        committed) and then after each of `guess[:j]` (row j), each row's forbidden tokens at
        -inf, and how many rows come before the grammar's end (after it, only its stop is left,
        which the verifier gives itself: nothing to draft). The matcher is left where it was."""
        prefix = list(prefix)
        if self.matcher.validate_tokens(prefix) < len(prefix):
            return logits, 0  # a prefix the grammar forbids: an unmasked lookup, assumed ahead
        consumed = 0
        try:
            for token in prefix:
                self.advance(token)
                consumed += 1
            allowed, open_rows = self.allowed_rows(guess, logits.shape[0], logits.shape[-1])
        finally:
            self.matcher.rollback(consumed)
        return logits.masked_fill(~allowed.to(logits.device), float("-inf")), open_rows

    def allowed_rows(self, tokens: Sequence[int], count: int, width: int) -> tuple[torch.Tensor, int]:
        """`[count, width]` bool: the tokens allowed after each of `tokens[:j]` (row j), and how
        many of the rows walked come before the grammar's end. The walk stops at the end, past
        `tokens` or at a forbidden token; the rows after it repeat its last (nothing reads them
        but the target's row after the end, which allows only the stop). The matcher is left
        where it was."""
        consumed, rows, ended = 0, [], False
        try:
            for index in range(count):
                ended = self.matcher.is_stopped()  # then this row is the walk's last
                rows.append(self.allowed(width))
                if index >= len(tokens) or not rows[-1][tokens[index]] or not self.advance(tokens[index]):
                    break
                consumed += 1
        finally:
            self.matcher.rollback(consumed)
        return torch.stack(rows + [rows[-1]] * (count - len(rows))), len(rows) - ended

    def ends_within(self, tokens: Sequence[int]) -> bool:
        """Whether the grammar has ended after `tokens` (allowed ones, not committed)."""
        consumed = 0
        try:
            for token in tokens:
                if not self.advance(token):
                    return True
                consumed += 1
            return self.matcher.is_stopped()
        finally:
            self.matcher.rollback(consumed)

    def within(self, draft: DraftBlock) -> DraftBlock:
        """`draft` up to its first forbidden token (a chain)."""
        allowed = self.matcher.validate_tokens(draft.token_ids)
        return draft if allowed == draft.num_tokens else draft.part(0, allowed)

    def masked(self, block: TargetBlock, draft: DraftBlock) -> TargetBlock:
        """`block` with each row's forbidden tokens at -inf; `draft` lies within the grammar."""
        allowed, _ = self.allowed_rows(draft.token_ids, draft.num_tokens + 1, self.vocab_size)  # [1 + K, V]
        return block.with_logits(block.logits.masked_fill(~allowed.to(block.logits.device), float("-inf")))

    def advance(self, token: int) -> bool:
        """Consume `token`; False where the grammar has ended (what follows is its EOS)."""
        if self.matcher.is_stopped():
            return False
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused a token it allowed: {self.matcher.get_error()}")
        return True

    def commit(self, tokens: list[int]) -> None:
        for token in tokens:
            if not self.advance(token):
                return
