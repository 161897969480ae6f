"""`specdec quality`: what each lossy policy costs in quality for what it gains in speed. Runs the
bench on GSM8K (Spec-Bench's math_reasoning rows) and on HumanEval, at T = 0 (target-only,
greedy and the lossy policies that build on it) and at a sampling temperature (target-only,
rejection and the lossy policies that build on it), all on one drafter, and compares every
lossy policy with its lossless base on the same drafter: acceptance length gained, speedup,
outputs identical to target-only, the target's NLL of the outputs, and correct answers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...calibration.questions import DEFAULT_QUESTIONS, HUMANEVAL
from ...loop.engine import SpeculativeEngine
from .bench import parse_specdec_method, run_bench
from .bench_records import BenchConfig
from .report import write_report

# name -> (questions source, categories)
QUESTION_SETS = {"gsm8k": (str(DEFAULT_QUESTIONS), ["math_reasoning"]), "humaneval": (HUMANEVAL, ["all"])}
GREEDY_POLICIES = ("greedy", "easd", "dropmatch", "fly")  # the lossless base first
SAMPLING_POLICIES = ("rejection", "ears", "typical")
MODES = ("greedy", "sampling")  # the T = 0 runs and the runs at the sampling temperature


@dataclass
class QualityConfig:
    sets: list[str]
    questions_per_set: int
    max_new_tokens: int
    drafter: str
    num_draft_tokens: int
    temperature: float  # of the sampling runs
    seed: int
    # more `specdec:` methods: those of a sampling policy in the sampling runs, the others at T = 0
    extra_methods: list[str] = field(default_factory=list)
    modes: tuple[str, ...] = MODES


def runs(config: QualityConfig) -> list[tuple[float, list[str]]]:
    """(temperature, methods) of each bench run per question set; the base policy comes second."""
    suffix = f"+{config.drafter}@{config.num_draft_tokens}"
    # an extra method runs beside the policies of its kind: the sampling ones at the temperature
    extra_sampling = [
        method for method in config.extra_methods if parse_specdec_method(method).policy in SAMPLING_POLICIES
    ]
    extra_greedy = [method for method in config.extra_methods if method not in extra_sampling]
    greedy = ["target", *(f"specdec:{policy}{suffix}" for policy in GREEDY_POLICIES), *extra_greedy]
    sampling = ["target", *(f"specdec:{policy}{suffix}" for policy in SAMPLING_POLICIES), *extra_sampling]
    by_mode = {"greedy": (0.0, greedy), "sampling": (config.temperature, sampling)}
    return [by_mode[mode] for mode in config.modes]


def run_quality(
    engine: SpeculativeEngine, config: QualityConfig, out_dir: Path, progress: Callable[[Any], Any] = iter
) -> list[dict]:
    """The comparison rows (`compare`), after writing each bench run to OUT/<set>-T<temperature>."""
    rows = []
    for name in config.sets:
        questions, categories = QUESTION_SETS[name]
        for temperature, methods in runs(config):
            bench_config = BenchConfig(
                questions=questions,
                methods=methods,
                categories=categories,
                per_category=config.questions_per_set,
                max_new_tokens=config.max_new_tokens,
                temperature=temperature,
                seed=config.seed,
                num_draft_tokens=config.num_draft_tokens,
                policy_params={},
            )
            bench_rows, outputs = run_bench(engine, bench_config, progress)
            write_report(bench_rows, outputs, bench_config, out_dir / f"{name}-T{temperature:g}", {})
            overall = [row for row in bench_rows if row["category"] == "overall"]
            rows += compare(name, temperature, overall, base_method=methods[1])
    return rows


def compare(question_set: str, temperature: float, overall: list[dict], base_method: str) -> list[dict]:
    """Each method's overall row with its differences from `base_method` (same drafter, lossless)."""
    base = next(row for row in overall if row["method"] == base_method)
    table = []
    for row in overall:
        lossy = row["method"] not in ("target", base_method)

        def delta(key: str, digits: int):
            if not lossy or row[key] is None or base[key] is None:
                return None
            return round(row[key] - base[key], digits)

        table.append(
            {
                "set": question_set,
                "T": temperature,
                "method": row["method"],
                "questions": row["questions"],
                "speedup": row["speedup"],
                "mean_accept_len": row["mean_accept_len"],
                "accept_len_gain": delta("mean_accept_len", 3),
                "identical_to_target": row["identical_to_target"],
                "target_nll": row["target_nll"],
                "nll_change_pct": round(100 * (row["target_nll"] / base["target_nll"] - 1), 2) if lossy else None,
                "correct": row["correct"],
                "correct_change": delta("correct", 0),
                "counters": {key: row[key] for key in ("penalized", "pardoned", "loose") if key in row},
            }
        )
    return table


COLUMNS = ("set", "T", "method", "speedup", "accept len (gain)", "identical", "target NLL (change)", "correct (change)")


def markdown(rows: list[dict]) -> str:
    """The comparison as a Markdown table."""
    lines = ["| " + " | ".join((*COLUMNS, "counts")) + " |", "|" + "---|" * (len(COLUMNS) + 1)]

    def shown(value, fmt: str, change=None, change_fmt: str = "", unit: str = "") -> str:
        text = "-" if value is None else format(value, fmt)
        return text if change is None else f"{text} ({change:+{change_fmt}}{unit})"

    for row in rows:
        cells = [
            row["set"],
            f"{row['T']:g}",
            row["method"],
            shown(row["speedup"], ".2f") + "x",
            shown(row["mean_accept_len"], ".2f", row["accept_len_gain"], ".2f"),
            shown(row["identical_to_target"], ".0%"),
            shown(row["target_nll"], ".4f", row["nll_change_pct"], ".2f", "%"),
            f"{row['correct']}/{row['questions']}"
            + ("" if row["correct_change"] is None else f" ({row['correct_change']:+d})"),
            ", ".join(f"{name} {count}" for name, count in row["counters"].items()),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
