"""Everything about a request that needs no weights: tokenization, the chat template, validation
against the target's vocabulary and context length, the defaults of its speculative setup, and
turning emitted tokens into text under EOS, max_tokens and stop strings. The in-process engine
and the served one (deployments/remote_engine.py) share it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from .drafters import DRAFTERS, HeadsDrafter, validate_drafter
from .errors import SpecdecError, check_token_ids
from .policies import POLICIES, AcceptancePolicy, make_policy
from .profile import TargetProfile
from .request import ComponentSpec, GenerationRequest, LogProb, RequestDefaults, StreamChunk, TokenLogProbs
from .sampling import SamplingParams


@dataclass
class PreparedRequest:
    """A validated request with its defaults filled in: what the speculative loop runs."""

    prompt_ids: list[int]
    sampling: SamplingParams
    policy: AcceptancePolicy
    drafter: ComponentSpec
    num_draft_tokens: int


@dataclass
class OutputTracker:
    """Applies EOS, max_tokens and stop strings, and turns token ids into text deltas."""

    tokenizer: Any
    sampling: SamplingParams
    eos_ids: set[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_chars: int = 0
    finish_reason: Optional[str] = None

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens - len(self.token_ids)

    def append(self, new_tokens: Sequence[int], log_probs: Optional[list] = None) -> StreamChunk:
        """`log_probs`: logprobs.emitted_log_probs of `new_tokens`, when the request asks."""
        start = len(self.token_ids)
        for token in new_tokens:
            if token in self.eos_ids and not self.sampling.ignore_eos:
                self.finish_reason = "stop"
                break
            self.token_ids.append(token)
            if self.remaining == 0:
                self.finish_reason = "length"
                break
        if self.tokenizer is not None:
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            self._apply_stop_strings()
        chunk = StreamChunk(self.token_ids[start:], self._text_delta(), self.finish_reason)
        if log_probs is not None:
            chunk.log_probs = [
                TokenLogProbs(self._log_prob(token, log_prob), [self._log_prob(*entry) for entry in top])
                for token, log_prob, top in log_probs[: len(chunk.token_ids)]
            ]
        return chunk

    def _log_prob(self, token_id: int, log_prob: float) -> LogProb:
        token = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
        return LogProb(token_id, token, log_prob)

    def _apply_stop_strings(self) -> None:
        hits = [index for index in (self.text.find(stop) for stop in self.sampling.stop) if index >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"

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


class Frontend:
    def __init__(
        self,
        tokenizer: Any,
        model_config: Any,
        generation_config: Any = None,
        defaults: Optional[RequestDefaults] = None,
        max_tokens_limit: Optional[int] = None,
        profile: Callable[[], Optional[TargetProfile]] = lambda: None,
        num_heads: Callable[[], int] = lambda: 0,
    ):
        """`profile`: the target's profile, asked for only by requests whose policy takes a
        default from it (EASD without tau_h); None where the target has none. `num_heads`: the
        target's multi-token heads (drafter `heads`), 0 where it has none."""
        self.tokenizer = tokenizer
        self.profile = profile
        self.num_heads = num_heads
        self.vocab_size = model_config.vocab_size
        self.max_positions = getattr(model_config, "max_position_embeddings", 1 << 20)
        self.defaults = defaults or RequestDefaults()
        self.max_tokens_limit = max_tokens_limit  # a deployment's cap, below SamplingParams' own
        eos = getattr(generation_config, "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = eos_ids

    @classmethod
    def from_spec(
        cls, spec, defaults: Optional[RequestDefaults] = None, max_tokens_limit: Optional[int] = None
    ) -> "Frontend":
        """The front end of a `ModelSpec`'s checkpoint, from its tokenizer and configs alone."""
        from .loader import load_configs, load_tokenizer

        return cls(load_tokenizer(spec), *load_configs(spec), defaults, max_tokens_limit)

    def encode(self, request: GenerationRequest) -> list[int]:
        if request.prompt_ids is not None:
            check_token_ids(request.prompt_ids, self.vocab_size, "prompt")
            return list(request.prompt_ids)
        if self.tokenizer is None:
            raise SpecdecError("this engine has no tokenizer: send prompt_ids", "prompt")
        if request.messages is not None:
            text = self.tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return self.tokenizer(request.prompt).input_ids

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validate a request and fill in its defaults; raises SpecdecError with a clear message."""
        sampling = request.sampling
        if self.max_tokens_limit is not None and sampling.max_tokens > self.max_tokens_limit:
            raise SpecdecError(f"max_tokens must be <= {self.max_tokens_limit}", "max_tokens")
        if sampling.top_k > self.vocab_size:
            raise SpecdecError(f"top_k must be <= the vocabulary size ({self.vocab_size})", "top_k")
        policy_spec = request.policy or self.defaults.policy_for(sampling)
        policy = make_policy(policy_spec.name, policy_spec.params)
        if policy.needs_profile:
            policy = policy.for_target(self.profile())
        if not sampling.greedy and not policy.supports_sampling:
            raise SpecdecError(f"policy {policy.name!r} needs temperature 0; use 'rejection' to sample", "policy")
        drafter = request.drafter or self.defaults.drafter
        validate_drafter(drafter.name, drafter.params)
        if DRAFTERS[drafter.name].proposes_trees and not policy.supports_trees:
            trees = ", ".join(sorted(name for name, cls in POLICIES.items() if cls.supports_trees))
            raise SpecdecError(
                f"drafter {drafter.name!r} proposes trees; policy {policy.name!r} has no tree rule "
                f"(policies with one: {trees})",
                "policy",
            )
        if drafter.name == HeadsDrafter.name and not self.num_heads():
            raise SpecdecError("drafter 'heads' needs multi-token heads on the target; this one has none", "drafter")
        num_draft_tokens = request.num_draft_tokens or self.defaults.num_draft_tokens
        prompt_ids = self.encode(request)
        prompt_field = "messages" if request.messages is not None else "prompt"
        if not prompt_ids:
            raise SpecdecError("prompt encodes to zero tokens", prompt_field)
        budget = self.max_positions - sampling.max_tokens - num_draft_tokens
        if len(prompt_ids) > budget:
            raise SpecdecError(
                f"prompt has {len(prompt_ids)} tokens; with max_tokens={sampling.max_tokens} "
                f"the limit is {max(budget, 0)}",
                prompt_field,
            )
        return PreparedRequest(prompt_ids, sampling, policy, drafter, num_draft_tokens)

    def output(self, sampling: SamplingParams) -> OutputTracker:
        return OutputTracker(self.tokenizer, sampling, self.eos_ids)
