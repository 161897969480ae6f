"""One request's grammar on its speculative loop. Before scoring, a draft is cut at its first
token the grammar forbids (so no policy, however loose, can accept one). After scoring, each
row's forbidden tokens go to -inf: row r after the committed tokens and d_1..d_r, found by
walking the matcher through the drafts and rolling it back, so the correction or bonus token is
drawn from the masked distribution. The matcher consumes only what the verdict commits: a
rejected draft is never in its state, as it is never in the KV cache."""

from __future__ import annotations

import llguidance
import numpy as np
import torch

from ..loop.stage_types import DraftBlock, TargetBlock


class GrammarState:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def allowed(self) -> torch.Tensor:
        """`[V]` bool: the tokens the grammar allows next."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].astype(bool))

    def within(self, draft: DraftBlock) -> DraftBlock:
        """`draft` up to its first forbidden token (a chain)."""
        allowed = self.matcher.validate_tokens(draft.token_ids)
        return draft if allowed == draft.num_tokens else draft.part(0, allowed)

    def masked(self, block: TargetBlock, draft: DraftBlock) -> TargetBlock:
        """`block` with each row's forbidden tokens at -inf; `draft` lies within the grammar."""
        rows, consumed = [self.allowed()], 0  # each row [V]
        for token in draft.token_ids:
            if not self.advance(token):
                break  # the grammar ended at this token (EOS): no row after it is read
            consumed += 1
            rows.append(self.allowed())
        self.matcher.rollback(consumed)
        rows += [rows[-1]] * (draft.num_tokens + 1 - len(rows))
        allowed = torch.stack(rows).to(block.logits.device)  # [1 + K, V]
        return block.with_logits(block.logits.masked_fill(~allowed, float("-inf")))

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
