"""`specdec verify-cost`, `lookup-ceiling` and `calibrate-easd`: the commands that measure a
target on this machine (its forward cost curve, what prompt lookup could earn, EASD's entropy
threshold) and print the parameters that follow from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..api.errors import format_validation_errors
from ..models.loader import ModelSpec
from .cli_common import (
    DraftDtypeOpt,
    DraftLayersOpt,
    DraftOpt,
    TargetDtypeOpt,
    TargetOpt,
    build_engine,
    comma_list,
    console,
    fail,
    parse_params,
    print_table,
)


def verify_cost(
    max_tokens: int = typer.Option(16, "--max-tokens", help="largest block: K + 1 for K drafts"),
    repeats: int = typer.Option(20, "--repeats"),
    context: int = typer.Option(200, "--context", help="prompt tokens before the block"),
    batch_sizes: str = typer.Option("", "--batch-sizes", help="also the target over this many sessions at once: 4,16"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    draft: str = DraftOpt,
    draft_dtype: str = DraftDtypeOpt,
    draft_layers: Optional[int] = DraftLayersOpt,
):
    """Cost of one forward over n = 1..max-tokens new tokens, target and draft model: the
    curve that decides when speculation pays (a K-draft verify is n = K + 1); with
    --batch-sizes, the target's batched steps (that many sessions' blocks in one forward)."""
    from .measuring.verify_cost import measure

    if max_tokens < 1 or repeats < 1 or context < max_tokens:
        fail("need --max-tokens >= 1, --repeats >= 1 and --context >= --max-tokens")
    engine = build_engine(target, target_dtype, draft, draft_dtype, draft_layers)
    try:
        sizes = tuple(int(size) for size in comma_list(batch_sizes))
        rows, params = measure(engine, max_tokens, repeats, context, sizes)
    except ValueError as error:
        fail(str(error))
    print_table(rows, rows[0], left=())
    if "verify_cost" in params:  # the curve starts at one draft, a 2-token forward
        console.print(
            f"pld drafter on this machine: --drafter-param 'verify_cost={json.dumps(params['verify_cost'])}'",
            soft_wrap=True,
        )
    if "draft_cost" in params:  # model and mla drafters also price each draft forward
        console.print(
            f"model and mla drafters, also: --drafter-param 'draft_cost={params['draft_cost']}'", soft_wrap=True
        )
    costs = engine.frontend.draft_costs()
    if costs is not None:  # what the engine prices them with by default here (draft_costs.py, cached)
        console.print(f"measured at load (the defaults on this machine): {costs.model_dump()}; {costs.verdict()}")


def lookup_ceiling(
    bench_dir: Path = typer.Argument(..., help="a bench --out directory whose methods include target (at T = 0)"),
    method: str = typer.Option("specdec:greedy+pld", "--method", help="the measured method shown beside the replay"),
    drafter_param: list[str] = typer.Option(
        [], "--drafter-param", help="pld k=v over the bench's settings, repeatable"
    ),
):
    """Replay the bench's target-only greedy outputs through the pld drafter and through three
    oracles under the verify cost curve: what prompt lookup earns and could at most earn."""
    from .benchmarks.lookup_ceiling import load_bench_run
    from .benchmarks.lookup_ceiling import lookup_ceiling as ceiling_rows

    try:
        outputs, params, max_draft = load_bench_run(bench_dir, parse_params(drafter_param))
        rows = ceiling_rows(outputs, params, max_draft, method)
    except ValueError as error:
        fail(str(error))
    print_table(rows, rows[0], left=("category",))


def calibrate_easd(
    per_category: int = typer.Option(3, "--per-category", help="Spec-Bench questions per category"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    top_fraction: float = typer.Option(0.05, "--top-fraction", help="the paper's p"),
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
):
    """EASD's tau_H for a target: the mean of the top 5% of its entropies (nats) over its own greedy
    answers. The value EASD uses when a request gives no tau_h; measured once and cached."""
    from pydantic import ValidationError

    from ..calibration.profile_types import CalibrationSettings
    from ..calibration.target_profile import calibration_progress, load_profile, profile_path

    try:
        settings = CalibrationSettings(
            questions_per_category=per_category, max_new_tokens=max_new_tokens, top_fraction=top_fraction
        )
    except ValidationError as error:
        fail(format_validation_errors(error.errors(), "calibration"))
    engine = build_engine(target, target_dtype, "none", "float32", None)
    spec = ModelSpec(source=target, dtype=target_dtype)
    profile = load_profile(spec, engine.target_model, engine.frontend, settings, calibration_progress(target))
    console.print(f"steps={profile.num_entropies} cached at {profile_path(spec, settings)}")
    default = " (requests without tau_h use it)" if settings == CalibrationSettings() else ""
    console.print(f"tau_h={profile.easd_tau_h:.4f}{default}")
