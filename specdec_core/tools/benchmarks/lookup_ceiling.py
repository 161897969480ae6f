"""How much of the target's own output prompt lookup could draft: `specdec lookup-ceiling`
replays the target-only greedy outputs of a bench run (its outputs.jsonl) through the `pld`
drafter and through three oracles, pricing each step with the drafter's verify cost curve.

Costs are in one-token target steps, so target-only decoding of n tokens costs n and a modeled
decode speedup is n / (sum of step costs). Each oracle knows the future and, at every position,
may propose any prefix of the upcoming tokens that its source gets right (up to the same
maximum block); dynamic programming then picks the block lengths with the least total cost.
  * length oracle: the drafter's own lookup (same n-gram and occurrence rule), best lengths;
  * n-gram oracle: the best of all earlier occurrences whose preceding `min_ngram` tokens match
    the context's last ones (every continuation an n-gram lookup could pick);
  * copy oracle: any run of upcoming tokens found anywhere in prompt + output so far.
The bench's measured prefill time converts decode speedups into end-to-end ones."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch
from pydantic import ValidationError

from ...api.errors import format_validation_errors
from ...api.sampling import SamplingParams
from ...drafters.block_length import block_cost
from ...drafters.drafter_base import common_prefix_length
from ...drafters.pld import AdaptiveLookupParams, PromptLookupDrafter, lookup_continuation
from .bench import pld_params


def replay_drafter(
    prompt_ids: Sequence[int], output_ids: Sequence[int], params: AdaptiveLookupParams, max_draft: int
) -> list[int]:
    """Drafts proposed at each step when the pld drafter runs against a known greedy output."""
    drafter = PromptLookupDrafter(params)
    drafter.reset(prompt_ids, SamplingParams())
    proposed, position = [], 0
    while position < len(output_ids):
        proposal = drafter.propose(min(max_draft, len(output_ids) - position - 1)).tokens.tolist()
        num_accepted = common_prefix_length(proposal, output_ids[position:], len(proposal))
        drafter.commit(output_ids[position : position + num_accepted + 1])
        proposed.append(len(proposal))
        position += num_accepted + 1
    return proposed


def copyable_lengths(
    prompt_ids: Sequence[int], output_ids: Sequence[int], max_draft: int, key_length: int = 0
) -> list[int]:
    """For each output position i: the longest run output[i : i + m] (m <= max_draft, and short
    enough to leave the last token to the target) that prompt + output[:i] holds at a start s
    whose preceding `key_length` tokens equal the context's last ones (0: any start)."""
    ids = torch.tensor([*prompt_ids, *output_ids])
    lengths = []
    for index in range(len(output_ids)):
        committed = len(prompt_ids) + index
        cap = min(max_draft, len(output_ids) - index - 1)
        if cap == 0:
            lengths.append(0)
            continue
        future = ids[committed : committed + cap]
        # windows[s] = committed[s : s + cap], padded with -1 past the committed end
        padded = torch.cat([ids[:committed], torch.full((cap,), -1)])
        runs = (padded.unfold(0, cap, 1)[:committed] == future).int().cumprod(-1).sum(-1)
        if key_length:
            starts = torch.arange(key_length, committed)  # s = key_length .. committed - 1
            if starts.numel():
                keys = ids[: committed - 1].unfold(0, key_length, 1)  # keys[s - key_length] = ids[s - key_length : s]
                runs = runs[starts][(keys == ids[committed - key_length : committed]).all(-1)]
            else:
                runs = runs[:0]
        lengths.append(int(runs.max()) if runs.numel() else 0)
    return lengths


def lookup_lengths(
    prompt_ids: Sequence[int], output_ids: Sequence[int], params: AdaptiveLookupParams, max_draft: int
) -> list[int]:
    """For each output position: how many tokens of the drafter's lookup (before its block-length
    choice) match the upcoming output."""
    context = [*prompt_ids, *output_ids]
    lengths = []
    for index in range(len(output_ids)):
        cap = min(max_draft, len(output_ids) - index - 1)
        _, continuation = lookup_continuation(context[: len(prompt_ids) + index], params, cap)
        upcoming = output_ids[index : index + len(continuation)]
        lengths.append(common_prefix_length(continuation, upcoming, len(continuation)))
    return lengths


def cheapest_cost(max_drafts: Sequence[int], verify_cost: Sequence[float]) -> float:
    """Least total cost to decode all positions when position i may draft up to max_drafts[i]."""
    best = [0.0] * (len(max_drafts) + 1)
    for index in range(len(max_drafts) - 1, -1, -1):
        best[index] = min(block_cost(verify_cost, k) + best[index + k + 1] for k in range(max_drafts[index] + 1))
    return best[0]


ORACLES = ("length_oracle", "ngram_oracle", "copy_oracle")


def lookup_ceiling(
    outputs: list[dict], params: AdaptiveLookupParams, max_draft: int, measured_method: str
) -> list[dict]:
    """One row per category and overall: the measured speedup of `measured_method` (when the
    outputs hold it), the replayed drafter's modeled decode speedup, each oracle's, and the
    n-gram oracle's end to end."""
    by_question = defaultdict(dict)
    for record in outputs:
        by_question[(record["category"], record["question_id"])][record["method"]] = record
    if not by_question:
        raise ValueError("the bench run holds no outputs")
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (category, _), runs in by_question.items():
        if "target" not in runs:
            raise ValueError("the outputs hold no 'target' runs to replay")
        target = runs["target"]
        prompt_ids, tokens = target["prompt_ids"], target["token_ids"]
        prefill_s = (target["prefill_ms"] or 0.0) / 1e3
        target_decode_s = target["seconds"] - prefill_s
        costs = {
            "replayed": sum(
                block_cost(params.verify_cost, k) for k in replay_drafter(prompt_ids, tokens, params, max_draft)
            ),
            "length_oracle": cheapest_cost(lookup_lengths(prompt_ids, tokens, params, max_draft), params.verify_cost),
            "ngram_oracle": cheapest_cost(
                copyable_lengths(prompt_ids, tokens, max_draft, params.min_ngram), params.verify_cost
            ),
            "copy_oracle": cheapest_cost(copyable_lengths(prompt_ids, tokens, max_draft), params.verify_cost),
        }
        for key in (category, "overall"):
            total = totals[key]
            total["questions"] += 1
            total["tokens"] += len(tokens)
            total["prefill_s"] += prefill_s
            total["target_decode_s"] += target_decode_s
            for name, cost in costs.items():  # modeled time: the target's decode time scaled by the cost ratio
                total[f"{name}_decode_s"] += target_decode_s * cost / max(len(tokens), 1)
            if measured_method in runs:
                measured = runs[measured_method]
                total["measured_s"] += measured["seconds"]
                total["measured_decode_s"] += measured["seconds"] - (measured["prefill_ms"] or 0.0) / 1e3

    def ratio(numerator: float, denominator: float):
        return round(numerator / denominator, 3) if denominator else None

    rows = []
    for category in sorted(key for key in totals if key != "overall") + ["overall"]:
        total = totals[category]
        target_s = total["prefill_s"] + total["target_decode_s"]
        rows.append(
            {
                "category": category,
                "questions": int(total["questions"]),
                "tokens": int(total["tokens"]),
                "prefill_share": ratio(total["prefill_s"], target_s),
                "measured": ratio(target_s, total["measured_s"]),
                "measured_decode": ratio(total["target_decode_s"], total["measured_decode_s"]),
                "replayed_decode": ratio(total["target_decode_s"], total["replayed_decode_s"]),
                **{f"{name}_decode": ratio(total["target_decode_s"], total[f"{name}_decode_s"]) for name in ORACLES},
                "ngram_oracle": ratio(target_s, total["prefill_s"] + total["ngram_oracle_decode_s"]),
            }
        )
    return rows


def load_bench_run(bench_dir: Path, overrides: dict[str, Any]) -> tuple[list[dict], AdaptiveLookupParams, int]:
    """(outputs, the pld parameters the run used with `overrides` on top, its K) of a greedy
    `specdec bench --out` directory; raises ValueError saying what is wrong with it."""
    try:
        config = json.loads((bench_dir / "bench.json").read_text())["config"]
        outputs = [json.loads(line) for line in (bench_dir / "outputs.jsonl").read_text().splitlines() if line]
        greedy = config["temperature"] == 0
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"cannot read a bench run from {bench_dir}: {error}") from None
    if not greedy:
        raise ValueError("lookup-ceiling replays greedy outputs: the bench must run at temperature 0")
    try:
        settings = {**pld_params(config), **config["drafter_params"].get("pld", {})}
        return outputs, AdaptiveLookupParams(**{**settings, **overrides}), config["num_draft_tokens"]
    except KeyError as error:
        raise ValueError(f"cannot read a bench run from {bench_dir}: its config lacks {error}") from None
    except ValidationError as error:
        raise ValueError(format_validation_errors(error.errors(), "drafter 'pld'")) from None
