"""regime_study.py's summaries of its runs, on runs with known numbers."""

import pytest

from evidence import regime_study


def run(endpoint, curve, weights=()):
    """A run as run_training returns it: eval.json and metrics.jsonl's rows, one per iteration, the
    held-out gain logged every second one."""
    report = {"rows": [{"method": "learned (mean)", "diff_mean": endpoint}]}
    rows = [{"iteration": i + 1} for i in range(max(len(weights), 2 * len(curve)))]
    for row, weight in zip(rows, weights):
        row["shrinkage"] = weight
    for row, gain in zip(rows[1::2], curve):
        row["heldout_gain"] = gain
    return report, rows


def test_the_endpoint_and_the_area_under_the_learning_curve():
    assert regime_study.gains(run(0.5, [0.1, 0.2, 0.6])) == (0.5, pytest.approx(0.3))


def test_differences_are_paired_by_seed():
    first = [run(1.0, [1.0]), run(3.0, [2.0]), run(5.0, [3.0])]
    second = [run(0.5, [0.0]), run(2.5, [1.0]), run(4.5, [2.0])]
    # every seed's endpoint differs by exactly 0.5 and its area by 1: no spread, zero half-width
    assert regime_study.paired(first, second, 0) == "0.500 ± 0.000"
    assert regime_study.paired(first, second, 1) == "1.000 ± 0.000"


def test_the_weight_trajectory_is_the_median_over_runs_at_the_chosen_iterations():
    weights = [[0.9 - 0.01 * i for i in range(30)], [0.5] * 30, [0.1] * 30]
    runs = [run(0.0, [0.0], w) for w in weights]
    line = regime_study.weight_trajectory(runs)
    assert line.startswith("1: 0.50, 2: 0.50")
    assert line.endswith("30: 0.50")
