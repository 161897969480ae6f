"""EntMTP's tree scheduler (specdec_core/trees/scheduler.py): binary_tau switches exactly where the
scores cross tau_on and tau_off, never flaps between them, ladder bins, and the paper's score."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from specdec_core.trees.scheduler import SchedulerParams, TreeScheduler, path_score

PARAMS = TypeAdapter(SchedulerParams)


def trees_for(params: dict, scores: list[float]) -> list[str]:
    scheduler = TreeScheduler(PARAMS.validate_python(params))
    return [scheduler.choose(score) for score in scores]


def test_binary_tau_switches_where_the_scores_cross_with_hysteresis():
    params = {"name": "binary_tau", "conservative": "small", "aggressive": "big", "tau_on": 0.6, "tau_off": 0.5}
    scores = [0.2, 0.7, 0.65, 0.55, 0.5, 0.62, 0.6, 0.3]
    # on above 0.6; stays on down to 0.5 (inclusive switches off); 0.6 itself does not switch on
    assert trees_for(params, scores) == ["small", "big", "big", "big", "small", "big", "big", "small"]
    # between the thresholds nothing flaps, whichever tree is in use
    between = [0.52, 0.58, 0.51, 0.59] * 5
    assert set(trees_for(params, between)) == {"small"}
    assert set(trees_for(params, [0.9, *between])) == {"big"}


def test_binary_tau_has_a_single_threshold_by_default_and_checks_its_order():
    params = {"name": "binary_tau", "conservative": "small", "aggressive": "big", "tau_on": 0.6}
    assert trees_for(params, [0.61, 0.6, 0.61, 0.59]) == ["big", "small", "big", "small"]
    with pytest.raises(ValidationError, match="tau_off"):
        PARAMS.validate_python({**params, "tau_off": 0.7})


def test_ladder_bins_and_static():
    ladder = {"name": "ladder", "trees": ["a", "b", "c", "d"], "thresholds": [0.3, 0.6, 0.9]}
    assert trees_for(ladder, [0.1, 0.3, 0.31, 0.6, 0.75, 0.95]) == ["a", "a", "b", "b", "c", "d"]
    with pytest.raises(ValidationError, match="rising thresholds"):
        PARAMS.validate_python({**ladder, "thresholds": [0.6, 0.3, 0.9]})
    assert trees_for({"name": "static", "tree": "t"}, [0.0, 1.0]) == ["t", "t"]


def test_the_papers_score_is_the_verifiers_top1_probability():
    # g_d = p0 * p_1 * .. * p_d never exceeds p0, so max(p0, g_1..g_D) is p0
    assert path_score([0.9, 0.8, 0.5]) == pytest.approx(0.9)
    assert path_score([0.4]) == pytest.approx(0.4)
