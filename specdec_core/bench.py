"""`specdec bench`: Spec-Bench questions through several decoding methods, interleaved per
question in one process so every ratio compares runs under the same conditions.

Methods: `target` (target-only, same loop), `hf:prompt_lookup` and `hf:assisted` (transformers'
own `generate` on the same models), `specdec:<policy>+<drafter>`, and (with an endpoint)
`endpoint:<policy>+<drafter>` sent to a running service. Each row reports throughput, speedup
vs `target` in the same category, mean acceptance length, agreement with target-only greedy
output, the target's NLL of the produced continuation, and the policy's decision time."""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .engine import ComponentSpec, GenerationRequest, SpeculativeEngine
from .sampling import SamplingParams, entropy_of_logits

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "spec_bench" / "question.jsonl"


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


def load_questions(path: Path, categories: list[str], per_category: int) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(f"questions file not found: {path}")
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    available = sorted({q["category"] for q in questions})
    wanted = available if categories == ["all"] else categories
    unknown = sorted(set(wanted) - set(available))
    if unknown:
        raise ValueError(f"unknown categories {unknown}; available: {available}")
    taken: dict[str, int] = defaultdict(int)
    selected = []
    for question in questions:
        if question["category"] in wanted and taken[question["category"]] < per_category:
            taken[question["category"]] += 1
            selected.append(question)
    return selected


@torch.inference_mode()
def score_continuation(model: torch.nn.Module, prompt_ids: list[int], output_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Target NLL and T=1 entropy at each generated position (teacher forcing, one forward)."""
    if not output_ids:
        return torch.zeros(0), torch.zeros(0)
    ids = torch.tensor([prompt_ids + output_ids])
    logits = model(input_ids=ids, logits_to_keep=len(output_ids) + 1).logits[0, :-1].float()
    log_probs = logits.log_softmax(-1)
    nll = -log_probs.gather(-1, torch.tensor(output_ids)[:, None]).squeeze(-1)
    return nll, entropy_of_logits(logits)


@torch.inference_mode()
def block_cost_curve(model: torch.nn.Module, prompt_ids: list[int], max_tokens: int, repeats: int) -> list[dict]:
    """What one forward over `n` new tokens costs after `prompt_ids`, for n = 1..max_tokens:
    a target verify of K drafts is n = K + 1. Sizes are interleaved within each repeat and each
    size is priced against the 1-token forward of its own repeat (median of those ratios), so
    that the machine's slow and fast stretches cancel; the cache is rolled back after every
    forward."""
    from .target import TargetScorer

    scorer = TargetScorer(model)
    scorer.reset(prompt_ids)
    samples: dict[int, list[float]] = defaultdict(list)
    for _ in range(repeats + 1):  # the first round warms up
        for num_tokens in range(1, max_tokens + 1):
            start = time.perf_counter()
            scorer.score(prompt_ids[-num_tokens:])
            samples[num_tokens].append((time.perf_counter() - start) * 1e3)
            scorer.commit(0)
    return [
        {"tokens": num_tokens, "ms_p50": round(statistics.median(times[1:]), 2),
         "vs_one_token": round(statistics.median(ms / one_ms for ms, one_ms in zip(times[1:], samples[1][1:])), 3)}
        for num_tokens, times in samples.items()
    ]


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

    def __init__(self, engine: SpeculativeEngine, config: BenchConfig):
        self.engine = engine
        self.config = config
        self.sampling = SamplingParams(
            temperature=config.temperature, max_tokens=config.max_new_tokens, seed=config.seed
        )
        self.pld_params = pld_params(vars(config))
        self.client = None
        if config.endpoint:
            from deployments.client import SpecdecHttpClient

            self.client = SpecdecHttpClient(config.endpoint)

    def request(self, prompt_ids: list[int], policy: str, drafter: str, num_draft_tokens: Optional[int] = None) -> GenerationRequest:
        drafter_params = {**(self.pld_params if drafter in ("pld", "mla") else {}), **self.config.drafter_params.get(drafter, {})}
        return GenerationRequest(
            prompt_ids=prompt_ids,
            sampling=self.sampling,
            policy=ComponentSpec(name=policy, params=self.config.policy_params.get(policy, {})),
            drafter=ComponentSpec(name=drafter, params=drafter_params),
            num_draft_tokens=num_draft_tokens or self.config.num_draft_tokens,
        )

    def run(self, method: str, prompt_ids: list[int]) -> MethodRun:
        start = time.perf_counter()
        if method == "target":
            completion = self.engine.complete(self.request(prompt_ids, "greedy" if self.sampling.greedy else "rejection", "none"))
            return MethodRun(completion.token_ids, time.perf_counter() - start, completion.metrics)
        if method.startswith("specdec:"):
            completion = self.engine.complete(self.request(prompt_ids, *parse_specdec_method(method)))
            return MethodRun(completion.token_ids, time.perf_counter() - start, completion.metrics)
        if method.startswith("endpoint:"):
            if self.client is None:
                raise ValueError(f"method {method} needs --endpoint")
            response = self.client.generate(self.request(prompt_ids, *parse_specdec_method(method)))
            return MethodRun(response["token_ids"], time.perf_counter() - start, response["speculative"])
        if method.startswith("hf:"):
            return self.run_hf(method, prompt_ids, start)
        raise ValueError(f"unknown method {method!r}")

    @torch.inference_mode()
    def run_hf(self, method: str, prompt_ids: list[int], start: float) -> MethodRun:
        kwargs: dict[str, Any] = {}
        if method == "hf:prompt_lookup":
            kwargs = {"prompt_lookup_num_tokens": self.config.pld_tokens, "max_matching_ngram_size": self.config.pld_max_ngram}
        elif method == "hf:assisted":
            if self.engine.draft_model is None:
                raise ValueError("hf:assisted needs a draft model")
            kwargs = {"assistant_model": self.engine.draft_model}
        else:
            raise ValueError(f"unknown method {method!r}")
        if not self.sampling.greedy:
            kwargs.update(do_sample=True, temperature=self.sampling.temperature)
            torch.manual_seed(self.sampling.seed)
        output = self.engine.target_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=self.config.max_new_tokens,
            do_sample=not self.sampling.greedy,
            eos_token_id=sorted(self.engine.eos_ids),
            pad_token_id=sorted(self.engine.eos_ids)[0],
            **kwargs,
        )[0, len(prompt_ids) :].tolist()
        seconds = time.perf_counter() - start
        while output and output[-1] in self.engine.eos_ids:
            output.pop()
        return MethodRun(output, seconds)


def aggregate(runs: list[tuple[str, str, MethodRun, Optional[bool], float]], methods: list[str]) -> list[dict]:
    """One row per (method, category) and per method overall."""
    grouped: dict[tuple[str, str], list] = defaultdict(list)
    for method, category, run, identical, nll in runs:
        grouped[(method, category)].append((run, identical, nll))
        grouped[(method, "overall")].append((run, identical, nll))
    rows = []
    categories = sorted({category for _, category in grouped if category != "overall"}) + ["overall"]
    for category in categories:
        target_rate = None
        for method in methods:
            entries = grouped.get((method, category), [])
            if not entries:
                continue
            new_tokens = sum(len(run.token_ids) for run, _, _ in entries)
            seconds = sum(run.seconds for run, _, _ in entries)
            rate = new_tokens / seconds if seconds else 0.0
            if method == "target":
                target_rate = rate
            drafts = sum(run.metrics.get("spec_decode_num_drafts", 0) for run, _, _ in entries)
            accepted = sum(run.metrics.get("spec_decode_num_accepted_tokens", 0) for run, _, _ in entries)
            verify_ms = [run.metrics["verify_ms_p50"] for run, _, _ in entries if "verify_ms_p50" in run.metrics]
            identical = [flag for _, flag, _ in entries if flag is not None]
            nll_total = sum(nll * len(run.token_ids) for run, _, nll in entries)
            rows.append(
                {
                    "method": method,
                    "category": category,
                    "questions": len(entries),
                    "new_tokens": new_tokens,
                    "tok_per_s": round(rate, 3),
                    "speedup": round(rate / target_rate, 3) if target_rate else None,
                    "mean_accept_len": round(1 + accepted / drafts, 3) if drafts else None,
                    "identical_to_target": round(sum(identical) / len(identical), 3) if identical else None,
                    "target_nll": round(nll_total / new_tokens, 4) if new_tokens else None,
                    "verify_ms_p50": round(statistics.median(verify_ms), 4) if verify_ms else None,
                    **{
                        counter: sum(run.metrics.get(counter, 0) for run, _, _ in entries)
                        for counter in ("penalized", "pardoned", "loose")
                        if any(counter in run.metrics for run, _, _ in entries)
                    },
                    **{  # served methods: bytes on the wire per step vs full fp32 logits
                        key: round(statistics.mean(run.metrics[key] for run, _, _ in entries), 1)
                        for key in ("wire_bytes_per_step", "full_logits_bytes_per_step")
                        if all(key in run.metrics for run, _, _ in entries)
                    },
                }
            )
    return rows


def run_bench(
    engine: SpeculativeEngine, config: BenchConfig, progress: Callable[[Any], Any] = iter
) -> tuple[list[dict], list[dict]]:
    """(rows, outputs): the aggregated rows and one record per method per question (its prompt
    and output ids, wall time and prefill time), for offline analysis such as `lookup-ceiling`."""
    questions = load_questions(config.questions, config.categories, config.per_category)
    if not questions:
        raise ValueError("no questions selected")
    runner = Runner(engine, config)
    warm_prompt = engine.encode(GenerationRequest(messages=[{"role": "user", "content": "Say hi."}]))
    for method in config.methods:  # first calls pay one-off costs; keep them out of the timings
        runner.run(method, warm_prompt)
    runs, outputs = [], []
    for question in progress(questions):
        prompt_ids = engine.encode(GenerationRequest(messages=[{"role": "user", "content": question["turns"][0]}]))
        reference = None
        for method in config.methods:
            run = runner.run(method, prompt_ids)
            if method == "target":
                reference = run.token_ids
            identical = (run.token_ids == reference) if (config.temperature == 0 and reference is not None) else None
            nll, _ = score_continuation(engine.target_model, prompt_ids, run.token_ids)
            runs.append((method, question["category"], run, identical, float(nll.mean()) if nll.numel() else 0.0))
            outputs.append({
                "question_id": question.get("question_id"), "category": question["category"], "method": method,
                "prompt_ids": prompt_ids, "token_ids": run.token_ids, "seconds": round(run.seconds, 4),
                "prefill_ms": run.metrics.get("prefill_ms"),
            })
    return aggregate(runs, config.methods), outputs


def write_report(rows: list[dict], outputs: list[dict], config: BenchConfig, out_dir: Path, extra_config: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "outputs.jsonl").write_text("".join(json.dumps(record) + "\n" for record in outputs))
    config_dict = {key: str(value) if isinstance(value, Path) else value for key, value in config.__dict__.items()}
    (out_dir / "bench.json").write_text(json.dumps({"config": {**config_dict, **extra_config}, "results": rows}, indent=2))
    plot(rows, out_dir / "bench.png")
    return out_dir / "bench.json"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(row["method"] for row in rows))
    categories = list(dict.fromkeys(row["category"] for row in rows))
    figure, axes = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(categories) * max(1, len(methods)) / 3), 8))
    width = 0.8 / max(1, len(methods))
    for axis, key, label in ((axes[0], "speedup", "speedup vs target"), (axes[1], "mean_accept_len", "mean acceptance length")):
        for index, method in enumerate(methods):
            values = {row["category"]: row[key] for row in rows if row["method"] == method}
            axis.bar(
                [position + index * width for position in range(len(categories))],
                [values.get(category) or 0 for category in categories],
                width,
                label=method,
            )
        axis.set_xticks([position + 0.4 - width / 2 for position in range(len(categories))], categories, rotation=30, ha="right")
        axis.set_ylabel(label)
        if key == "speedup":
            axis.axhline(1.0, color="black", linewidth=0.8)
    axes[0].legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
