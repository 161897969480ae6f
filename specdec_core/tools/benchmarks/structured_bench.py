"""`specdec structured-bench`: structured output under speculation, measured. N JSON schemas
(nested objects, enums, arrays, integers with ranges; made from a seed, the same every run), each
asked of every drafter, greedy and sampled. Per drafter and temperature: the share of valid
outputs, greedy outputs identical to drafter none's, tokens/s and its speedup over none, mean
acceptance length, and the ms a step spends verifying (the grammar's masking included). The
draft model's drafters also run blind to the grammar (`masked_by_grammar=false`) at T = 0: the
acceptance that masking its drafts buys. A plain run of drafter none without the schema gives
the grammar's cost per step."""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import typer

from ...api.request import GenerationRequest
from ..cli_common import DraftDtypeOpt, DraftLayersOpt, DraftOpt, TargetDtypeOpt, TargetOpt, build_engine, print_table

TOPICS = ["person", "book", "city", "product", "event", "recipe", "car", "planet", "song", "company"]
COLORS = ["red", "green", "blue", "black", "white"]
UNMASKED = {"masked_by_grammar": False}


def schema_for(index: int) -> tuple[str, dict[str, Any]]:
    """Schema `index`'s prompt and schema: its topic, and a shape that grows with index // 10 (a
    flat object; an array of enums; a nested object; an array of objects; two levels of nesting)."""
    rng = random.Random(index)
    topic, shape = TOPICS[index % len(TOPICS)], index // len(TOPICS) % 5
    low = rng.randint(0, 50)
    properties: dict[str, Any] = {
        "name": {"type": "string", "maxLength": 24},
        "rating": {"type": "integer", "minimum": low, "maximum": low + rng.randint(5, 100)},
        "color": {"enum": rng.sample(COLORS, 3)},
    }
    if shape >= 1:
        properties["tags"] = {"type": "array", "items": {"enum": ["new", "old", "rare", "common"]}, "maxItems": 3}
    if shape >= 2:
        properties["origin"] = nested({"country": {"type": "string", "maxLength": 16}, "year": year(rng)})
    if shape >= 3:
        item = nested(
            {"label": {"type": "string", "maxLength": 12}, "score": {"type": "integer", "minimum": 0, "maximum": 10}}
        )
        properties["reviews"] = {"type": "array", "items": item, "minItems": 1, "maxItems": 2}
    if shape >= 4:
        properties["details"] = nested({"available": {"type": "boolean"}, "size": nested({"width": year(rng)})})
    schema = nested(properties)
    prompt = f"Describe a {topic} as a JSON object with the fields {', '.join(properties)}."
    return prompt, schema


def nested(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def year(rng: random.Random) -> dict[str, Any]:
    start = rng.choice([1800, 1900, 1950, 2000])
    return {"type": "integer", "minimum": start, "maximum": start + 99}


def run_one(engine, prompt: str, schema: dict, drafter: dict, temperature: float, seed: int, max_tokens: int) -> dict:
    """One request: its tokens, validity, decode time (its prefill excluded) and metrics."""
    import jsonschema

    constraint = {"json_schema": schema, "disable_any_whitespace": True} if schema else None
    request = GenerationRequest(
        messages=[{"role": "user", "content": prompt}],
        drafter=drafter,
        sampling={"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "structured_output": constraint},
    )
    clock = time.perf_counter()
    completion = engine.complete(request)
    decode_s = time.perf_counter() - clock - completion.metrics["prefill_ms"] / 1e3
    valid = None  # no schema: nothing to check
    if schema:
        try:
            jsonschema.validate(json.loads(completion.text), schema)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
    steps = max(completion.metrics["num_steps"], 1)
    return {
        "token_ids": completion.token_ids,
        "valid": valid,
        "decode_s": decode_s,
        "acceptance": completion.metrics["mean_acceptance_length"],
        "verify_ms": completion.metrics["verify_ms_total"] / steps,
        "step_ms": decode_s * 1e3 / steps,
    }


def summary(name: str, temperature: float, runs: list[dict], baseline: Optional[dict]) -> dict:
    tokens = sum(len(run["token_ids"]) for run in runs)
    row = {
        "drafter": name,
        "T": temperature,
        "valid": "-" if runs[0]["valid"] is None else f"{sum(run['valid'] for run in runs)}/{len(runs)}",
        "tok/s": round(tokens / sum(run["decode_s"] for run in runs), 2),
        "accept len": round(statistics.mean(run["acceptance"] for run in runs), 3),
        "verify ms/step": round(statistics.mean(run["verify_ms"] for run in runs), 3),
        "ms/step": round(statistics.mean(run["step_ms"] for run in runs), 3),
    }
    if baseline is not None:
        row["speedup"] = round(row["tok/s"] / baseline["row"]["tok/s"], 3)
        same = sum(run["token_ids"] == base["token_ids"] for run, base in zip(runs, baseline["runs"]))
        row["same as none"] = f"{same}/{len(runs)}" if temperature == 0 else "-"
    return row


def structured_bench(
    schemas: int = typer.Option(50, min=1, help="JSON schemas, one request each per drafter and temperature"),
    drafters: str = typer.Option("none,pld,model,mla", help="the first is the baseline"),
    temperatures: str = typer.Option("0,0.8"),
    max_tokens: int = typer.Option(256, min=1),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    draft: str = DraftOpt,
    draft_dtype: str = DraftDtypeOpt,
    draft_layers: Optional[int] = DraftLayersOpt,
    out: Path = typer.Option(Path("structured_bench"), help="writes OUT/structured.json"),
):
    """Structured output under each drafter: valid outputs, identity, speed, acceptance, grammar cost."""
    engine = build_engine(target, target_dtype, draft, draft_dtype, draft_layers)
    cases = [schema_for(index) for index in range(schemas)]
    names = drafters.split(",")
    variants = [(name, {"name": name}) for name in names]
    variants += [(f"{name} blind", {"name": name, "params": UNMASKED}) for name in names if name in ("model", "mla")]
    for _, drafter in variants:  # warm-up: kernels, draft costs, the first grammar
        run_one(engine, *cases[0], drafter, 0.0, 0, 8)
    rows = []
    for temperature in (float(value) for value in temperatures.split(",")):
        baseline = None
        for name, drafter in variants:
            if name.endswith("blind") and temperature > 0:
                continue
            runs = [
                run_one(engine, prompt, schema, drafter, temperature, i, max_tokens)
                for i, (prompt, schema) in enumerate(cases)
            ]
            row = summary(name, temperature, runs, baseline)
            baseline = baseline or {"row": row, "runs": runs}
            rows.append(row)
            print_table([row], list(row))
        if temperature == 0:  # the baseline without a schema: what the grammar costs a step
            runs = [
                run_one(engine, prompt, {}, {"name": names[0]}, 0.0, i, max_tokens)
                for i, (prompt, _) in enumerate(cases)
            ]
            rows.append(summary(f"{names[0]}, no schema", 0.0, runs, None))
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps({"schemas": schemas, "rows": rows}, indent=1))
    columns = list(dict.fromkeys(column for row in rows for column in row))
    print_table([{column: row.get(column, "") for column in columns} for row in rows], columns)
