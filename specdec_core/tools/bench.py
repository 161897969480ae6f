"""`specdec bench`: Spec-Bench questions through several decoding methods, interleaved per
question in one process so every ratio compares runs under the same conditions.

Methods: `target` (target-only, same loop), `hf:prompt_lookup` and `hf:assisted` (transformers'
own `generate` on the same models), `specdec:<policy>+<drafter>[@K]`, and
`endpoint:<policy>+<drafter>[@K]` sent to a running service through a client the serving side
provides (`EndpointClient`). report.py aggregates the runs into rows."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch

from ..drafters import DRAFTERS
from ..drafters.pld import PromptLookupParams
from ..engine import SpeculativeEngine
from ..request import ComponentSpec, GenerationRequest
from ..sampling import SamplingParams, entropy_of_logits
from .questions import first_turn, load_questions
from .report import aggregate


class EndpointClient(Protocol):
    def generate(self, request: GenerationRequest) -> dict:
        """`{"token_ids": [...], "text": str, "speculative": metrics}` for one request."""


@dataclass
class MethodRun:
    """One method's output on one question."""

    token_ids: list[int]
    seconds: float
    metrics: dict = field(default_factory=dict)


@dataclass
class BenchConfig:
    questions: Path
    methods: list[str]
    categories: list[str]
    per_category: int
    max_new_tokens: int
    temperature: float
    seed: int
    num_draft_tokens: int
    pld_max_ngram: int
    pld_min_ngram: int
    pld_tokens: int
    policy_params: dict[str, dict[str, Any]]
    drafter_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    endpoint: Optional[str] = None


@torch.inference_mode()
def score_continuation(
    model: torch.nn.Module, prompt_ids: list[int], output_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target NLL and T=1 entropy at each generated position (teacher forcing, one forward)."""
    if not output_ids:
        return torch.zeros(0), torch.zeros(0)
    ids = torch.tensor([prompt_ids + output_ids])
    logits = model(input_ids=ids, logits_to_keep=len(output_ids) + 1).logits[0, :-1].float()
    log_probs = logits.log_softmax(-1)
    nll = -log_probs.gather(-1, torch.tensor(output_ids)[:, None]).squeeze(-1)
    return nll, entropy_of_logits(logits)


def pld_params(settings: dict[str, Any]) -> dict[str, Any]:
    """The prompt-lookup parameters set by the bench's `--pld-*` flags (a BenchConfig's fields, or
    the config saved in bench.json)."""
    return {
        "max_ngram": settings["pld_max_ngram"],
        "min_ngram": settings["pld_min_ngram"],
        "num_pred_tokens": settings["pld_tokens"],
    }


def parse_specdec_method(method: str) -> tuple[str, str, Optional[int]]:
    """`specdec:<policy>+<drafter>[@K]` (or `endpoint:...`) -> (policy, drafter, K or None)."""
    body = method.split(":", 1)[1]
    body, _, draft_tokens = body.partition("@")
    if "+" not in body or (draft_tokens and not draft_tokens.isdigit()):
        raise ValueError(f"method {method!r} must look like specdec:<policy>+<drafter>[@K]")
    policy, drafter = body.split("+", 1)
    return policy, drafter, int(draft_tokens) if draft_tokens else None


class Runner:
    """Runs one method on one prompt and returns its tokens and wall time."""

    def __init__(
        self, engine: SpeculativeEngine, config: BenchConfig, endpoint_client: Optional[EndpointClient] = None
    ):
        self.engine = engine
        self.config = config
        self.sampling = SamplingParams(
            temperature=config.temperature, max_tokens=config.max_new_tokens, seed=config.seed
        )
        self.pld_params = pld_params(vars(config))
        self.endpoint_client = endpoint_client

    def request(
        self, prompt_ids: list[int], policy: Optional[str], drafter: str, num_draft_tokens: Optional[int] = None
    ) -> GenerationRequest:
        """`policy` None: the default for the temperature (greedy, or rejection when sampling)."""
        takes_lookup = drafter in DRAFTERS and issubclass(DRAFTERS[drafter].Params, PromptLookupParams)
        drafter_params = {**(self.pld_params if takes_lookup else {}), **self.config.drafter_params.get(drafter, {})}
        return GenerationRequest(
            prompt_ids=prompt_ids,
            sampling=self.sampling,
            policy=ComponentSpec(name=policy, params=self.config.policy_params.get(policy, {})) if policy else None,
            drafter=ComponentSpec(name=drafter, params=drafter_params),
            num_draft_tokens=num_draft_tokens or self.config.num_draft_tokens,
        )

    def run(self, method: str, prompt_ids: list[int]) -> MethodRun:
        start = time.perf_counter()
        if method == "target":
            completion = self.engine.complete(self.request(prompt_ids, None, "none"))
            return MethodRun(completion.token_ids, time.perf_counter() - start, completion.metrics)
        if method.startswith("specdec:"):
            completion = self.engine.complete(self.request(prompt_ids, *parse_specdec_method(method)))
            return MethodRun(completion.token_ids, time.perf_counter() - start, completion.metrics)
        if method.startswith("endpoint:"):
            if self.endpoint_client is None:
                raise ValueError(f"method {method} needs --endpoint")
            response = self.endpoint_client.generate(self.request(prompt_ids, *parse_specdec_method(method)))
            return MethodRun(response["token_ids"], time.perf_counter() - start, response["speculative"])
        if method.startswith("hf:"):
            return self.run_hf(method, prompt_ids, start)
        raise ValueError(f"unknown method {method!r}")

    @torch.inference_mode()
    def run_hf(self, method: str, prompt_ids: list[int], start: float) -> MethodRun:
        kwargs: dict[str, Any] = {}
        if method == "hf:prompt_lookup":
            kwargs = {
                "prompt_lookup_num_tokens": self.config.pld_tokens,
                "max_matching_ngram_size": self.config.pld_max_ngram,
            }
        elif method == "hf:assisted":
            if self.engine.draft_model is None:
                raise ValueError("hf:assisted needs a draft model")
            kwargs = {"assistant_model": self.engine.draft_model}
        else:
            raise ValueError(f"unknown method {method!r}")
        if not self.sampling.greedy:
            kwargs.update(do_sample=True, temperature=self.sampling.temperature)
            torch.manual_seed(self.sampling.seed)  # transformers samples from torch's global RNG
        eos_ids = sorted(self.engine.frontend.eos_ids)
        output = self.engine.target_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=self.config.max_new_tokens,
            do_sample=not self.sampling.greedy,
            eos_token_id=eos_ids,
            pad_token_id=eos_ids[0],
            **kwargs,
        )[0, len(prompt_ids) :].tolist()
        seconds = time.perf_counter() - start
        while output and output[-1] in eos_ids:
            output.pop()
        return MethodRun(output, seconds)


def run_bench(
    engine: SpeculativeEngine,
    config: BenchConfig,
    progress: Callable[[Any], Any] = iter,
    endpoint_client: Optional[EndpointClient] = None,
) -> tuple[list[dict], list[dict]]:
    """(rows, outputs): the aggregated rows and one record per method per question (its prompt
    and output ids, wall time and prefill time), for offline analysis such as `lookup-ceiling`."""
    questions = load_questions(config.questions, config.categories, config.per_category)
    if not questions:
        raise ValueError("no questions selected")
    runner = Runner(engine, config, endpoint_client)
    warm_prompt = engine.frontend.encode(GenerationRequest(messages=[{"role": "user", "content": "Say hi."}]))
    for method in config.methods:  # first calls pay one-off costs; keep them out of the timings
        runner.run(method, warm_prompt)
    runs, outputs = [], []
    for question in progress(questions):
        prompt_ids = engine.frontend.encode(GenerationRequest(messages=first_turn(question)))
        reference = None
        for method in config.methods:
            run = runner.run(method, prompt_ids)
            if method == "target":
                reference = run.token_ids
            identical = (run.token_ids == reference) if (config.temperature == 0 and reference is not None) else None
            nll, _ = score_continuation(engine.target_model, prompt_ids, run.token_ids)
            runs.append((method, question["category"], run, identical, float(nll.mean()) if nll.numel() else 0.0))
            outputs.append(
                {
                    "question_id": question.get("question_id"),
                    "category": question["category"],
                    "method": method,
                    "prompt_ids": prompt_ids,
                    "token_ids": run.token_ids,
                    "seconds": round(run.seconds, 4),
                    "prefill_ms": run.metrics.get("prefill_ms"),
                }
            )
    return aggregate(runs, config.methods), outputs
