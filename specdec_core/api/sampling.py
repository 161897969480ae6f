"""Sampling parameters and the logits -> distribution warps shared by drafters and policies."""

from __future__ import annotations

import itertools
import secrets
from typing import Literal, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..structured.constraint_spec import StructuredOutput

INT32_MAX = (1 << 31) - 1
MAX_TOP_LOGPROBS = 20
MAX_TOKENS = 32768  # the most tokens a request may ask for (a deployment may allow fewer)


class SamplingParams(BaseModel):
    """Per-request decoding settings, with OpenAI's semantics and vLLM's extensions (`top_k`,
    `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
    `include_stop_str_in_output`, `skip_special_tokens`, `prompt_logprobs`); temperature 0 means
    greedy. The penalties and `logit_bias` change the target's distribution itself
    (target/logits_processors.py), and `structured_output` masks it (structured/): greedy
    decoding takes its argmax too."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=INT32_MAX, description="0 disables top-k filtering")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top token's probability")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted once from each generated token")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted per occurrence in the output")
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=100.0, description="divides positive logits (multiplies others) of prompt and output tokens"
    )
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> logit offset (-100..100)")
    structured_output: Optional[StructuredOutput] = Field(None, description="what the output must match")
    max_tokens: Optional[int] = Field(
        None,
        ge=0,
        le=MAX_TOKENS,
        description="None: to a stop or the context's end (Frontend.prepare); 0: prefill only",
    )
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS, description="no stop token or stop string ends output before")
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list, description="tokens that end the output, as EOS does")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed: Optional[int] = Field(None, ge=-(1 << 63), lt=1 << 63, description="None: fresh randomness each request")
    ignore_eos: bool = False
    logprobs: Optional[int] = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="return the target log-prob of each token and this many top ones"
    )
    prompt_logprobs: Optional[int] = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="likewise for each prompt token after the first (the prefill's)"
    )

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: list[str]) -> list[str]:
        if any(not string for string in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, logit_bias: dict[int, float]) -> dict[int, float]:
        if any(not -100.0 <= bias <= 100.0 for bias in logit_bias.values()):
            raise ValueError("logit_bias values must lie in [-100, 100]")
        return logit_bias

    @model_validator(mode="after")
    def _min_within_max(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise PydanticCustomError("min_tokens", "min_tokens must be <= max_tokens", {"param": "min_tokens"})
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        """Whether a penalty reads the tokens generated so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Whether the target's distribution is changed before any policy reads it."""
        return bool(self.penalizes or self.logit_bias or self.structured_output)

    def seeded(self) -> "SamplingParams":
        """These settings with a seed: a fresh one where none was given (OpenAI's and vLLM's rule),
        drawn once per request, so that every part of it (verifier, drafter, the target's features,
        every tensor-parallel rank) draws from streams of the same seed."""
        return self if self.seed is not None else self.model_copy(update={"seed": secrets.randbits(63)})

    def generator(self, role: Literal["verify", "draft", "target"]) -> torch.Generator:
        """The request's RNG for one role. Verifier, drafter and the target's policy features
        draw from separate streams seeded from `seed`, so a request is reproducible wherever its
        pieces run (`seeded` gives a request its seed; a lone object without one draws fresh
        randomness). It lives on the host, on every device: draws are made there and moved."""
        if self.seed is None:
            generator = torch.Generator()
            generator.seed()
            return generator
        return torch.Generator().manual_seed(self.seed + SEED_OFFSETS[role])


SEED_OFFSETS = {"verify": 0, "draft": 1, "target": 2}


def warp_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p applied to `logits [..., V]`, in vLLM's order;
    filtered entries become -inf."""
    logits = logits.float() / sampling.temperature
    if sampling.min_p > 0.0:
        probs = logits.softmax(-1)  # [..., V]
        logits = logits.masked_fill(probs < sampling.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        logits = nucleus(logits, sampling.top_p)
    return logits


# on the CPU, where a host decides sampled verdicts over whole rows (a CPU target worker's, or the
# server's), the nucleus is looked for among a row's top entries first: sorting 9 rows of a 128k
# vocabulary took 120 ms there
NUCLEUS_CANDIDATES = (256, 4096)


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits [..., V]` with each token outside its row's top-p nucleus at -inf: a token is dropped
    when the mass strictly before it, in descending order, already reaches top_p (keeps >= 1). On
    the CPU each row is decided by the first candidate count whose last entry it drops (the same
    prefix sums as a full sort's, so the same tokens kept), the rows left by a full sort: a step's
    many rows do not all pay for one wide nucleus. On a device, a full sort (a check would read back)."""
    vocab_size = logits.shape[-1]
    rows = logits.reshape(-1, vocab_size)  # [R, V]
    log_total = rows.logsumexp(-1, keepdim=True)  # [R, 1]
    keep = torch.zeros_like(rows, dtype=torch.bool)  # [R, V]

    def mark(indices: Optional[torch.Tensor], order: torch.Tensor, kept: torch.Tensor) -> None:
        """Rows `indices` (None: all) keep their entries `order [r, count]` where `kept [r, count]`."""
        if indices is None:
            keep.scatter_(-1, order, kept)
        else:
            keep[indices] = keep[indices].scatter_(-1, order, kept)

    counts = [count for count in NUCLEUS_CANDIDATES if count < vocab_size] if logits.device.type == "cpu" else []
    left = None  # [r] the rows not decided yet (None: all R)
    for count in (*counts, vocab_size):
        part, part_total = (rows, log_total) if left is None else (rows[left], log_total[left])
        top, order = torch.topk(part, count, dim=-1)  # [r, count] descending (count = V: sorted)
        probs = (top - part_total).exp()
        before = probs.cumsum(-1) - probs  # [r, count] the mass strictly before each
        if count == vocab_size or bool((decided := before[:, -1] >= top_p).all()):  # [r]
            mark(left, order, before < top_p)
            break
        # a row that keeps its last candidate may reach past them: it goes on to the next count
        done = decided.nonzero()[:, 0]  # [d] among the r
        mark(done if left is None else left[done], order[done], before[done] < top_p)
        left = (~decided).nonzero()[:, 0] if left is None else left[~decided]
    return logits.masked_fill(~keep.view_as(logits), float("-inf"))


def sampling_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The distribution tokens are sampled from: warped softmax at T > 0, one-hot argmax at T = 0."""
    if sampling.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    return warp_logits(logits, sampling).softmax(-1)


def sample(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id per row of `weights [N, V]` (non-negative, not necessarily normalized), by
    inverse CDF from one uniform draw per row (on CPU, torch.multinomial costs many times the
    cumulative sum over a large vocabulary)."""
    return sample_with(weights, sample_draws(generator, weights.shape[0]))


def sample_draws(generator: torch.Generator, rows: int = 1) -> torch.Tensor:
    """The uniforms `[rows, 1]` (float64, on the host) that `sample` draws for `rows` rows."""
    return torch.rand(rows, 1, generator=generator, dtype=torch.float64)


def sample_with(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """`sample` from uniforms drawn before (`sample_draws`, `[N, 1]`): a step draws every request's
    on the host first, then samples them all in one pass. Draws lie in [0, 1), so (1 - u) times
    the total lies in (0, total] and the first index whose CDF reaches it has positive weight."""
    cdf = weights.double().cumsum(-1)  # [N, V]
    uniform = uniform.to(cdf.device, non_blocking=True)  # a host draw: the copy need not wait for the device
    return torch.searchsorted(cdf, (1.0 - uniform) * cdf[:, -1:]).squeeze(-1)


def argmax(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """`logits.argmax(-1)` (first maximum) for `[..., V]`. torch's CPU argmax over a long last dim
    is not vectorized while amax is (docs/architecture.md, "Why the CPU kernels"): take the max of each chunk
    of `chunk` entries, then argmax only inside the first chunk holding the row maximum."""
    vocab_size = logits.shape[-1]
    num_chunks = vocab_size // chunk
    if num_chunks < 2:
        return logits.argmax(-1)
    rows = logits.reshape(-1, vocab_size)
    chunks = rows[:, : num_chunks * chunk].unflatten(-1, (num_chunks, chunk))
    chunk_max = chunks.amax(-1)  # [R, num_chunks]
    best_chunk = chunk_max.argmax(-1)
    row_index = torch.arange(rows.shape[0], device=rows.device)
    best = best_chunk * chunk + chunks[row_index, best_chunk].argmax(-1)
    if num_chunks * chunk < vocab_size:  # the tail wins only when strictly larger (first maximum)
        tail_max, tail_argmax = rows[:, num_chunks * chunk :].max(-1)
        best = torch.where(tail_max > chunk_max[row_index, best_chunk], num_chunks * chunk + tail_argmax, best)
    return best.reshape(logits.shape[:-1])


def argmax_lists(logits: torch.Tensor, sizes: Sequence[int]) -> list[list[int]]:
    """The argmax of each row of `logits` `[sum(sizes), V]` as host lists, one per part of
    `sizes` rows: one operation and one read back for a whole step, whatever its rows."""
    flat = argmax(logits).tolist()
    ends = list(itertools.accumulate(sizes))
    return [flat[end - size : end] for size, end in zip(sizes, ends)]


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last dim (0 log 0 = 0)."""
    return -torch.special.xlogy(probs, probs).sum(-1)


def entropy_of_probs(probs: torch.Tensor, log_weights: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of `probs = softmax(log_weights)` with one dot product and no log pass:
    H = logsumexp(w) - sum p w, and logsumexp(w) = max w - log max p. Filtered (-inf) entries
    have zero probability and are zeroed first."""
    finite_weights = log_weights.clamp_min(torch.finfo(log_weights.dtype).min)
    log_normalizer = log_weights.amax(-1) - probs.amax(-1).log()
    return log_normalizer - torch.linalg.vecdot(probs, finite_weights)


def entropy_of_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax(logits): one exp pass, several times faster than
    entropy(softmax) over a 49k vocabulary."""
    logits = logits.float()
    return entropy_of_probs(logits.softmax(-1), logits)
