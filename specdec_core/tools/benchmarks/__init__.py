"""`specdec bench` and `specdec quality`: the benchmark, its records and report, load sweeps, grading."""
