"""`specdec` command line: the app and its in-process commands, registered here in groups, in the
order `specdec --help` lists them (cli_decoding.py, cli_measuring.py, cli_preparing.py,
gpu_report.py, step_ops.py, step_profile.py, pipeline_step.py, suffix_cost.py, kv_pressure.py
hold them; cli_common.py what they share). The console script (deployments/cli.py) adds the
serving commands to this app, with the console, `fail` and `request_from_options`, and hands
`bench` its endpoint client through typer's context object (`{"endpoint_client": factory}`), so
this package never imports the serving side."""

from __future__ import annotations

import typer

from .benchmarks.structured_bench import structured_bench
from .cli_common import console, fail, request_from_options
from .cli_decoding import bench, generate, quality
from .cli_measuring import calibrate_easd, lookup_ceiling, verify_cost
from .cli_preparing import convert, frontier, plan, train_heads_command
from .measuring.compile_check import compile_check_command
from .measuring.gpu_report import gpu_report
from .measuring.kv_pressure import kv_pressure_command
from .measuring.pipeline_step import pipeline_step
from .measuring.step_ops import step_ops_command
from .measuring.step_profile import step_profile_command
from .measuring.suffix_cost import suffix_cost_command

__all__ = ["app", "console", "fail", "request_from_options"]

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Speculative decoding for large LMs.")
# command groups (panels of `specdec --help`), in the order it lists them; the console script
# adds the "Serve" group
GROUPS = {
    "Decode": {"generate": generate, "bench": bench, "structured-bench": structured_bench, "quality": quality},
    "Prepare a model": {
        "convert": convert,
        "plan": plan,
        "train-heads": train_heads_command,
        "frontier": frontier,
        "calibrate-easd": calibrate_easd,
    },
    "Measure": {
        "verify-cost": verify_cost,
        "lookup-ceiling": lookup_ceiling,
        "suffix-cost": suffix_cost_command,
        "kv-pressure": kv_pressure_command,
        "step-ops": step_ops_command,
        "step-profile": step_profile_command,
        "pipeline-step": pipeline_step,
        "compile-check": compile_check_command,
        "gpu-report": gpu_report,
    },
}
for group, commands in GROUPS.items():
    for name, command in commands.items():
        app.command(name, rich_help_panel=group)(command)
