"""What `specdec bench` reports: rows per method and category (`aggregate`), written as
bench.json, outputs.jsonl and a plot.

Each row: throughput, speedup vs `target` in the same category, mean acceptance length,
agreement with target-only greedy output, the target's NLL of the produced continuation, task
accuracy where answers can be checked (grading.py), the policy's decision time, its counters,
and bytes on the wire per step for served methods."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from ...policies import POLICY_COUNTERS
from ...trees.topologies import default_bank
from .bench_records import BenchConfig, MethodResult

TABLE_COLUMNS = (
    "method",
    "category",
    "questions",
    "new_tokens",
    "tok_per_s",
    "speedup",
    "mean_accept_len",
    "identical_to_target",
    "target_nll",
    "correct",
    "accuracy",
    "draft_ms_p50",
    "target_ms_p50",
    "verify_ms_p50",
    *POLICY_COUNTERS,
)


def aggregate(results: list[MethodResult], methods: list[str]) -> list[dict]:
    """One row per (method, category) and per method overall."""
    grouped: dict[tuple[str, str], list[MethodResult]] = defaultdict(list)
    for result in results:
        grouped[(result.method, result.category)].append(result)
        grouped[(result.method, "overall")].append(result)
    rows = []
    categories = sorted({category for _, category in grouped if category != "overall"}) + ["overall"]
    for category in categories:
        target_rate = None
        for method in methods:
            entries = grouped.get((method, category), [])
            if not entries:
                continue
            runs = [entry.run for entry in entries]
            new_tokens = sum(len(run.token_ids) for run in runs)
            seconds = sum(run.seconds for run in runs)
            rate = new_tokens / seconds if seconds else 0.0
            if method == "target":
                target_rate = rate
            drafts = sum(run.metrics.get("spec_decode_num_drafts", 0) for run in runs)
            accepted = sum(run.metrics.get("spec_decode_num_accepted_tokens", 0) for run in runs)
            step_ms = {
                key: [run.metrics[key] for run in runs if key in run.metrics]
                for key in ("draft_ms_p50", "target_ms_p50", "verify_ms_p50")
            }
            tree_steps: dict[str, int] = defaultdict(int)  # a tree scheduler's choices
            tree_nodes = 0  # the nodes those steps verified
            for run in runs:
                for tree, count in run.metrics.get("tree_steps", {}).items():
                    tree_steps[tree.partition("@")[0]] += count
                    tree_nodes += count * tree_size(tree)
            identical = [entry.identical for entry in entries if entry.identical is not None]
            graded = [entry.correct for entry in entries if entry.correct is not None]
            nll_total = sum(entry.nll * len(entry.run.token_ids) for entry in entries)
            rows.append(
                {
                    "method": method,
                    "category": category,
                    "questions": len(entries),
                    "new_tokens": new_tokens,
                    "tok_per_s": round(rate, 3),
                    "speedup": round(rate / target_rate, 3) if target_rate else None,
                    "mean_accept_len": round(1 + accepted / drafts, 3) if drafts else None,
                    "identical_to_target": round(sum(identical) / len(identical), 3) if identical else None,
                    "target_nll": round(nll_total / new_tokens, 4) if new_tokens else None,
                    "correct": sum(graded) if graded else None,
                    "accuracy": round(sum(graded) / len(graded), 4) if graded else None,
                    **{key: round(statistics.median(values), 4) if values else None for key, values in step_ms.items()},
                    **({"tree_steps": dict(tree_steps)} if tree_steps else {}),
                    **({"mean_tree_nodes": round(tree_nodes / sum(tree_steps.values()), 2)} if tree_steps else {}),
                    **{
                        counter: sum(run.metrics.get(counter, 0) for run in runs)
                        for counter in POLICY_COUNTERS
                        if any(counter in run.metrics for run in runs)
                    },
                    **{  # served methods: bytes on the wire per step vs full fp32 logits
                        key: round(statistics.mean(run.metrics[key] for run in runs), 1)
                        for key in ("wire_bytes_per_step", "full_logits_bytes_per_step")
                        if all(key in run.metrics for run in runs)
                    },
                }
            )
    return rows


def write_report(rows: list[dict], outputs: list[dict], config: BenchConfig, out_dir: Path, extra_config: dict) -> Path:
    """OUT/outputs.jsonl, OUT/bench.json (config and rows), OUT/bench.png (speed per category)
    and OUT/quality.png (speed against quality per method)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "outputs.jsonl").write_text("".join(json.dumps(record) + "\n" for record in outputs))
    config_dict = {key: str(value) if isinstance(value, Path) else value for key, value in config.__dict__.items()}
    (out_dir / "bench.json").write_text(
        json.dumps({"config": {**config_dict, **extra_config}, "results": rows}, indent=2)
    )
    plot(rows, out_dir / "bench.png")
    plot_quality(rows, out_dir / "quality.png")
    return out_dir / "bench.json"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(row["method"] for row in rows))
    categories = list(dict.fromkeys(row["category"] for row in rows))
    figure, axes = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(categories) * max(1, len(methods)) / 3), 8))
    width = 0.8 / max(1, len(methods))
    for axis, key, label in (
        (axes[0], "speedup", "speedup vs target"),
        (axes[1], "mean_accept_len", "mean acceptance length"),
    ):
        for index, method in enumerate(methods):
            values = {row["category"]: row[key] for row in rows if row["method"] == method}
            axis.bar(
                [position + index * width for position in range(len(categories))],
                [values.get(category) or 0 for category in categories],
                width,
                label=method,
            )
        axis.set_xticks(
            [position + 0.4 - width / 2 for position in range(len(categories))], categories, rotation=30, ha="right"
        )
        axis.set_ylabel(label)
        if key == "speedup":
            axis.axhline(1.0, color="black", linewidth=0.8)
    axes[0].legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_quality(rows: list[dict], path: Path) -> None:
    """Each method overall: speedup against the target's NLL of its outputs and, where answers
    were checked, against accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overall = [row for row in rows if row["category"] == "overall" and row["speedup"] is not None]
    panels = [("target_nll", "target NLL of the output (nats/token)")]
    if any(row["accuracy"] is not None for row in overall):
        panels.append(("accuracy", "accuracy"))
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for axis, (key, label) in zip(axes[0], panels):
        for row in overall:
            if row[key] is None:
                continue
            axis.scatter(row["speedup"], row[key])
            axis.annotate(
                row["method"], (row["speedup"], row[key]), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
        axis.set_xlabel("speedup vs target")
        axis.set_ylabel(label)
        axis.axvline(1.0, color="black", linewidth=0.8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def tree_size(name: str) -> int:
    """The nodes of a tree as `tree_steps` names it: `nodes_N` (a tree built for its step), or a
    tree of the bank (NAME, NAME@D)."""
    if name.startswith("nodes_"):
        return int(name.removeprefix("nodes_"))
    return default_bank().get(name).num_nodes
