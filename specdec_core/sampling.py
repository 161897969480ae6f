"""Sampling parameters and the logits -> distribution warps shared by drafters and policies."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """Per-request decoding settings (OpenAI semantics; temperature 0 means greedy)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k filtering")
    max_tokens: int = Field(128, ge=1, le=32768)
    stop: list[str] = Field(default_factory=list)
    seed: int = 0
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to `logits [..., V]`; filtered entries become -inf."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The distribution tokens are sampled from: warped softmax at T > 0, one-hot argmax at T = 0."""
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return warp_logits(logits, sampling).softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id per row of `probs [N, V]`."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last dim (0 log 0 = 0)."""
    return -torch.special.xlogy(probs, probs).sum(-1)


def entropy_of_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) for finite logits: one log-softmax and one dot product,
    ~3x faster than entropy(softmax) over a 49k vocabulary."""
    log_probs = logits.float().log_softmax(-1)
    return -torch.linalg.vecdot(log_probs.exp(), log_probs)
