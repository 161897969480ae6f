"""`specdec frontier`: per task, the acceptance frontier of heads trees (frontier.py, the paper's
Algorithm 1), each frontier tree re-scored by its own rollout (the estimate's bias), a spread of
them re-ranked by measured tokens/s on the real loop beside the published default, binary_tau
between the two fastest with its threshold swept, a bank file of the
frontier trees with the throughput-best one and the schedule named, and a PNG of both frontiers.

Calibration uses the last questions of each category, so a bench over the first ones (its
default) measures the chosen trees on other prompts where a category has more questions than
both take (Spec-Bench's MT-bench categories have 10: the `sharegpt` task calibrates on held-out
ShareGPT first turns instead). Timings run at T = 0 with the greedy policy."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from tqdm.auto import tqdm

from ...api.request import GenerationRequest
from ...calibration.questions import (
    DEFAULT_QUESTIONS,
    SHAREGPT_HELD_OUT,
    first_turn,
    load_questions,
    sharegpt_first_turns,
)
from ...loop.engine import SpeculativeEngine
from ...trees.topologies import DEFAULT_TREE, default_bank
from .frontier_search import FrontierPoint, acceptance_frontier, own_acceptance, rank_table

# Spec-Bench's MT-bench part is eight categories; a task may name it as one (its categories hold
# 10 questions each, so its calibration questions are among any 10-per-category bench's)
TASKS = {"mt_bench": ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]}
SHAREGPT = "sharegpt"
MAX_SHAREGPT_PROMPT_TOKENS = 256  # train-heads' default bound: a long first turn is mostly prefill


def calibration_prompts(engine: SpeculativeEngine, task: str, num_prompts: int) -> list[list[int]]:
    """The chat-templated first turns of the task's last questions, `num_prompts` spread over its
    categories; for `sharegpt`, held-out ShareGPT first turns of at most 256 tokens."""
    if task == SHAREGPT:
        turns = sharegpt_first_turns(SHAREGPT_HELD_OUT + 8 * num_prompts)[SHAREGPT_HELD_OUT:]
        encoded = [engine.frontend.encode(GenerationRequest(messages=[{"role": "user", "content": t}])) for t in turns]
        return [prompt for prompt in encoded if len(prompt) <= MAX_SHAREGPT_PROMPT_TOKENS][:num_prompts]
    categories = TASKS.get(task, [task])
    per_category = -(-num_prompts // len(categories))
    prompts = []
    for category in categories:
        questions = load_questions(DEFAULT_QUESTIONS, [category], 1 << 20)[-per_category:]
        prompts += [engine.frontend.encode(GenerationRequest(messages=first_turn(q))) for q in questions]
    return prompts


def measure(engine: SpeculativeEngine, prompts: list[list[int]], params: dict, max_new_tokens: int) -> dict:
    """Heads decoding with these drafter params over the prompts, each tree verified whole (no
    node budget: the search times its trees): tokens/s (wall, prefill included) and tokens per step."""
    tokens, seconds, steps = 0, 0.0, 0
    for prompt in prompts:
        request = GenerationRequest(
            prompt_ids=prompt,
            drafter={"name": "heads", "params": {"adaptive": False, **params}},
            sampling={"max_tokens": max_new_tokens},
            num_draft_tokens=engine.heads["medusa"].num_heads,
        )
        start = time.perf_counter()
        completion = engine.complete(request)
        seconds += time.perf_counter() - start
        tokens += len(completion.token_ids)
        steps += completion.metrics["num_steps"]
    return {"tok_per_s": round(tokens / seconds, 2), "tokens_per_step": round(tokens / max(steps, 1), 3)}


def run_task(
    engine: SpeculativeEngine,
    task: str,
    num_prompts: int,
    max_new_tokens: int,
    budget: int,
    rerank: int,
    taus: list[float],
) -> dict:
    heads = engine.heads["medusa"]
    prompts = calibration_prompts(engine, task, num_prompts)
    width = budget  # a tree of `budget` nodes has no rank past budget - 1
    tables = []
    for prompt in tqdm(prompts, desc=f"{task}: greedy outputs and head ranks", unit="prompt"):
        request = GenerationRequest(
            prompt_ids=prompt, drafter={"name": "none"}, sampling={"max_tokens": max_new_tokens}
        )
        output = engine.complete(request).token_ids
        tables.append(rank_table(engine.target_model, heads, prompt, output, width))
    frontier = acceptance_frontier(tables, heads.num_heads, budget)
    names = {point.num_nodes: f"{task}_{point.num_nodes}" for point in frontier}
    for point in frontier:
        default_bank().add(names[point.num_nodes], point.paths)
    default = default_bank().limited(DEFAULT_TREE, heads.num_heads)
    # re-rank frontier sizes spread geometrically (1 node .. the largest) by measured throughput
    largest = frontier[-1].num_nodes
    picks = sorted({round(largest ** (i / max(rerank - 1, 1))) for i in range(rerank)})
    measured: dict[str, dict] = {}
    for name in tqdm([default.name, *(names[n] for n in picks)], desc=f"{task}: tokens/s", unit="tree"):
        measured[name] = measure(engine, prompts, {"tree": name}, max_new_tokens)
    ranked = sorted((names[n] for n in picks), key=lambda name: measured[name]["tok_per_s"], reverse=True)
    best = ranked[0]
    # binary_tau between the two fastest trees (the smaller one conservative), tau swept (the
    # paper's 1-D sweep)
    conservative, aggressive = sorted(ranked[:2], key=lambda name: default_bank().get(name).num_nodes)
    schedule = {"scheduler": "binary_tau", "tree": conservative, "aggressive": aggressive}
    sweep = [
        {"tau_on": tau, **measure(engine, prompts, {**schedule, "tau_on": tau}, max_new_tokens)}
        for tau in tqdm(taus if len(ranked) > 1 else [], desc=f"{task}: binary_tau", unit="tau")
    ]
    if sweep:
        schedule["tau_on"] = max(sweep, key=lambda row: row["tok_per_s"])["tau_on"]
    return {
        "task": task,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "default": {
            "tree": default.name,
            "nodes": default.num_nodes,
            "own": round(own_acceptance(tables, default.paths), 4),
            **measured[default.name],
        },
        "frontier": [
            point_row(point, names[point.num_nodes], measured.get(names[point.num_nodes])) for point in frontier
        ],
        "best": best,
        "binary_tau": {**schedule, "sweep": sweep},
        "trees": {name: [list(path) for path in default_bank().get(name).paths] for name in names.values()},
    }


def point_row(point: FrontierPoint, name: str, measured: Optional[dict]) -> dict:
    return {
        "tree": name,
        "nodes": point.num_nodes,
        "estimate": round(point.estimate, 4),  # mean accepted drafts per step, Algorithm 1's what-if
        "own": round(point.own, 4),  # the same, from the tree's own rollout
        "bias_pct": round(100 * (point.estimate - point.own) / point.own, 2) if point.own else None,
        **(measured or {}),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, default = result["frontier"], result["default"]
    figure, (acceptance, throughput) = plt.subplots(1, 2, figsize=(12, 4.5))
    nodes = [row["nodes"] for row in rows]
    acceptance.plot(nodes, [1 + row["estimate"] for row in rows], "o-", label="Algorithm 1 (what-if)")
    acceptance.plot(nodes, [1 + row["own"] for row in rows], "s-", label="own rollout")
    acceptance.plot([default["nodes"]], [1 + default["own"]], "r*", markersize=14, label=default["tree"])
    acceptance.set(xlabel="tree nodes", ylabel="tokens per step", title=f"{result['task']}: acceptance frontier")
    acceptance.legend()
    timed = [row for row in rows if "tok_per_s" in row]
    throughput.plot([row["nodes"] for row in timed], [row["tok_per_s"] for row in timed], "o-", label="frontier trees")
    throughput.plot([default["nodes"]], [default["tok_per_s"]], "r*", markersize=14, label=default["tree"])
    throughput.set(xlabel="tree nodes", ylabel="tokens/s", title=f"{result['task']}: re-ranked by throughput")
    throughput.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def frontier(
    engine: SpeculativeEngine,
    tasks: list[str],
    num_prompts: int,
    max_new_tokens: int,
    budget: int,
    rerank: int,
    taus: list[float],
    out: Path,
) -> list[dict]:
    if "medusa" not in engine.heads:  # rank_table reads each head on its own
        held = ", ".join(engine.heads) or "none"
        raise ValueError(f"the tree search replays Medusa heads (give --heads); the target has {held}")
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for task in tasks:
        result = run_task(engine, task, num_prompts, max_new_tokens, budget, rerank, taus)
        (out / f"{task}.json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result, out / f"{task}.png")
        results.append(result)
    return results
