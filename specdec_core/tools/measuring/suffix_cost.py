"""`specdec suffix-cost`: what suffix decoding's trees cost a process. It fills one scope's shared
tree with the outputs of N requests (ShareGPT's answers in the target's tokens: text that
repeats as real answers do), then a request with a long prompt (ShareGPT's questions, cut to
the context given) commits tokens one at a time and proposes after each, as a decode does.

Reported, for a chain's proposals and a tree's, each over a tree filled anew: the memory the
shared tree took (the process's resident set before and after, and Arctic's own estimate of
its nodes), the cost of a commit per token, and the cost of a proposal at that context, median
and p99, with the share of proposals that drafted. No model runs: the trees alone are measured.
The resident set of a second fill may reuse what the first freed: the estimate is the steadier."""

from __future__ import annotations

import json
import statistics
import time
from typing import Optional

import typer

from ...api.sampling import SamplingParams
from ...calibration.questions import sharegpt_exchanges
from ...drafters import SuffixCache, make_drafter
from ..benchmarks.load import percentile
from ..cli_common import TargetOpt, console, print_table


def resident_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def fill(cache: SuffixCache, outputs: list[list[int]]) -> float:
    """Each output (after its first token, the prompt) committed by a request of its own, 16
    tokens a commit; seconds per committed token."""
    seconds, tokens = 0.0, 0
    for output in outputs:
        drafter = make_drafter("suffix", {}, suffixes=cache)
        drafter.reset(output[:1], SamplingParams())
        start = time.perf_counter()
        for offset in range(1, len(output), 16):
            drafter.commit(output[offset : offset + 16])
        seconds += time.perf_counter() - start
        tokens += len(output) - 1
    return seconds / max(tokens, 1)


def proposal_costs(cache: SuffixCache, prompt: list[int], steps: int, drafter: str, max_tokens: int) -> dict:
    """A request over `prompt` (the context) that commits the next of its own tokens `steps`
    times, proposing `max_tokens` after each: milliseconds per proposal and the share that drafted."""
    session = make_drafter(drafter, {"adaptive": False}, suffixes=cache)
    session.reset(prompt[:-steps], SamplingParams())
    times, drafted = [], 0
    for token in prompt[-steps:]:
        start = time.perf_counter()
        block = session.propose(max_tokens)
        times.append((time.perf_counter() - start) * 1e3)
        drafted += block.num_tokens > 0
        session.commit([token])
    return {
        "proposal_ms_p50": round(statistics.median(times), 4),
        "proposal_ms_p99": round(percentile(times, 0.99), 4),
        "proposals_drafting": round(drafted / steps, 3),
    }


def suffix_cost_command(
    requests: int = typer.Option(1000, "--requests", help="outputs the shared tree holds"),
    context: int = typer.Option(4096, "--context", help="tokens of the proposing request's context"),
    steps: int = typer.Option(500, "--steps", help="proposals timed, one per committed token"),
    max_tokens: int = typer.Option(10, "-k", "--max-tokens", help="the most a proposal drafts (K)"),
    target: str = TargetOpt,
    out: Optional[str] = typer.Option(None, "--out", help="also write the rows as JSON here"),
):
    """Memory and per-proposal cost of suffix decoding's trees after --requests outputs."""
    from ...loop.frontend import Frontend
    from ...models.loader import ModelSpec

    tokenizer = Frontend.from_spec(ModelSpec(source=target)).tokenizer
    exchanges = sharegpt_exchanges(requests + 64)
    outputs = [tokenizer(answer).input_ids for _, answer in exchanges if answer.strip()][:requests]
    prompt: list[int] = []
    for question, answer in exchanges[::-1]:  # questions and answers unlike the outputs' order
        prompt += tokenizer(question + "\n" + answer).input_ids
        if len(prompt) >= context + steps:
            break
    prompt = prompt[: context + steps]
    rows = []
    for drafter in ("suffix", "suffix_tree"):  # a tree each: one probe's tokens would be the next's drafts
        cache = SuffixCache()
        before = resident_bytes()
        seconds_per_token = fill(cache, outputs)
        after = resident_bytes()
        held = cache.stats()
        arctic_bytes = sum(trees._global_tree.estimate_memory() for trees in cache.scopes.values())
        rows.append(
            {
                "drafter": drafter,
                "outputs": held["outputs"],
                "tokens": held["tokens"],
                "resident_mb": round((after - before) / 2**20, 1),
                "arctic_estimate_mb": round(arctic_bytes / 2**20, 1),
                "commit_us_per_token": round(seconds_per_token * 1e6, 2),
                "context": context,
                **proposal_costs(cache, prompt, steps, drafter, max_tokens),
            }
        )
        del cache
    print_table(rows, list(rows[0]), left=("drafter",))
    if out:
        with open(out, "w") as stream:
            json.dump(rows, stream, indent=2)
        console.print(f"wrote {out}")
