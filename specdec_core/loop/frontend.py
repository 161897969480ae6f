"""Everything about a request that needs no weights: tokenization, the chat template, validation
against the target's vocabulary and context length, and the defaults of its speculative setup
and its length; its output's stop rules and text are output.py's. The in-process engine and the
served one (deployments/ingress/remote_engine.py) share it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from jinja2 import TemplateError

from ..api.errors import SpecdecError, check_token_ids
from ..api.output import OutputTracker
from ..api.request import ComponentSpec, GenerationRequest, RequestDefaults, session_positions
from ..api.sampling import MAX_TOKENS, SamplingParams
from ..calibration.draft_costs import DraftCosts
from ..calibration.profile_types import TargetProfile
from ..drafters import DRAFTERS, DraftSource, validate_drafter
from ..drafters.block_length import device_verify_cost
from ..heads.contract import heads_kind_for
from ..models.loader import load_configs, load_tokenizer
from ..policies import POLICIES, AcceptancePolicy, make_policy
from ..structured.grammar_compiler import GrammarCompiler
from ..structured.grammar_state import GrammarState


@dataclass
class PreparedRequest:
    """A validated request with its defaults filled in: what the speculative loop runs."""

    prompt_ids: list[int]
    sampling: SamplingParams
    policy: AcceptancePolicy
    drafter: ComponentSpec
    num_draft_tokens: int
    run_ahead: bool = False  # a draft model's chains are drafted ahead (run_ahead.py)
    heads_kind: Optional[str] = None  # the kind of the target's heads the drafter reads (heads.heads_kind_for)
    grammar: Optional[GrammarState] = None  # what the output must match (sampling.structured_output)


class Frontend:
    def __init__(
        self,
        tokenizer: Any,
        model_config: Any,
        generation_config: Any = None,
        defaults: Optional[RequestDefaults] = None,
        max_tokens_limit: Optional[int] = None,
        profile: Callable[[], Optional[TargetProfile]] = lambda: None,
        heads: Callable[[], dict[str, int]] = dict,
        target_device: Callable[[], str] = lambda: "cpu",
        draft_costs: Callable[[], Optional[DraftCosts]] = lambda: None,
    ):
        """`profile`: the target's profile, asked for only by requests whose policy takes a
        default from it (EASD without tau_h); None where the target has none. `heads`: the number
        of the target's multi-token heads (drafters `heads`, `eagle3`) by kind (medusa, hydra,
        eagle3), empty where it has none; `target_device`: the device type the
        target runs on, whose verify-cost curve prices blocks and trees by default; `draft_costs`:
        the draft model's measured costs beside the target (draft_costs.py), None where unmeasured."""
        self.tokenizer = tokenizer
        self.grammars: Optional[GrammarCompiler] = None  # built at the first structured request
        self.profile = profile
        self.heads, self.target_device, self.draft_costs = heads, target_device, draft_costs
        self.vocab_size = model_config.vocab_size
        self.model_family = getattr(model_config, "model_type", None) or "unknown"
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
        return cls(load_tokenizer(spec), *load_configs(spec), defaults, max_tokens_limit)

    def encode(self, request: GenerationRequest) -> list[int]:
        if request.prompt_ids is not None:
            check_token_ids(request.prompt_ids, self.vocab_size, "prompt")
            return list(request.prompt_ids)
        return self.tokenize(request.prompt, request.messages, tools=request.tools)

    def tokenize(
        self,
        prompt: Optional[str] = None,
        messages: Optional[list[dict]] = None,
        add_special_tokens: Optional[bool] = None,
        add_generation_prompt: bool = True,
        tools: Optional[list[dict]] = None,
    ) -> list[int]:
        """A text or a chat (and the `tools` its template shows) as token ids. By default special
        tokens are added to a text and not to a chat, whose template holds them (vLLM's defaults)."""
        if self.tokenizer is None:
            raise SpecdecError("this engine has no tokenizer: send prompt_ids", "prompt")
        if messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
                )
            except TemplateError as error:  # the template refuses the chat (its raise_exception)
                raise SpecdecError(f"the chat template refuses these messages: {error}", "messages") from error
            return self.tokenizer(text, add_special_tokens=bool(add_special_tokens)).input_ids
        return self.tokenizer(prompt, add_special_tokens=add_special_tokens is not False).input_ids

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text, special tokens kept (an echoed prompt's); "" without a tokenizer."""
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validate a request and fill in its defaults; raises SpecdecError with a clear message."""
        sampling = request.sampling
        if self.max_tokens_limit is not None and (sampling.max_tokens or 0) > self.max_tokens_limit:
            raise SpecdecError(f"max_tokens must be <= {self.max_tokens_limit}", "max_tokens")
        if sampling.top_k > self.vocab_size:
            raise SpecdecError(f"top_k must be <= the vocabulary size ({self.vocab_size})", "top_k")
        check_token_ids(sampling.stop_token_ids, self.vocab_size, "stop_token_ids")
        check_token_ids(list(sampling.logit_bias), self.vocab_size, "logit_bias")
        policy_spec = request.policy or self.defaults.policy_for(sampling)
        policy = make_policy(policy_spec.name, policy_spec.params)
        if policy.needs_profile:
            policy = policy.for_target(self.profile())
        if policy.needs_hidden and sampling.processes_logits:  # its LM-head paths would skip them
            raise SpecdecError(f"policy {policy.name!r} takes no penalties, logit_bias or structured_output", "policy")
        if not sampling.greedy and not policy.supports_sampling:
            raise SpecdecError(f"policy {policy.name!r} needs temperature 0; use 'rejection' to sample", "policy")
        drafter = self.priced(request.drafter or self.defaults.drafter)
        validate_drafter(drafter.name, drafter.params)
        if DRAFTERS[drafter.name].proposes_trees and not policy.supports_trees:
            trees = ", ".join(sorted(name for name, cls in POLICIES.items() if cls.supports_trees))
            raise SpecdecError(
                f"drafter {drafter.name!r} proposes trees; policy {policy.name!r} has no tree rule "
                f"(policies with one: {trees})",
                "policy",
            )
        heads_kind = None
        if DRAFTERS[drafter.name].drafts_from is DraftSource.TARGET_HEADS:
            needed, held = DRAFTERS[drafter.name].heads_kind, self.heads()
            heads_kind = heads_kind_for(held, needed)
            if heads_kind is None:
                wanted = "an EAGLE-3 layer" if needed == "eagle3" else "multi-token heads"
                message = f"drafter {drafter.name!r} needs {wanted} on the target; it has {', '.join(held) or 'none'}"
                raise SpecdecError(message, "drafter")
        num_draft_tokens = request.num_draft_tokens or self.defaults.num_draft_tokens
        prompt_ids = self.encode(request)
        prompt_field = "messages" if request.messages is not None else "prompt"
        if not prompt_ids:
            raise SpecdecError("prompt encodes to zero tokens", prompt_field)
        run_ahead = self.defaults.run_ahead if request.run_ahead is None else request.run_ahead
        return PreparedRequest(
            prompt_ids,
            self.resolve_length(sampling.seeded(), len(prompt_ids), num_draft_tokens, prompt_field),
            policy,
            drafter,
            num_draft_tokens,
            run_ahead and DRAFTERS[drafter.name].drafts_ahead,
            heads_kind,
            self.grammar_state(sampling, drafter),
        )

    def grammar_state(self, sampling: SamplingParams, drafter: ComponentSpec) -> Optional[GrammarState]:
        """The request's grammar at the output's start (compiled once per constraint)."""
        if sampling.structured_output is None:
            return None
        if self.tokenizer is None:
            raise SpecdecError("structured_output needs the target's tokenizer", "structured_output")
        if DRAFTERS[drafter.name].proposes_trees:
            raise SpecdecError(f"structured_output takes chain drafters, not {drafter.name!r}", "drafter")
        if sampling.min_tokens:  # a grammar that has ended allows only the stop it would forbid
            raise SpecdecError("structured_output takes no min_tokens", "min_tokens")
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self.grammars.state(sampling.structured_output)

    def priced(self, drafter: ComponentSpec) -> ComponentSpec:
        """`drafter` with the prices it leaves out (block_length.py): the verify-cost curve of
        the target's device, and for a draft model's drafters this machine's draft costs where
        they were measured (draft_costs.py)."""
        if drafter.name not in DRAFTERS:
            return drafter
        fields = DRAFTERS[drafter.name].Params.model_fields
        prices = {"verify_cost": list(device_verify_cost(self.target_device()))}
        draft_costs = self.draft_costs()
        if draft_costs is not None and DRAFTERS[drafter.name].drafts_from is DraftSource.DRAFT_MODEL:
            prices.update(draft_costs.model_dump())
        missing = {name: value for name, value in prices.items() if name in fields and name not in drafter.params}
        if not missing:
            return drafter
        return drafter.model_copy(update={"params": {**drafter.params, **missing}})

    def resolve_length(self, sampling: SamplingParams, num_prompt: int, num_draft_tokens: int, prompt_field: str):
        """`sampling` with its max_tokens set: a request without one runs to a stop or the end of
        the context (vLLM's rule; OpenAI's chat API's), within the deployment's limit. A prompt
        leaves room for max_tokens and one block of drafts in the context."""
        room = self.max_positions - session_positions(num_prompt, 0, num_draft_tokens)
        max_tokens = sampling.max_tokens
        if max_tokens is None:
            max_tokens = min(room, self.max_tokens_limit or MAX_TOKENS, MAX_TOKENS)
            if max_tokens < max(1, sampling.min_tokens):
                raise SpecdecError(f"prompt has {num_prompt} tokens: no room left in the context", prompt_field)
            sampling = sampling.model_copy(update={"max_tokens": max_tokens})
        if session_positions(num_prompt, max_tokens, num_draft_tokens) > self.max_positions:
            raise SpecdecError(
                f"prompt has {num_prompt} tokens; with max_tokens={max_tokens} the limit is "
                f"{max(self.max_positions - session_positions(0, max_tokens, num_draft_tokens), 0)}",
                prompt_field,
            )
        return sampling

    def output(self, request: PreparedRequest) -> OutputTracker:
        return OutputTracker(self.tokenizer, request.sampling, self.eos_ids, len(request.prompt_ids))
