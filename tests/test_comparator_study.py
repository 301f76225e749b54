"""comparator_study.py's bookkeeping: which rows run where, one folder per training, and the rule
that picks step-wise PPO's learning rate on training contexts (a best rate at the grid's edge adds
the next one beyond it, at most EXTEND times)."""

import argparse
import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest

from evidence import comparator_study as study


def test_every_training_has_its_own_folder():
    args = argparse.Namespace(out_dir="out")
    grid = ["digits-prompt", "mini-sd3"], study.ROWS, [0, 1, study.TUNING_RUN], study.RATES
    folders = [
        study.folder(args, name, row, seed, rate if row == study.PPO_ROW else None)
        for name, row, seed, rate in itertools.product(*grid)
    ]
    expected = 2 * 3 * (len(study.ROWS) - 1 + len(study.RATES))  # backbones x seeds x (rows, rates)
    assert len(set(folders)) == expected


def tune_with(scores, tmp_path, monkeypatch):
    """study.tune on a rate -> score table, with trainings that do nothing; returns its answer and
    the rates it trained."""
    trained = []
    monkeypatch.setattr(study, "train", lambda args, name, row, seed, rate: trained.append(rate))
    monkeypatch.setattr(study, "tuning_score", lambda args, name, rate: scores(rate))
    args = argparse.Namespace(out_dir=str(tmp_path))
    (tmp_path / "mini-sd3").mkdir(parents=True)
    with ThreadPoolExecutor(1) as pool:
        pending = {rate: pool.submit(lambda: None) for rate in study.RATES}
        answer = study.tune(args, pool, "mini-sd3", pending)
    return answer, trained


def test_an_inner_best_rate_is_chosen_without_more_trainings(tmp_path, monkeypatch):
    (scores, best), trained = tune_with(lambda rate: -abs(rate - 1e-4), tmp_path, monkeypatch)
    assert best == 1e-4 and trained == [] and sorted(scores) == study.RATES


def test_a_best_rate_at_the_edge_extends_the_grid_at_most_extend_times(tmp_path, monkeypatch):
    (scores, best), trained = tune_with(lambda rate: rate, tmp_path, monkeypatch)
    beyond = [3e-4 * study.RATE_STEP ** (n + 1) for n in range(study.EXTEND)]
    assert trained == pytest.approx(beyond) and best == trained[-1]
    assert len(scores) == len(study.RATES) + study.EXTEND
    # at the lower edge, downwards: the peak one step beyond is still at the edge, and the second
    # added rate, worse, confirms it
    (scores, best), trained = tune_with(
        lambda rate: -abs(rate - 3e-5 / study.RATE_STEP), tmp_path / "low", monkeypatch
    )
    assert trained == pytest.approx([3e-5 / study.RATE_STEP, 3e-5 / study.RATE_STEP**2])
    assert best == trained[0]
