"""`specdec gpu-report`: what runs first on a GPU. Device and library facts, the GPU tests, and
the in-process engine (lockstep.py) on random weights of real shapes (a Llama-3.1-8B target, a
Llama-3.2-1B draft, bf16) at several concurrencies, eager and with CUDA graphs (gpu_decode.py),
then the time to a first token with and without the prefix cache, the operations one step
dispatches, the verify-cost curve, attention kernels and an EAGLE-3 layer's costs. Prints one
markdown document, ready for docs/performance.md. It imports no serving code, so a GPU machine
needs only torch, transformers and the wheels `make gpu-wheels` downloads (docs/performance.md)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import typer
from pydantic import ValidationError

from ...api.sampling import SamplingParams
from ...loop.engine import SpeculativeEngine
from ...models.loader import ModelSpec, load_model
from ...planning.kv_budget import DEFAULT_GPU_MEMORY_UTILIZATION, kv_budget
from ...planning.memory import GIB, kv_bytes_per_token
from ...policies import make_policy
from ...runtime.model_runner import runner_of
from ...target.scorer import PREFILL_CHUNK, TargetScorer
from .attention_calls import attention_calls
from .device_clock import seconds_per_call
from .eagle3_cost import eagle3_costs, random_eagle3
from .gpu_decode import DRAFTERS, METHODS, RECORDING, decode_section, method_parts, reads_eagle3, steps_as, table
from .step_ops import count_step_ops
from .verify_cost import block_cost_curve, drafter_cost_params

REPO = Path(__file__).resolve().parents[3]
# the options of the GPU measurements that load the random pair (this report, step_profile.py)
TargetShapeOpt = typer.Option("random:llama-3.1-8b-instruct", help="target model (any loader source)")
DraftShapeOpt = typer.Option("random:llama-3.2-1b-instruct", help="draft model")
DtypeOpt = typer.Option("bfloat16", help="both models' dtype")
DeviceOpt = typer.Option("auto", help="auto: CUDA when present; cpu runs here (small models!)")
CompileLayersOpt = typer.Option(False, help="both models' layers compiled (compiled_layers.py)")
AttentionOpt = typer.Option("auto", help="both models' short rows: paged (Triton), sdpa, or auto (paged on CUDA)")


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


def report(target: ModelSpec, draft: ModelSpec, concurrency: list[int], methods: list[str], args: dict) -> str:
    """The report as markdown, section by section (a section that cannot run says why)."""
    facts = device_facts(target.torch_device)
    on_cuda = target.torch_device.type == "cuda"
    out = ["## gpu-report", "", table([facts], list(facts)), ""]
    out += ["GPU tests: " + (run_gpu_tests() if args["tests"] and on_cuda else "skipped"), ""]
    clock = time.perf_counter()
    target_model = load_model(target)
    # the eagle3 methods' layer: random, of the published heads' shape (its hooks keep the states it reads)
    heads = {"eagle3": random_eagle3(target_model)} if reads_eagle3(methods) else None
    engine = SpeculativeEngine(target_model, None, load_model(draft), profile=lambda *_: None, heads=heads)
    loaded_s = time.perf_counter() - clock
    compiled = ", steps compiled" if target.compile else ", layers compiled" if target.compile_layers else ""
    compiled += ", paged attention" if runner_of(engine.target_model.model).paged else ", SDPA"
    models = f"models: target {target.source}, draft {draft.source}, {target.dtype}{compiled}"
    out += [f"{models}, loaded in {loaded_s:.1f} s", ""]
    args = {**args, "vocab": engine.target_model.config.vocab_size}
    if on_cuda:
        out += [kv_pool_line(engine.target_model), ""]
    out += decode_section(engine, concurrency, methods, args, facts.get("copy_gb_s", 0) * 1e9)
    out += [prefix_cache_line(engine.target_model), ""]
    with steps_as([engine.target_model.model], "eager"):
        ops = [
            count_step_ops(engine.target_model, n, args["num_draft"] + 1, args["prompt_tokens"]) for n in concurrency
        ]
    heading = "Operations one eager target verify step dispatches (K + 1 tokens per session):"
    out += [heading, "", table(ops, list(ops[0]))]
    out += ["", *verify_cost_section(engine.target_model, args["prompt_tokens"])]
    if on_cuda:
        for rows, tokens, history in ((64, 5, 352), (1, 5, 256), (1, 1, 256)):
            calls = attention_calls(rows, tokens, history, flex=rows > 1)
            heading = f"One layer's attention over {rows} row(s) of {tokens} token(s) after {history}:"
            out += ["", heading, "", table(calls, list(calls[0]))]
        # the decode's layer where it has one; last: a new layer's hooks stay on the target
        costs = eagle3_costs(engine.target_model, engine.heads.get("eagle3"))
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


def gpu_report(
    target: str = TargetShapeOpt,
    draft: str = DraftShapeOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    concurrency: str = typer.Option("1,8,64", help="sessions decoding together"),
    methods: str = typer.Option(
        ",".join(METHODS),
        help=f"first is the baseline ({RECORDING} records what @a proposes); of {', '.join(DRAFTERS)}",
    ),
    prompt_tokens: int = typer.Option(256, min=2),
    max_tokens: int = typer.Option(96, min=1),
    num_draft_tokens: int = typer.Option(4, min=1, help="K, fixed (no adaptive length)"),
    temperature: float = typer.Option(0.0, min=0.0, max=10.0, help="> 0: requests sampled, verified by rejection"),
    tests: bool = typer.Option(True, help="run tests/core/test_gpu.py first"),
    compiled: bool = typer.Option(False, "--compile", help="both models' steps compiled (CUDA graphs on CUDA)"),
    compile_layers: bool = CompileLayersOpt,
    attention: str = AttentionOpt,
    out: Optional[Path] = typer.Option(None, help="also write the markdown here"),
):
    """Device facts, GPU tests and the engine at real shapes on random weights, as markdown."""
    try:
        target_spec, draft_spec = (
            ModelSpec(
                source=source,
                dtype=dtype,
                device=device,
                compile=compiled,
                compile_layers=compile_layers,
                attention=attention,
            )
            for source in (target, draft)
        )
    except ValidationError as error:  # --compile with --compile-layers, an unknown device, ...
        raise typer.BadParameter(str(error)) from None
    if target_spec.torch_device.type != "cuda" and device == "auto":
        facts = device_facts(target_spec.torch_device)
        print(table([facts], list(facts)))
        skipped = (
            "the GPU tests and the engine at real shapes (no CUDA device; --device cpu with small --target/--draft"
        )
        print(f"skipped: {skipped} runs the engine here)")
        return
    args = {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "num_draft": num_draft_tokens, "tests": tests}
    args["temperature"] = temperature
    levels = [int(level) for level in concurrency.split(",")]
    method_list = methods.split(",")
    fixed = [method for method in method_list if method_parts(method)[1] is not None]
    if any(not 1 <= method_parts(method)[1] <= num_draft_tokens + 1 for method in fixed):
        raise typer.BadParameter(f"a fixed acceptance length (@a) is 1 to K + 1 = {num_draft_tokens + 1}")
    if fixed and temperature > 0:
        raise typer.BadParameter("a fixed acceptance length (@a) replays greedy output: it needs --temperature 0")
    if fixed and RECORDING not in method_list[: method_list.index(fixed[0])]:
        raise typer.BadParameter(
            f"a method of fixed acceptance (@a) needs {RECORDING} before it: it records what they propose"
        )
    text = report(target_spec, draft_spec, levels, method_list, args)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


if __name__ == "__main__":  # the device machine runs it as a module: no console script installed there
    typer.run(gpu_report)
