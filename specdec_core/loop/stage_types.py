"""The tensors that travel between drafter, target and policy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..api.sampling import SamplingParams, sampling_probs
from ..trees.tree import Topology


@dataclass
class DraftBlock:
    """K proposed tokens. `logits [K, V]` are the draft model's raw (T=1) logits when a model
    produced them. `token_probs [K]` holds p_d(c_i), the warped draft probability of each token,
    when the tokens were sampled (the drafter has the distribution at hand then, so verification
    never recomputes it). Otherwise the proposal is a deterministic function of the context,
    i.e. a one-hot draft distribution. With a `tree`, the K tokens are its nodes in its order
    (tree.py), each proposed after its parent (the root: the last committed token)."""

    tokens: torch.Tensor  # [K] int64
    logits: Optional[torch.Tensor] = None  # [K, V]
    token_probs: Optional[torch.Tensor] = None  # [K] float32, only for sampled proposals
    tree: Optional[Topology] = None
    ids: Optional[list[int]] = field(default=None, repr=False)  # `tokens` on the host, read once

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def token_ids(self) -> list[int]:
        """The tokens as a host list, read back from the device once per block."""
        if self.ids is None:
            self.ids = self.tokens.tolist()
        return self.ids

    @property
    def sampled(self) -> bool:
        return self.token_probs is not None

    def to(self, device: torch.device) -> "DraftBlock":
        """This block on `device` (the target's, where policies decide)."""
        if self.tokens.device == device:
            return self
        return DraftBlock(
            *(None if tensor is None else tensor.to(device) for tensor in (self.tokens, self.logits, self.token_probs)),
            tree=self.tree,
            ids=self.ids,
        )

    def part(self, start: int, stop: int) -> "DraftBlock":
        """Tokens `start..stop` of a chain, with their rows (a run-ahead proposal past its guess)."""
        rows = slice(start, stop)
        return DraftBlock(
            *(None if tensor is None else tensor[rows] for tensor in (self.tokens, self.logits, self.token_probs))
        )

    def probs(self, sampling: SamplingParams, vocab_size: int, rows=slice(None)) -> torch.Tensor:
        """The distribution the tokens were proposed from, `[K, V]` (or the selected rows)."""
        if self.sampled:
            return sampling_probs(self.logits[rows], sampling)
        return torch.nn.functional.one_hot(self.tokens[rows], vocab_size).float()

    @staticmethod
    def empty() -> "DraftBlock":
        return DraftBlock(tokens=torch.zeros(0, dtype=torch.long), ids=[])


@dataclass
class TargetBlock:
    """Target scores for `[last committed, d_1..d_K]`: row i scores draft token i, row K the bonus.
    `hidden [K+1, H]` is the final (post-norm) hidden state and `lm_head` maps it to logits;
    both are present when the scorer was asked for them (DropMatch). `token_log_probs [K]` is the
    target's log-prob of each draft token, exact even where a compact row (compact.py) holds only
    the top entries; present when the request asks for log-probs."""

    logits: torch.Tensor  # [K+1, V] float32
    hidden: Optional[torch.Tensor] = None
    lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    features: dict[str, torch.Tensor] = field(default_factory=dict)  # policy.target_features
    token_log_probs: Optional[torch.Tensor] = None
    batch_rows: int = 1  # sessions in the forward that scored this block
    # [K+1] each row's argmax, read back once for the whole step (target.forward_rows): a greedy
    # verdict then needs no device operation per request; None where the logits were not scored
    # so (or were changed after)
    argmax_ids: Optional[list[int]] = None
    preemptions: int = 0  # times the session's KV was taken back and recomputed so far (kv_room.py)
    # the verdict, where the target decided it beside its rows (target/verdicts.py): a served
    # target worker's sampled sessions get it in place of the rows, and `logits` holds none
    verdict: Optional["Verdict"] = None

    @property
    def vocab_size(self) -> int:
        return int(self.logits.shape[-1])

    def with_logits(self, logits: torch.Tensor) -> "TargetBlock":
        """This block with its rows changed (masked, penalized): the host argmax no longer holds."""
        return dataclasses.replace(self, logits=logits, argmax_ids=None)

    def along(self, nodes: list[int]) -> "TargetBlock":
        """A tree's rows at `nodes` (root first): the block of the chain they form."""
        argmax_ids = None if self.argmax_ids is None else [self.argmax_ids[node] for node in nodes]
        return TargetBlock(logits=self.logits[nodes], batch_rows=self.batch_rows, argmax_ids=argmax_ids)


@dataclass
class Prefilled:
    """What a target session's `reset` reports: the prompt's scores when the request asks for
    them, and its prompt tokens looked up in the KV pool's prefix cache and found there (vLLM's
    `prefix_cache_queries` and `prefix_cache_hits`, this request's)."""

    prompt_scores: Optional["PromptScores"] = None
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    decides_verdicts: bool = False  # its scores come with their verdicts (`TargetBlock.verdict`)


@dataclass
class PromptScores:
    """The target's log-probs of a prompt's tokens after the first, from its prefill: each
    token's and the top `n` alternatives at its position."""

    token_log_probs: torch.Tensor  # [P-1] float32
    top_ids: torch.Tensor  # [P-1, n] int64
    top_log_probs: torch.Tensor  # [P-1, n] float32

    @staticmethod
    def concat(parts: list["PromptScores"], num_top: int) -> "PromptScores":
        if not parts:  # a one-token prompt has no prefill
            return PromptScores(torch.zeros(0), torch.zeros(0, num_top, dtype=torch.long), torch.zeros(0, num_top))
        return PromptScores(
            torch.cat([part.token_log_probs for part in parts]),
            torch.cat([part.top_ids for part in parts]),
            torch.cat([part.top_log_probs for part in parts]),
        )


@dataclass
class Verdict:
    """Outcome of one verification: the first `num_accepted` draft tokens are kept, then
    `next_token` (a correction at the first rejection or the bonus after all K). `trace` holds
    per-position bool flags `[K]` ("accepted" always, plus the policy's own counters)."""

    num_accepted: int
    next_token: int
    trace: dict[str, torch.Tensor] = field(default_factory=dict)
    path: Optional[list[int]] = None  # a tree's: the root (0) and the accepted nodes

    @staticmethod
    def of_path(path: list[int], next_token: int) -> "Verdict":
        """A tree's verdict: the root (0) and its accepted nodes, then the next token."""
        return Verdict(len(path) - 1, next_token, {"accepted": torch.ones(len(path) - 1, dtype=torch.bool)}, path)

    def kept_tokens(self, draft: DraftBlock) -> list[int]:
        """The accepted draft tokens, in order."""
        if self.path is None:
            return draft.token_ids[: self.num_accepted]
        return [draft.token_ids[node - 1] for node in self.path[1:]]
