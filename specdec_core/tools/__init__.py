"""Tools over the engine: the `specdec` CLI (cli_app.py, its commands in cli_*.py), the benchmark
(bench.py, report.py, with task accuracy in grading.py), the verify cost curve (verify_cost.py)
and the lookup replay (lookup_ceiling.py). Nothing in the engine imports them."""
