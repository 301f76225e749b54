"""tie_study.py's prediction, power calculation, multiple-test adjustment and report, on known
numbers."""

import math
from types import SimpleNamespace

import pytest
import torch
from test_regime_study import run

from evidence import bound, tie_confirm, tie_study


def test_the_seed_count_is_the_normal_power_formula_within_its_bounds():
    # ((1.95996 + 0.84162) * 1 / 0.5)^2 = 31.4: 32 seeds find a lead of half the spread 80% of times
    assert tie_study.seed_count(1.0, 0.5, 20, 100) == 32
    assert tie_study.seed_count(1.0, 1.0, 20, 100) == 20  # 7.85 asked: the pilot's count at least
    assert tie_study.seed_count(1.0, 0.1, 20, 100) == 100  # 785 asked: capped
    assert tie_study.seed_count(1.0, -0.1, 20, 100) == 100  # no lead predicted: the most
    expected = math.ceil(((1.959964 + 1.281552) * 4) ** 2)
    assert tie_study.seed_count(2.0, 0.5, 20, 200, power=0.9) == expected


def test_holm_multiplies_the_ordered_p_values_and_keeps_them_monotone():
    adjusted = tie_study.holm({"a": 0.01, "b": 0.04, "c": 0.03})
    # a: 3 x 0.01; c: 2 x 0.03; b: 1 x 0.04, raised to c's 0.06 (step-down keeps the order)
    assert adjusted == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
    assert tie_study.holm({"a": 0.6, "b": 0.9}) == pytest.approx({"a": 1.0, "b": 1.0})


def test_the_prediction_is_the_doubling_gain_times_the_mean_log2_factor():
    tie = bound.largest_factor_over_best(tie_study.ROLLOUTS, tie_study.CONTEXTS)[0]
    prediction = tie_study.predict({0: tie, 30: 0.0}, 0.5, torch.Generator().manual_seed(0))
    at_tie, at_zero = prediction["factors"][0], prediction["factors"][30]
    # at the tie RLOO and cross-context have one variance: one factor, about 1.15 (evidence.bound)
    assert at_tie["rloo"] == pytest.approx(at_tie["xctx"]) and 1.12 < at_tie["rloo"] < 1.17
    assert at_zero["xctx"] < 1 < at_zero["rloo"]  # alike contexts: cross-context is the better
    lead = prediction["lead"]
    expected = 0.5 * (math.log2(at_tie["xctx"]) + math.log2(at_zero["xctx"])) / 2
    assert lead["xctx"] == pytest.approx(expected) and lead["best"] == min(lead.values())
    # where doubling the batch gains nothing, no lead is predicted
    nothing = tie_study.predict({0: 0.9}, -0.2, torch.Generator().manual_seed(0))
    assert nothing["lead"] == {"rloo": 0.0, "xctx": 0.0, "best": 0.0}


def test_the_report_states_the_plan_and_pairs_js_with_the_better_row():
    def rows(gain, spread):  # seeds 0, 1, 2 add -spread, 0, +spread; endpoint and area alike
        return [run(gain + s * spread, [gain + s * spread]) for s in (-1, 0, 1)]

    rates = [3e-4, 1e-3, 3e-3]
    mean = {(row, rate): 0.1 * k for row in tie_study.ROWS for k, rate in enumerate(rates)}
    chosen = dict.fromkeys(tie_study.ROWS, 1e-3)
    chosen["js"] = 3e-3
    paths = {rate: {0: 0.66, 30: 0.9} for rate in rates}
    tuning = (chosen, mean, rates, 1e-3, paths)
    head = tie_study.setting_lines({"28": 0.93, "23": 0.39}, (2, 8), tuning)
    text = "\n".join(head)
    assert "chosen {2, 8}" in text and "{2,8} 0.93" in text
    assert "arm B one rate for all, 0.001" in text
    assert "| js | 0.000 | 0.100 | 0.200 | 0.003 (grid's edge) |" in text
    assert "| rloo | 0.000 | 0.100 | 0.200 | 0.001 |" in text
    assert "stays at the tie" in text and "0.001: 0.66, 0.90" in text

    runs = {"js": rows(1.3, 0.2), "rloo": rows(1.0, 0.1), "xctx": rows(1.2, 0.1)}
    runs[tie_study.DOUBLED] = rows(1.6, 0.1)
    factors = dict(rloo=1.2, xctx=1.1, ideal_rloo=1.3, ideal_best=1.25)
    lead = dict(rloo=0.1, xctx=0.05, best=0.05)
    prediction = dict(rho={0: 0.9}, factors={0: factors}, doubling_gain=0.4, lead=lead)
    pilot = dict(better="xctx", spread=0.3, difference="0.1 ± 0.1", asked=40, largest=100)
    pilot["spreads"] = dict(rloo=0.2, xctx=0.3)
    lines = tie_study.arm_lines("Arm A", chosen, prediction, pilot, list(range(3)), runs)
    text = "\n".join(lines)
    assert "| 0 | 0.90 | 1.200 | 1.100 | 1.300 | 1.250 |" in text
    assert "over the better of the two +0.050 (reward linear in log2 of the batch)" in text
    assert "spreads (area) of JS - RLOO 0.200 and of JS - cross-context 0.300" in text
    assert "with the larger spread asks 40 seeds (the most when no lead is predicted)" in text
    assert "run: 3 (seeds 0-2; at most 100)" in text
    # JS - cross-context per seed: 0.1 - 0.1, 0.1, 0.1 + 0.1 -> 0.100 ± t(0.975, 2) x 0.1 / sqrt 3
    half = 4.302653 * 0.1 / math.sqrt(3)
    assert f"area (headline): JS - xctx, the better of the two, 0.100 ± {half:.3f}" in text
    assert "RLOO at 2B - RLOO 0.600 ± 0.000" in text
    prediction["doubling_gain"] = -0.1
    text = "\n".join(tie_study.arm_lines("Arm A", chosen, prediction, pilot, [0, 1, 2], runs))
    assert "doubling the batch gains nothing here" in text


def test_the_grid_widens_until_every_best_rate_is_inside(tmp_path, monkeypatch):
    """A score peaked at 0.027 for every row: the grid grows 3e-3 -> 9e-3 -> 0.027 -> 0.081 and
    stops once 0.027 is inside; a peak beyond WIDENINGS steps stays at the edge."""

    def peaked_at(peak):
        def score(backbone, reward, prompts, seeds, methods):
            rate = methods["learned"]
            return {"learned": torch.tensor([-abs(math.log(rate / peak))])}

        return score

    monkeypatch.setattr(tie_study, "train", lambda *args, **kwargs: None)
    monkeypatch.setattr(tie_study, "run_folder", lambda out_dir, row, seed, rate: str(rate))
    monkeypatch.setattr(tie_study, "load_policy", lambda path: (float(path[:-8]), None))
    monkeypatch.setattr(tie_study, "policy_schedule", lambda policy, backbone: policy)
    monkeypatch.setattr(tie_study, "heldout_contexts", lambda *args: ([], []))
    monkeypatch.setattr(tie_study, "load_prompt_file", lambda path: [])
    monkeypatch.setattr(tie_study, "prompt_files", lambda out_dir: ["train.txt", "heldout.txt"])
    pool = SimpleNamespace(map=map)
    monkeypatch.setattr(tie_study, "score_methods", peaked_at(0.027))
    chosen, _, rates = tie_study.tune(str(tmp_path), pool, None, None)
    assert set(chosen.values()) == {0.027} and rates[-1] == 0.081 and rates[0] == 3e-4
    (tmp_path / "b").mkdir()  # a folder of its own: nothing of the first tuning is read
    monkeypatch.setattr(tie_study, "score_methods", peaked_at(10.0))
    chosen, _, rates = tie_study.tune(str(tmp_path / "b"), pool, None, None)
    assert len(rates) == len(tie_study.RATES) + tie_study.WIDENINGS and rates[-1] == chosen["js"]


def test_arm_b_takes_the_largest_rate_that_stays_at_the_tie(tmp_path, monkeypatch):
    """rho runs off the tie faster the larger the rate: arm B takes the largest rate whose JS
    tuning run keeps rho within a factor BAND of the tie, whatever the rows' rewards."""
    tie = bound.largest_factor_over_best(tie_study.ROLLOUTS, tie_study.CONTEXTS)[0]
    drift = {3e-4: 1.0, 1e-3: 1.5, 3e-3: 3.0, 9e-3: 40.0}  # rho's growth over the run, per rate

    def trajectory(out_dir, backbone, reward, rate):
        return {i: tie * drift[rate] ** (i / 30) for i in tie_study.TRAJECTORY}

    monkeypatch.setattr(tie_study, "trajectory", trajectory)
    rate, paths = tie_study.at_the_tie(str(tmp_path), None, None, sorted(drift))
    assert rate == 1e-3 and set(paths) == set(drift)
    assert (tmp_path / "trajectories.json").is_file()  # read back, not measured again
    monkeypatch.setattr(tie_study, "trajectory", None)
    assert tie_study.at_the_tie(str(tmp_path), None, None, sorted(drift))[0] == 1e-3


def test_the_confirmatory_plan_is_the_one_its_docstring_states():
    """The confirmatory run's prediction and seed counts follow from the exploratory numbers alone,
    and are those the plan fixed before the run."""
    lead, seeds = tie_confirm.plan()
    assert round(lead["rloo"], 3) == 0.075 and round(lead["xctx"], 3) == 0.054
    assert (seeds["B"][0], seeds["B"][-1], len(seeds["B"])) == (2000, 2147, 148)
    assert (seeds["A"][0], seeds["A"][-1], len(seeds["A"])) == (3000, 3191, 192)
    used = set(range(83)) | set(range(100)) | set(range(100, 104)) | set(range(1000, 1020))
    assert not used & set(seeds["A"] + seeds["B"])  # fresh seeds
    assert "148 seeds, 2000-2147" in tie_confirm.__doc__
    assert "192\n   seeds, 3000-3191" in tie_confirm.__doc__
