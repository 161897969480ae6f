"""The bench's report (specdec_core/tools/benchmarks/report.py): rows per method and category, the trees a
method's steps verified, and their mean size."""

from __future__ import annotations

from specdec_core.tools.benchmarks.bench_records import MethodResult, MethodRun
from specdec_core.tools.benchmarks.report import aggregate, tree_size


def result(method: str, category: str, tokens: int, seconds: float, **metrics) -> MethodResult:
    return MethodResult(method, category, MethodRun(list(range(tokens)), seconds, metrics), None, 1.0, None)


def test_rows_count_speed_against_the_target_and_the_trees_each_step_verified():
    results = [
        result("target", "qa", 10, 1.0),
        result("heads", "qa", 10, 0.5, tree_steps={"nodes_5": 3, "mc_sim_7b_63@2": 1}),
        result("heads", "qa", 10, 0.5, tree_steps={"nodes_5": 1}),
    ]
    rows = {(row["method"], row["category"]): row for row in aggregate(results, ["target", "heads"])}
    heads = rows["heads", "overall"]
    assert heads["speedup"] == 2.0 and "tree_steps" not in rows["target", "overall"]
    assert heads["tree_steps"] == {"nodes_5": 4, "mc_sim_7b_63": 1}
    assert heads["mean_tree_nodes"] == (4 * 5 + tree_size("mc_sim_7b_63@2")) / 5


def test_tree_sizes_of_budgeted_and_named_trees():
    assert tree_size("nodes_7") == 7 and tree_size("mc_sim_7b_63") == 63
    assert tree_size("spine_6x2") == 12 and tree_size("spine_6x2@1") == 2
