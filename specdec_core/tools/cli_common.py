"""What the `specdec` commands share: the console, the model and question options, parsing of
command-line values, building the in-process engine, failing with a message, printing a table and
building a request from options. The command modules (cli_*.py) import this; cli_app.py assembles them."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from ..api.errors import format_validation_errors
from ..calibration.questions import DEFAULT_QUESTIONS, NAMED_SETS
from ..heads.loading import AUTO
from ..models.loader import DEFAULT_DRAFT, ModelSpec
from . import params

console = Console(width=None if sys.stdout.isatty() else 200)


def default_of(model: type[BaseModel], field: str) -> Any:
    """An option's default, read from the pydantic model that owns it: each default is written once."""
    return model.model_fields[field].get_default(call_default_factory=True)


EMBEDDED = default_of(ModelSpec, "source")
TargetOpt = typer.Option(EMBEDDED, "--target", help="target: local dir, hub id, .gguf path or " + EMBEDDED)
TargetDtypeOpt = typer.Option(default_of(ModelSpec, "dtype"), "--target-dtype")
DraftOpt = typer.Option(DEFAULT_DRAFT.source, "--draft", help="draft model source ('none' for no draft model)")
DraftDtypeOpt = typer.Option(DEFAULT_DRAFT.dtype, "--draft-dtype")
DraftLayersOpt = typer.Option(DEFAULT_DRAFT.num_layers, "--draft-layers", help="keep the first N draft layers")
HeadsOpt = typer.Option(
    AUTO,
    "--heads",
    help="the target's heads: a directory of Medusa or Hydra heads or an EAGLE-3 layer, two separated by a comma "
    "(heads and a layer), auto (shipped ones), none",
)
TreesOpt = typer.Option([], "--trees", help="a tree bank file of `specdec frontier` (its trees by name), repeatable")
QuestionsOpt = typer.Option(
    str(DEFAULT_QUESTIONS),
    "--questions",
    help=f"a questions file in Spec-Bench's format (default: Spec-Bench), or a named set: {', '.join(NAMED_SETS)}",
)


def parse_params(pairs: list[str]) -> dict[str, Any]:
    try:
        return params.parse_params(pairs)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


def parse_scoped_params(pairs: list[str], option: str) -> dict[str, dict[str, Any]]:
    """`name.key=value` pairs -> {name: {key: value}} (per-policy or per-drafter settings)."""
    scoped: dict[str, dict[str, Any]] = {}
    for scoped_key, value in parse_params(pairs).items():
        if "." not in scoped_key:
            raise typer.BadParameter(f"{option} needs name.key=value, got {scoped_key!r}")
        name, key = scoped_key.split(".", 1)
        scoped.setdefault(name, {})[key] = value
    return scoped


def comma_list(text: str) -> list[str]:
    return params.split_top_level(text)


COMPILE_MODES = {"step": "compile", "layers": "compile_layers"}  # --compile's values: the ModelSpec field each sets


def model_specs(
    target: str, target_dtype: str, draft: str, draft_dtype: str, draft_layers: Optional[int], compiled: str = ""
) -> tuple[ModelSpec, Optional[ModelSpec]]:
    """The target's and the draft's specs (no draft: "none"); `compiled` one of COMPILE_MODES or ""."""
    if compiled and compiled not in COMPILE_MODES:
        fail(f"--compile takes {' or '.join(COMPILE_MODES)}, not {compiled!r}")
    compilation = {COMPILE_MODES[compiled]: True} if compiled else {}
    target_spec = ModelSpec(source=target, dtype=target_dtype, **compilation)
    if draft == "none":
        return target_spec, None
    return target_spec, ModelSpec(source=draft, dtype=draft_dtype, num_layers=draft_layers, **compilation)


def build_engine(
    target: str,
    target_dtype: str,
    draft: str,
    draft_dtype: str,
    draft_layers: Optional[int],
    heads: Optional[str] = "auto",
    trees: Iterable[Path] = (),
    compiled: str = "",
):
    """An in-process engine of `model_specs`' models."""
    from ..loop.engine import SpeculativeEngine
    from ..models.kernels.cpu import configure_cpu
    from ..trees.topologies import load_tree_bank

    configure_cpu(os.cpu_count() or 1)
    for bank in trees:
        load_tree_bank(bank)
    target_spec, draft_spec = model_specs(target, target_dtype, draft, draft_dtype, draft_layers, compiled)
    return SpeculativeEngine.from_specs(target_spec, draft_spec, None if heads == "none" else heads)


def fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def print_table(rows: Iterable[dict], columns: Iterable[str], left: tuple[str, ...] = ("method", "category")) -> None:
    table = Table()
    columns = list(columns)
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right")
    for row in rows:
        table.add_row(*["" if row.get(column) is None else str(row.get(column)) for column in columns])
    console.print(table)


def request_from_options(
    prompt: dict,
    sampling: dict,
    policy: Optional[str],
    policy_param: list[str],
    drafter: Optional[str],
    drafter_param: list[str],
    num_draft_tokens: Optional[int],
):
    """A GenerationRequest from command-line options (None: the engine's default); exits with a
    clear message on bad input."""
    from pydantic import ValidationError

    from ..api.request import GenerationRequest

    policy_params = parse_params(policy_param)
    if policy_params and not policy:
        fail("--policy-param needs --policy")
    try:
        return GenerationRequest(
            **prompt,
            sampling=sampling,
            policy={"name": policy, "params": policy_params} if policy else None,
            drafter={"name": drafter, "params": parse_params(drafter_param)} if drafter else None,
            num_draft_tokens=num_draft_tokens,
        )
    except ValidationError as error:
        fail(format_validation_errors(error.errors(), "request"))
