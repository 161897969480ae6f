"""`specdec gpu-report`: what a session lent a GPU runs first. Device and library facts, the GPU
tests, and the in-process engine (lockstep.py) on random weights of real shapes (a Llama-3.1-8B
target, a Llama-3.2-1B draft, bf16) at several concurrencies: tokens/s, each step's time split
(draft forwards, target forward, host: policy, commits and transfers between forwards), the
target forward against its floor (the bytes of weights and KV it reads over the card's measured
copy bandwidth) and the operations it dispatches. Prints one markdown document, ready for
docs/performance.md. It imports no serving code: the device machine has no Ray or gRPC
(docs/performance.md says how to carry what it needs)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import typer

from ..engine import SpeculativeEngine
from ..kv_budget import DEFAULT_GPU_MEMORY_UTILIZATION, kv_budget
from ..loader import ModelSpec, load_model
from ..lockstep import StepTimes, complete_together
from ..memory import GIB, kv_bytes_per_token
from ..policies import make_policy
from ..request import GenerationRequest
from ..sampling import SamplingParams
from ..target import PREFILL_CHUNK, TargetScorer
from .attention_calls import attention_calls
from .device_clock import seconds_per_call
from .eagle3_cost import eagle3_costs
from .step_ops import count_step_ops
from .verify_cost import block_cost_curve, drafter_cost_params

REPO = Path(__file__).resolve().parents[2]
METHODS = {"target": ("greedy", "none"), "greedy+model": ("greedy", "model"), "greedy+pld": ("greedy", "pld")}


def device_facts(device: torch.device) -> dict:
    """Libraries, the card, and its measured copy bandwidth (bytes read and written per second)."""
    import transformers

    facts = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    if device.type != "cuda":
        return {**facts, "device": "cpu"}
    properties = torch.cuda.get_device_properties(device)
    source = torch.empty(2**30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = seconds_per_call(lambda: target.copy_(source), repeats=10)
    return {
        **facts,
        "device": properties.name,
        "cuda": torch.version.cuda,
        "multiprocessors": properties.multi_processor_count,
        "memory_gib": round(properties.total_memory / 2**30, 1),
        "copy_gb_s": round(2 * source.numel() / seconds / 1e9),
    }


def run_gpu_tests() -> str:
    """tests/core/test_gpu.py's summary line (the tests need the repository, not an installed wheel)."""
    tests = REPO / "tests" / "core" / "test_gpu.py"
    if not tests.exists():
        return "skipped: tests/core/test_gpu.py is not beside this package"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else done.stderr[-500:]


def requests(method: str, count: int, prompt_tokens: int, max_tokens: int, num_draft: int, vocab: int) -> list:
    """`count` greedy requests of `max_tokens` each (EOS ignored), request i on seed i's prompt: a
    random half repeated, so prompt lookup has something to find in the prompt at least."""
    policy, drafter = METHODS[method]
    batch = []
    for seed in range(count):
        half = torch.randint(0, vocab, (prompt_tokens // 2,), generator=torch.Generator().manual_seed(seed)).tolist()
        batch.append(
            GenerationRequest(
                prompt_ids=half + half,
                policy={"name": policy},
                drafter={"name": drafter, "params": {"adaptive": False} if drafter == "model" else {}},
                num_draft_tokens=num_draft,
                sampling={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
            )
        )
    return batch


def measure(engine: SpeculativeEngine, method: str, sessions: int, args: dict, copy_bytes_s: float):
    """One method at one concurrency: its row (tokens/s over the decode, prefills excluded, and
    per step) and each request's token ids."""
    batch = requests(method, sessions, args["prompt_tokens"], args["max_tokens"], args["num_draft"], args["vocab"])
    times = StepTimes()
    completions = complete_together(engine, batch, times)
    steps = len(times.target_s)
    decode_s = times.wall_s - sum(done.metrics["prefill_ms"] for done in completions) / 1e3
    draft_s, target_s = sum(times.draft_s), sum(times.target_s)
    model = engine.target_model
    weight_bytes = sum(parameter.numel() * parameter.itemsize for parameter in model.parameters())
    # the KV a forward reads: its sessions at the mean context of the decode
    per_token = kv_bytes_per_token(model.config, 1, model.dtype.itemsize)
    kv_bytes = sum(times.target_rows) / steps * (args["prompt_tokens"] + args["max_tokens"] / 2) * per_token
    return {
        "method": method,
        "sessions": sessions,
        "tok/s": round(sum(len(done.token_ids) for done in completions) / decode_s, 1),
        "accept len": round(statistics.mean(done.metrics["mean_acceptance_length"] for done in completions), 2),
        "step ms": round(decode_s / steps * 1e3, 2),
        "draft ms": round(draft_s / steps * 1e3, 2),
        "target ms": round(target_s / steps * 1e3, 2),
        "host ms": round((decode_s - draft_s - target_s) / steps * 1e3, 2),
        "floor ms": round((weight_bytes + kv_bytes) / copy_bytes_s * 1e3, 2) if copy_bytes_s else "-",
    }, [done.token_ids for done in completions]


def prefix_cache_line(model: torch.nn.Module, shared_tokens: int = 1500, question_tokens: int = 30) -> str:
    """Time to the first token (prefill and first score) of two prompts that share a
    `shared_tokens` system prompt and differ in their question: the second finds the shared
    prompt's full blocks in the prefix cache."""
    generator = torch.Generator().manual_seed(0)
    vocab_size = model.config.vocab_size
    shared = torch.randint(0, vocab_size, (shared_tokens,), generator=generator).tolist()
    prompts = [shared + torch.randint(0, vocab_size, (question_tokens,), generator=generator).tolist() for _ in "ab"]
    sampling = SamplingParams(max_tokens=1)
    times, scorers = [], [TargetScorer(model) for _ in prompts]
    for scorer, prompt in zip(scorers, prompts):

        def first_token(scorer=scorer, prompt=prompt):
            scorer.reset(prompt, make_policy("greedy"), sampling)
            scorer.score(prompt[-1:])

        times.append(seconds_per_call(first_token, warm_up=False))  # the first time is the measure
    return (
        f"Time to first token of a {shared_tokens + question_tokens}-token prompt: {times[0] * 1e3:.1f} ms; "
        f"of another that shares its first {shared_tokens} tokens: {times[1] * 1e3:.1f} ms "
        f"(prefix cache hits: {scorers[1].prefix_cache_hits} of {scorers[1].prefix_cache_queries} tokens)"
    )


def kv_pool_line(model: torch.nn.Module) -> str:
    """What a worker's pool would get from the default gpu_memory_utilization beside this draft."""
    budget = kv_budget(model, None, DEFAULT_GPU_MEMORY_UTILIZATION, PREFILL_CHUNK)
    per_token = kv_bytes_per_token(model.config, 1, model.get_input_embeddings().weight.element_size())
    return (
        f"KV pool at gpu_memory_utilization {DEFAULT_GPU_MEMORY_UTILIZATION} (after the weights of both models and "
        f"a {PREFILL_CHUNK}-token step): {budget / GIB:.1f} GiB, {budget / per_token:,.0f} positions of the target"
    )


def table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join([*lines, *("| " + " | ".join(str(row[column]) for column in columns) + " |" for row in rows)])


def report(target: ModelSpec, draft: ModelSpec, concurrency: list[int], methods: list[str], args: dict) -> str:
    """The report as markdown, section by section (a section that cannot run says why)."""
    facts = device_facts(target.torch_device)
    on_cuda = target.torch_device.type == "cuda"
    out = ["## gpu-report", "", table([facts], list(facts)), ""]
    out += ["GPU tests: " + (run_gpu_tests() if args["tests"] and on_cuda else "skipped"), ""]
    clock = time.perf_counter()
    engine = SpeculativeEngine(load_model(target), None, load_model(draft), profile=lambda *_: None)
    loaded_s = time.perf_counter() - clock
    compiled = ", steps compiled" if target.compile else ""
    models = f"models: target {target.source}, draft {draft.source}, {target.dtype}{compiled}"
    out += [f"{models}, loaded in {loaded_s:.1f} s", ""]
    args = {**args, "vocab": engine.target_model.config.vocab_size}
    if on_cuda:
        out += [kv_pool_line(engine.target_model), ""]
    out += decode_section(engine, concurrency, methods, args, facts.get("copy_gb_s", 0) * 1e9)
    out += [prefix_cache_line(engine.target_model), ""]
    ops = [count_step_ops(engine.target_model, n, args["num_draft"] + 1, args["prompt_tokens"]) for n in concurrency]
    out += ["Operations one target verify step dispatches (K + 1 tokens per session):", "", table(ops, list(ops[0]))]
    out += ["", *verify_cost_section(engine.target_model, args["prompt_tokens"])]
    if on_cuda:
        calls = attention_calls()
        out += ["", "One layer's attention over 64 rows of 5 tokens, 352 keys each:", "", table(calls, list(calls[0]))]
        costs = eagle3_costs(engine.target_model)  # last: the layer's hooks stay on the target
        heading = "A random EAGLE-3 layer beside the target, one session after a 256-token prompt:"
        out += ["", heading, "", table(costs, list(costs[0]))]
    return "\n".join(out)


def verify_cost_section(model: torch.nn.Module, prompt_tokens: int, max_tokens: int = 64) -> list[str]:
    """What one target step over n new tokens costs against one (`specdec verify-cost`): the curve
    that prices blocks and tree nodes (block_length.VERIFY_COSTS) on this device."""
    prompt_ids = [1 + index % 1000 for index in range(prompt_tokens)]
    # each size's new tokens are the prompt's last ones (its cache rolled back): at most all of them
    curve = block_cost_curve(model, prompt_ids, min(max_tokens, prompt_tokens), repeats=5)
    shown = [row for row in curve if row["tokens"] & (row["tokens"] - 1) == 0]  # 1, 2, 4, ..
    verify_cost = drafter_cost_params(curve, None)["verify_cost"]
    heading = (
        f"One target step over n new tokens after {prompt_tokens}, against one token (`specdec verify-cost`); "
        f"the drafters' `verify_cost` on this device: {verify_cost}"
    )
    return [heading, "", table(shown, list(shown[0]))]


def decode_section(engine, concurrency: list[int], methods: list[str], args: dict, copy_bytes_s: float) -> list[str]:
    """Each method at each concurrency (`copy_bytes_s` 0: no floor), as a table."""
    complete_together(engine, requests("greedy+model", 2, 32, 4, 2, args["vocab"]))  # warm-up
    rows = []
    for sessions in concurrency:
        baseline = None
        for method in methods:
            row, token_ids = measure(engine, method, sessions, args, copy_bytes_s)
            baseline = baseline or token_ids
            row["same as " + methods[0]] = f"{sum(a == b for a, b in zip(token_ids, baseline))}/{sessions}"
            rows.append(row)
            print(table([row], list(row)), file=sys.stderr, flush=True)
    heading = (
        f"Decode, {args['prompt_tokens']}-token prompts, {args['max_tokens']} tokens each, K = {args['num_draft']} "
        "(host: policy, commits and transfers between forwards; same as: greedy outputs equal to the first "
        "method's at that concurrency, where random bf16 weights' near-flat logits let rounding decide ties, "
        "so the exactness check is tests/core/test_gpu.py's, in fp32):"
    )
    return [heading, "", table(rows, list(rows[0])), ""]


def gpu_report(
    target: str = typer.Option("random:llama-3.1-8b-instruct", help="target model (any loader source)"),
    draft: str = typer.Option("random:llama-3.2-1b-instruct", help="draft model"),
    dtype: str = typer.Option("bfloat16", help="both models' dtype"),
    device: str = typer.Option("auto", help="auto: CUDA when present; cpu runs the report here (small models!)"),
    concurrency: str = typer.Option("1,8,32,64", help="sessions decoding together"),
    methods: str = typer.Option(",".join(METHODS), help=f"first is the baseline; of {', '.join(METHODS)}"),
    prompt_tokens: int = typer.Option(256, min=2),
    max_tokens: int = typer.Option(96, min=1),
    num_draft_tokens: int = typer.Option(4, min=1, help="K, fixed (no adaptive length)"),
    tests: bool = typer.Option(True, help="run tests/core/test_gpu.py first"),
    compiled: bool = typer.Option(False, "--compile", help="both models' steps compiled (CUDA graphs on CUDA)"),
    out: Optional[Path] = typer.Option(None, help="also write the markdown here"),
):
    """Device facts, GPU tests and the engine at real shapes on random weights, as markdown."""
    target_spec = ModelSpec(source=target, dtype=dtype, device=device, compile=compiled)
    if target_spec.torch_device.type != "cuda" and device == "auto":
        facts = device_facts(target_spec.torch_device)
        print(table([facts], list(facts)))
        skipped = (
            "the GPU tests and the engine at real shapes (no CUDA device; --device cpu with small --target/--draft"
        )
        print(f"skipped: {skipped} runs the engine here)")
        return
    args = {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "num_draft": num_draft_tokens, "tests": tests}
    levels = [int(level) for level in concurrency.split(",")]
    draft_spec = ModelSpec(source=draft, dtype=dtype, device=device, compile=compiled)
    text = report(target_spec, draft_spec, levels, methods.split(","), args)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


if __name__ == "__main__":  # the device machine runs it as a module: no console script installed there
    typer.run(gpu_report)
