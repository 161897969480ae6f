"""Tools over the engine: the `specdec` CLI (cli.py), the Spec-Bench benchmark (bench.py,
report.py, questions.py), the verify cost curve (verify_cost.py), the lookup replay
(lookup_ceiling.py) and EASD's calibration (calibrate.py). Nothing in the engine imports them."""
