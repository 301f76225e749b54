"""train.py --track: every row of metrics.jsonl mirrored to TensorBoard and to Weights & Biases.

The stand-in test runs everywhere; the ones with the real packages (requirements-track.txt) run in
the optional environment (tests/hps_env.sh installs them; TRACK_TESTS_REQUIRED=1 makes a missing
package a failure there)."""

import importlib.machinery
import importlib.util
import json
import math
import os
import sys
import types

import pytest
from conftest import train_in_process

from store.track import check_tracker

SHORT = ["--iterations", "4", "--ckpt-interval", "2", "--eval-contexts", "4", "--contexts", "8"]
REQUIRED = os.environ.get("TRACK_TESTS_REQUIRED") == "1"


def needs(module):
    if importlib.util.find_spec(module) is None:
        if REQUIRED:
            pytest.fail(f"{module} is not installed: pip install -r requirements-track.txt")
        pytest.skip(f"optional environment (bash tests/hps_env.sh): {module} is not installed")


def metric_rows(out):
    """metrics.jsonl as the trackers see it: the numbers of each row by iteration, NaN left out."""
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return {
        row["iteration"]: {
            key: value
            for key, value in row.items()
            if key != "iteration" and isinstance(value, float | int) and math.isfinite(value)
        }
        for row in rows
    }


def test_wandb_gets_each_row_at_its_iteration(tmp_path, monkeypatch):
    """With a stand-in wandb module: one init naming the run folder, then one log per row of
    metrics.jsonl, at its iteration, with the same numbers."""
    calls = []

    class Run:
        step = 0

        def log(self, values, step):
            calls.append((step, values))
            self.step = step

        def finish(self):
            calls.append("finish")

    def init(**options):
        calls.append(options)
        return Run()

    stand_in = types.ModuleType("wandb")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    stand_in.init = init
    monkeypatch.setitem(sys.modules, "wandb", stand_in)
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = train_in_process(tmp_path / "out", *SHORT, "--track", "wandb")
    init_options, *logged, finished = calls
    assert init_options["name"] == "out" and init_options["dir"] == str(out)
    # another folder named out is another wandb run
    assert init_options["id"].startswith("out-") and str(tmp_path) not in init_options["id"]
    assert init_options["config"]["track"] == "wandb" and finished == "finish"
    assert dict(logged) == metric_rows(out) and [step for step, _ in logged] == [1, 2, 3, 4]


def test_a_missing_tracker_package_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="needs the tensorboard package: pip install -r "):
        check_tracker("tensorboard")
    check_tracker(None)  # nothing to check


def test_wandb_without_a_login_is_refused_at_the_door(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # installed
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with pytest.raises(ValueError, match="needs a login: run `wandb login`, or set WANDB_MODE="):
        check_tracker("wandb")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password key\n")
    (tmp_path / "netrc").chmod(0o600)
    check_tracker("wandb")  # logged in
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_tracker("wandb")


def test_tensorboard_event_files_hold_metrics_jsonl(tmp_path):
    needs("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = train_in_process(tmp_path / "out", *SHORT, "--track", "tensorboard")
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    mirrored = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            mirrored.setdefault(event.step, {})[tag] = event.value
    rows = metric_rows(out)
    assert set(mirrored) == set(rows)
    for step, values in rows.items():  # stored as float32 by TensorBoard
        assert mirrored[step] == pytest.approx(values, rel=1e-6, abs=1e-12), step


def test_tensorboard_after_a_resume_holds_each_step_once(tmp_path):
    needs("tensorboard")
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = train_in_process(tmp_path / "out", *SHORT, "--track", "tensorboard")
    checkpoint = torch.load(out / "ckpt.pt", weights_only=True)
    torch.save({**checkpoint, "iteration": 2}, out / "ckpt.pt")  # killed after iteration 4's log
    (out / "eval.json").unlink()
    train_in_process(out, *SHORT, "--track", "tensorboard")
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    steps = [event.step for event in events.Scalars("loss")]
    assert steps == [1, 2, 3, 4]


def test_wandb_runs_offline_without_a_network(tmp_path, monkeypatch):
    needs("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = train_in_process(tmp_path / "out", *SHORT, "--track", "wandb")
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    logs = list(runs[0].glob("run-out-*.wandb"))  # its id: the folder's name, its path's hash
    assert len(logs) == 1 and logs[0].stat().st_size > 0
    assert len(metric_rows(out)) == 4
