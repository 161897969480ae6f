"""A request's output as the loop emits it: the stop rules (EOS, `stop_token_ids`, stop strings,
`min_tokens`, `max_tokens`) and token ids turned into streamed text, with vLLM's semantics:

- a stop token (EOS unless `ignore_eos`, or one of `stop_token_ids`) ends the output and stays
  in its token ids and count; its text is left out unless `include_stop_str_in_output`;
- a stop string cuts the text before it (after it with `include_stop_str_in_output`); the token
  ids that made it stay;
- nothing stops the output within its first `min_tokens` tokens: the target's distribution
  there has no stop tokens (`early_stops_masked`), and a stop string counts only where it ends
  past their text;
- `stop_reason` is the stop token id or string that ended it (None for EOS or length)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Optional, Sequence, Union

import torch

from ..loop.stage_types import PromptScores, TargetBlock
from ..trees.tree import Topology
from .request import LogProb, StreamChunk, TokenLogProbs
from .sampling import SamplingParams


@dataclass
class OutputTracker:
    tokenizer: Any
    sampling: SamplingParams
    eos_ids: set[int]
    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_chars: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    stopped_by_token: bool = False
    min_tokens_chars: Optional[int] = None  # the text of the first min_tokens tokens, once there

    def __post_init__(self):
        self.stop_ids = set(self.sampling.stop_token_ids) | (set() if self.sampling.ignore_eos else self.eos_ids)
        if self.sampling.max_tokens == 0:  # only the prompt is scored
            self.finish_reason = "length"

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens - len(self.token_ids)

    def suppress_early_stops(self, block: TargetBlock, tree: Optional[Topology]) -> TargetBlock:
        """`block` with the stop tokens masked in the rows that decide one of the first
        `min_tokens` tokens (`early_stops_masked`): what the policy verifies."""
        return early_stops_masked(block, tree, len(self.token_ids), self.sampling.min_tokens, self.stop_ids)

    def append(self, new_tokens: Sequence[int], log_probs: Optional[list] = None) -> StreamChunk:
        """`log_probs`: logprobs.emitted_log_probs of `new_tokens`, when the request asks."""
        start = len(self.token_ids)
        for token in new_tokens:
            self.token_ids.append(token)
            if token in self.stop_ids and len(self.token_ids) > self.sampling.min_tokens:
                self.finish_reason, self.stopped_by_token = "stop", True
                self.stop_reason = token if token in self.sampling.stop_token_ids else None
                break
            if self.remaining == 0:
                self.finish_reason = "length"
                break
        if self.tokenizer is not None:
            shown = self.token_ids
            if self.stopped_by_token and not self.sampling.include_stop_str_in_output:
                shown = shown[:-1]
            self.text = self.decode(shown)
            self._apply_stop_strings()
        chunk = self.chunk(self.token_ids[start:], self._text_delta())
        if log_probs is not None:
            chunk.log_probs = [
                TokenLogProbs(self._log_prob(token, log_prob), [self._log_prob(*entry) for entry in top])
                for token, log_prob, top in log_probs[: len(chunk.token_ids)]
            ]
        return chunk

    def chunk(self, token_ids: list[int], text: str) -> StreamChunk:
        return StreamChunk(
            token_ids, text, self.finish_reason, stop_reason=self.stop_reason, prompt_tokens=self.prompt_tokens
        )

    def prompt_chunk(self, prompt_ids: Sequence[int], scores: PromptScores) -> StreamChunk:
        """The chunk that carries the prompt's log-probs (before any token)."""
        first = TokenLogProbs(self._log_prob(prompt_ids[0], None), [])
        rest = [
            TokenLogProbs(self._log_prob(token, log_prob), [self._log_prob(*entry) for entry in zip(ids, values)])
            for token, log_prob, ids, values in zip(
                prompt_ids[1:], scores.token_log_probs.tolist(), scores.top_ids.tolist(), scores.top_log_probs.tolist()
            )
        ]
        chunk = self.chunk([], "")
        chunk.prompt_log_probs = [first, *rest]
        return chunk

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.sampling.skip_special_tokens)

    def _log_prob(self, token_id: int, log_prob: Optional[float]) -> LogProb:
        token = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
        return LogProb(token_id, token, log_prob)

    def _apply_stop_strings(self) -> None:
        """The earliest stop string that ends past the first `min_tokens` tokens' text."""
        if not self.sampling.stop:
            return
        if self.min_tokens_chars is None:
            if len(self.token_ids) < self.sampling.min_tokens:
                return
            self.min_tokens_chars = len(self.decode(self.token_ids[: self.sampling.min_tokens]))
        hits = [
            (index, stop)
            for stop in self.sampling.stop
            if (index := self.text.find(stop, max(0, self.min_tokens_chars - len(stop) + 1))) >= 0
        ]
        if hits:
            index, stop = min(hits, key=lambda hit: hit[0])
            self.text = self.text[: index + (len(stop) if self.sampling.include_stop_str_in_output else 0)]
            self.finish_reason, self.stop_reason = "stop", stop

    def _text_delta(self) -> str:
        safe_end = len(self.text)
        if self.finish_reason is None:
            # hold back an incomplete UTF-8 sequence and a possible stop-string prefix
            safe_end = len(self.text.rstrip("\ufffd"))
            if self.sampling.stop:
                safe_end = max(self.emitted_chars, safe_end - max(map(len, self.sampling.stop)) + 1)
        delta = self.text[self.emitted_chars : safe_end]
        self.emitted_chars = max(self.emitted_chars, safe_end)
        return delta


def early_stops_masked(
    block: TargetBlock, tree: Optional[Topology], generated: int, min_tokens: int, stop_ids: Collection[int]
) -> TargetBlock:
    """`block` with `stop_ids` at -inf in the rows that decide one of the first `min_tokens`
    tokens, `generated` being made already (vLLM's min-tokens logits processor). One rule for the
    server's loop and a target worker that decides verdicts itself (target/verdicts.py)."""
    if not stop_ids or generated >= min_tokens:  # no row is early
        return block
    depths = tree.depths if tree is not None else torch.arange(block.logits.shape[0])  # [rows]
    early = (generated + depths < min_tokens).to(block.logits.device)  # [rows]
    logits = block.logits.clone()  # [rows, V]
    stops = torch.tensor(sorted(stop_ids), device=logits.device)
    logits[:, stops] = logits[:, stops].masked_fill(early[:, None], float("-inf"))  # no read back of `early`
    return block.with_logits(logits)
