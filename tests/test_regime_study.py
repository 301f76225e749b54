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


def test_a_cell_says_whether_doubling_the_batch_could_show_a_baseline_and_pairs_js_with_xctx():
    def rows(gain):  # three seeds, endpoint and area equal, seed s adds s
        return [run(gain + s, [gain + s], [0.5] * 30) for s in range(3)]

    factors = {"rloo": 1.5, "best": 1.1, "plug_in_rloo": 1.3, "plug_in_best": 0.95}
    start = (2.0, 1.0, factors, 0.4)
    gains = {"js": 1.2, "rloo": 1.0, "xctx": 1.5, "js-unbiased": 1.1, regime_study.DOUBLED: 1.8}
    runs = {row: rows(gain) for row, gain in gains.items()}
    text = "\n".join(regime_study.cell_lines("mini-sd3", 1e-3, {1e-3: 0.4}, start, runs))
    assert "endpoint: doubling RLOO's batch gains (+0.800 ± 0.000)" in text
    assert "area: doubling RLOO's batch gains (+0.800 ± 0.000)" in text
    assert "1.50x RLOO's and 1.10x the better" in text
    assert "1.30x and 0.95x with the plug-in" in text
    assert "JS - cross-context (paired): endpoint -0.300 ± 0.000, area -0.300 ± 0.000" in text
    assert "| js | 2.200 ± 2.484 |" in text  # the endpoint over seeds 1.2, 2.2, 3.2
    equal = {row: rows(1.0) for row in gains}
    text = "\n".join(regime_study.cell_lines("mini-sd3", 1e-3, {1e-3: 0.0}, start, equal))
    assert "gains nothing measurable" in text
