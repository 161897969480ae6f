"""`specdec` command line: the app and its in-process commands, registered here in the order
`specdec --help` lists them (cli_decoding.py, cli_measuring.py, cli_preparing.py, gpu_report.py,
step_ops.py hold them; cli_common.py what they share). The console script (deployments/cli.py)
adds the serving commands to this app, with the console, `fail` and `request_from_options`, and
hands `bench` its endpoint client through typer's context object (`{"endpoint_client": factory}`),
so this package never imports the serving side."""

from __future__ import annotations

import typer

from .cli_common import console, fail, request_from_options
from .cli_decoding import bench, generate, quality
from .cli_measuring import calibrate_easd, lookup_ceiling, verify_cost
from .cli_preparing import convert, frontier, plan, train_heads_command
from .gpu_report import gpu_report
from .step_ops import step_ops_command

__all__ = ["app", "console", "fail", "request_from_options"]

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Speculative decoding for large LMs.")
# in the order `specdec --help` lists them
COMMANDS = {
    "gpu-report": gpu_report,
    "step-ops": step_ops_command,
    "generate": generate,
    "bench": bench,
    "quality": quality,
    "verify-cost": verify_cost,
    "train-heads": train_heads_command,
    "frontier": frontier,
    "lookup-ceiling": lookup_ceiling,
    "calibrate-easd": calibrate_easd,
    "plan": plan,
    "convert": convert,
}
for name, command in COMMANDS.items():
    app.command(name)(command)
