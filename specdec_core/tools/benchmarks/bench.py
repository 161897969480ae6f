"""`specdec bench`: Spec-Bench questions through several decoding methods, interleaved per
question in one process so every ratio compares runs under the same conditions.

Methods: `target` (target-only, same loop), `hf:prompt_lookup` and `hf:assisted` (transformers'
own `generate` on the same models), `specdec:<policy>+<drafter>[@K]`, and
`endpoint:<policy>+<drafter>[@K]` sent to a running service through a client the serving side
provides (`EndpointClient`). report.py aggregates the runs into rows."""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from ...api.request import ComponentSpec, GenerationRequest
from ...api.sampling import SamplingParams, entropy_of_logits
from ...calibration.questions import load_questions, question_messages
from ...drafters import DRAFTERS
from ...drafters.pld import PromptLookupParams
from ...loop.engine import SpeculativeEngine
from ...runtime.model_runner import runner_of
from ..params import parse_params, split_top_level
from .bench_records import BenchConfig, MethodResult, MethodRun
from .grading import Grader
from .report import aggregate


class EndpointClient(Protocol):
    def generate(self, request: GenerationRequest) -> dict:
        """`{"token_ids": [...], "text": str, "speculative": metrics}` for one request."""


@torch.inference_mode()
def score_continuation(
    model: torch.nn.Module, prompt_ids: list[int], output_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target NLL and T=1 entropy at each generated position (teacher forcing, one forward)."""
    if not output_ids:
        return torch.zeros(0), torch.zeros(0)
    ids = torch.tensor([prompt_ids + output_ids], device=model.device)
    logits = model(input_ids=ids, logits_to_keep=len(output_ids) + 1).logits[0, :-1].float()
    log_probs = logits.log_softmax(-1)
    nll = -log_probs.gather(-1, ids[0, len(prompt_ids) :, None]).squeeze(-1)
    return nll.cpu(), entropy_of_logits(logits).cpu()


def pld_params(settings: dict[str, Any]) -> dict[str, Any]:
    """The prompt-lookup parameters set by the bench's `--pld-*` flags (a BenchConfig's fields, or
    the config saved in bench.json)."""
    return {
        "max_ngram": settings["pld_max_ngram"],
        "min_ngram": settings["pld_min_ngram"],
        "num_pred_tokens": settings["pld_tokens"],
    }


SPECULATIVE_METHOD = re.compile(
    r"^(?:specdec|endpoint):(?P<policy>\w+)(?:\((?P<params>.*?)\))?"
    r"\+(?P<drafter>\w+)(?:\((?P<drafter_params>.*)\))?(?:@(?P<k>\d+))?$"
)


@dataclass
class SpeculativeMethod:
    policy: str
    drafter: str
    num_draft_tokens: Optional[int] = None  # None: the bench's -k
    policy_params: dict[str, Any] = field(default_factory=dict)  # over --policy-param's
    drafter_params: dict[str, Any] = field(default_factory=dict)  # over --drafter-param's


def parse_specdec_method(method: str) -> SpeculativeMethod:
    """`specdec:<policy>[(k=v,...)]+<drafter>[(k=v,...)][@K]` (or `endpoint:...`), e.g.
    `specdec:dropmatch(criteria=["js"],dropout=0.05)+mla@15` or
    `specdec:greedy+heads(scheduler=binary_tau,aggressive=medusa_32,tau_on=0.5)`: values are JSON
    where they parse."""
    match = SPECULATIVE_METHOD.match(method)
    if match is None:
        raise ValueError(f"method {method!r} must look like specdec:<policy>[(k=v,...)]+<drafter>[(k=v,...)][@K]")
    return SpeculativeMethod(
        match["policy"],
        match["drafter"],
        int(match["k"]) if match["k"] else None,
        parse_params(split_top_level(match["params"] or "")),
        parse_params(split_top_level(match["drafter_params"] or "")),
    )


class Runner:
    """Runs one method on one prompt and returns its tokens and wall time."""

    def __init__(
        self, engine: SpeculativeEngine, config: BenchConfig, endpoint_client: Optional[EndpointClient] = None
    ):
        self.engine = engine
        self.config = config
        options = {"temperature": config.temperature, "max_tokens": config.max_new_tokens, "seed": config.seed}
        self.sampling = SamplingParams(**{**options, **config.sampling_params})  # --sampling wins
        self.pld_params = pld_params(vars(config))
        self.endpoint_client = endpoint_client
        # each method's requests share suffix trees with its own alone: one method's answers would
        # be another's drafts (the same questions); the run's tag keeps a served run from the last's
        self.suffix_scope = f"bench-{uuid.uuid4().hex[:8]}"

    def request(self, prompt_ids: list[int], method: Optional[SpeculativeMethod], scope: str = "") -> GenerationRequest:
        """`method` None: target-only, under the default policy for the temperature; `scope`: a
        part of the run the method's suffix trees are kept to (a load level)."""
        drafter = method.drafter if method else "none"
        takes_lookup = drafter in DRAFTERS and issubclass(DRAFTERS[drafter].Params, PromptLookupParams)
        takes_scope = drafter in DRAFTERS and "suffix_scope" in DRAFTERS[drafter].Params.model_fields
        drafter_params = {
            **(self.pld_params if takes_lookup else {}),
            **({"suffix_scope": self.scope_of(method, scope)} if takes_scope else {}),
            **self.config.drafter_params.get(drafter, {}),
            **(method.drafter_params if method else {}),
        }
        policy = None
        if method:
            policy_params = {**self.config.policy_params.get(method.policy, {}), **method.policy_params}
            policy = ComponentSpec(name=method.policy, params=policy_params)
        return GenerationRequest(
            prompt_ids=prompt_ids,
            sampling=self.sampling,
            policy=policy,
            drafter=ComponentSpec(name=drafter, params=drafter_params),
            num_draft_tokens=(method and method.num_draft_tokens) or self.config.num_draft_tokens,
            run_ahead=self.config.run_ahead,
        )

    def scope_of(self, method: SpeculativeMethod, scope: str) -> str:
        """The suffix scope of a method's requests in this run (and in the part `scope` of it)."""
        method_tag = hashlib.sha1(repr(method).encode()).hexdigest()[:10]
        return "/".join(filter(None, [self.suffix_scope, method_tag, scope]))

    def run(self, method: str, prompt_ids: list[int]) -> MethodRun:
        start = time.perf_counter()
        if method == "target":
            completion = self.engine.complete(self.request(prompt_ids, None))
            return MethodRun(completion.token_ids, time.perf_counter() - start, completion.metrics)
        if method.startswith("specdec:"):
            completion = self.engine.complete(self.request(prompt_ids, parse_specdec_method(method)))
            return MethodRun(completion.token_ids, time.perf_counter() - start, completion.metrics)
        if method.startswith("endpoint:"):
            if self.endpoint_client is None:
                raise ValueError(f"method {method} needs --endpoint")
            response = self.endpoint_client.generate(self.request(prompt_ids, parse_specdec_method(method)))
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
        if self.config.sampling_params:
            raise ValueError(f"{method} takes no --sampling settings: transformers would apply them otherwise")
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
    and output ids, wall time, prefill time and whether it answered correctly where that can be
    checked), for offline analysis such as `lookup-ceiling`."""
    questions = load_questions(config.questions, config.categories, config.per_category, config.skip)
    if not questions:
        raise ValueError("no questions selected")
    # every method prefills its prompts cold: prompts cached by the methods before would favor the later ones
    runner_of(engine.target_model.model).kv_pool().prefix_caching = False
    runner = Runner(engine, config, endpoint_client)
    grade = Grader()
    tokenizer = engine.frontend.tokenizer
    warm_prompt = engine.frontend.encode(GenerationRequest(messages=[{"role": "user", "content": "Say hi."}]))
    for method in config.methods:  # first calls pay one-off costs; keep them out of the timings
        runner.run(method, warm_prompt)
    runs, outputs = [], []
    for question in progress(questions):
        prompt_ids = engine.frontend.encode(GenerationRequest(messages=question_messages(question)))
        reference = None
        for method in config.methods:
            run = runner.run(method, prompt_ids)
            if method == "target":
                reference = run.token_ids
            identical = (run.token_ids == reference) if (config.temperature == 0 and reference is not None) else None
            nll, _ = score_continuation(engine.target_model, prompt_ids, run.token_ids)
            correct = grade(question, tokenizer.decode(run.token_ids, skip_special_tokens=True)) if tokenizer else None
            mean_nll = float(nll.mean()) if nll.numel() else 0.0
            runs.append(MethodResult(method, question["category"], run, identical, mean_nll, correct))
            outputs.append(
                {
                    "question_id": question.get("question_id"),
                    "category": question["category"],
                    "method": method,
                    "prompt_ids": prompt_ids,
                    "token_ids": run.token_ids,
                    "seconds": round(run.seconds, 4),
                    "prefill_ms": run.metrics.get("prefill_ms"),
                    "correct": correct,
                }
            )
    return aggregate(runs, config.methods), outputs
