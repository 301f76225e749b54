"""train.py end to end: what it writes, resume, torchrun, the real-backbone path on tiny pipelines, and bad input."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import train
from conftest import ENV, ROOT, run_script


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as file:
        return [json.loads(line) for line in file]


def test_a_run_writes_checkpoint_metrics_table_and_figure(digits_run):
    rows = read_metrics(digits_run)
    assert [row["iteration"] for row in rows] == list(range(1, 61))
    assert all(row["reward"] < 0 for row in rows)  # teacher fidelity is a negative error
    checkpoint = torch.load(digits_run / "ckpt.pt", weights_only=False)
    assert checkpoint["iteration"] == 60 and checkpoint["policy_config"]["steps"] == 4
    assert checkpoint["config"]["backbone"] == "digits" and checkpoint["config"]["steps"] == 4
    assert {"policy", "optimizer", "rng"} <= set(checkpoint)
    evaluation = json.loads((digits_run / "eval.json").read_text())
    assert [row["method"] for row in evaluation["rows"]] == ["default", "learned (mean)", "learned (sampled)", "limit (teacher)"]
    assert evaluation["contexts"] == 128
    assert evaluation["rows"][-1]["mean"] == 0.0  # the teacher's own output has no error
    assert (digits_run / "train.png").stat().st_size > 0
    assert not list(digits_run.glob("*.tmp"))


def test_learned_schedule_beats_the_default_on_heldout_contexts(digits_run):
    rows = {row["method"]: row for row in json.loads((digits_run / "eval.json").read_text())["rows"]}
    learned = rows["learned (mean)"]
    # Paired over the same 128 held-out noises: the improvement must exceed 3.3 of its standard errors
    # (one-sided p < 0.0005). The half-width is a Student-t 95% one (127 degrees of freedom: 1.979 sem).
    standard_error = learned["diff_ci95"] / 1.979
    assert learned["diff_mean"] > 3.3 * standard_error
    assert learned["mean"] > rows["default"]["mean"]


class Killed(Exception):
    pass


def test_resume_after_a_kill_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    args = ["--iterations", "7", "--ckpt-interval", "3", "--eval-contexts", "4", "--contexts", "8"]
    train.main(train.parse_config([*args, "--out-dir", str(tmp_path / "full")]))
    full = read_metrics(tmp_path / "full")

    # Kill the run in the middle of iteration 6's rollouts: the checkpoint of iteration 3 stays,
    # the rows of iterations 4 and 5 were logged after it.
    real_load_reward = train.load_reward

    def load_dying_reward(*a, **k):
        reward = real_load_reward(*a, **k)
        calls = {"n": 0}

        def dying(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 6:
                raise Killed
            return reward(*args, **kwargs)

        return dying

    monkeypatch.setattr(train, "load_reward", load_dying_reward)
    killed = tmp_path / "killed"
    with pytest.raises(Killed):
        train.main(train.parse_config([*args, "--out-dir", str(killed)]))
    assert torch.load(killed / "ckpt.pt", weights_only=False)["iteration"] == 3
    assert len(read_metrics(killed)) == 5
    monkeypatch.setattr(train, "load_reward", real_load_reward)
    train.main(train.parse_config([*args, "--out-dir", str(killed), "--resume"]))
    resumed = read_metrics(killed)

    assert [row["iteration"] for row in resumed] == list(range(1, 8))
    timing = {"rollout_s", "step_s"}
    strip = lambda rows: [{k: v for k, v in row.items() if k not in timing} for row in rows]
    assert strip(resumed) == strip(full)
    final_full = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=False)["policy"]
    final_resumed = torch.load(killed / "ckpt.pt", weights_only=False)["policy"]
    for name in final_full:
        torch.testing.assert_close(final_resumed[name], final_full[name], rtol=0, atol=0)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    train.save_checkpoint(path, {"iteration": 1})

    def dies_halfway(state, file):
        with open(file, "wb") as handle:
            handle.write(b"half a checkpoint")
        raise Killed

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(Killed):
        train.save_checkpoint(path, {"iteration": 2})
    assert torch.load(path, weights_only=False) == {"iteration": 1}


def test_two_process_torchrun_first_update_equals_single_process(tmp_path):
    args = ["--iterations", "1", "--contexts", "8", "--eval-contexts", "4", "--baseline", "js"]
    train.main(train.parse_config([*args, "--out-dir", str(tmp_path / "single")]))
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    double = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", os.path.join(ROOT, "train.py"), *args, "--out-dir", "double"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert double.returncode == 0, double.stderr
    assert "2 rank(s), 4 contexts each" in double.stdout
    # The same global batch gives the same rewards and the same averaged gradient.
    assert read_metrics(tmp_path / "double")[0]["reward"] == pytest.approx(read_metrics(tmp_path / "single")[0]["reward"], rel=1e-6)
    one = torch.load(tmp_path / "single" / "ckpt.pt", weights_only=False)["policy"]
    two = torch.load(tmp_path / "double" / "ckpt.pt", weights_only=False)["policy"]
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)
    # A non-zero gradient moved every parameter, so the comparison above is not between two no-ops.
    grad_norms = [read_metrics(tmp_path / name)[0]["grad_norm"] for name in ("single", "double")]
    assert grad_norms[0] > 0 and grad_norms[1] == pytest.approx(grad_norms[0], rel=1e-5)


@pytest.mark.parametrize("flag, value", [("--backbone", "sd4"), ("--reward", "beauty"), ("--baseline", "mean"),
                                         ("--init", "zeros"), ("--dtype", "fp8"), ("--policy", "local")])
def test_an_unknown_name_fails_in_one_line_with_the_choices(capsys, flag, value):
    with pytest.raises(SystemExit) as error:
        train.parse_config([flag, value])
    assert error.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"argument {flag}: invalid choice: '{value}' (choose from" in lines[0]


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--rollouts", "1"], "--rollouts must be at least 2"),
    (["--contexts", "2"], "needs at least 3 contexts"),
    (["--contexts", "3", "--baseline", "js-unbiased"], "needs at least 4 contexts"),
    (["--backbone", "sd35m"], "pass --prompts FILE"),
    (["--resume"], "does not exist"),
])
def test_bad_input_fails_in_one_line(tmp_path, args, message):
    config = train.parse_config([*args, "--out-dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=message) as error:
        train.check_config(config, world_size=1)
    assert "\n" not in str(error.value)


def test_contexts_must_split_over_ranks(tmp_path):
    config = train.parse_config(["--contexts", "9", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="not divisible by the 2 ranks"):
        train.check_config(config, world_size=2)


def test_resume_with_another_step_count_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    config = train.parse_config(["--out-dir", str(out)])
    torch.save({"config": {**vars(config), "steps": 8}}, out / "ckpt.pt")
    with pytest.raises(SystemExit, match="trained with steps=8, not 4; pass --steps 8"):
        train.check_config(train.parse_config(["--out-dir", str(out), "--resume"]), world_size=1)
    with pytest.raises(SystemExit, match="exists; pass --resume"):
        train.check_config(config, world_size=1)


def test_bad_input_exits_before_loading_anything(tmp_path):
    result = run_script("train.py", ["--contexts", "2"], tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "error: --baseline js needs at least 3 contexts per update (got --contexts 2); raise --contexts"]
    assert not (tmp_path / "out").exists()


def test_no_arguments_is_the_digits_main_job():
    config = train.parse_config([])
    assert (config.backbone, config.reward, config.steps, config.baseline) == ("digits", "teacher", 4, "js")
    assert (config.contexts, config.rollouts, config.policy) == (32, 2, "instance")


def test_paper_batch_sizes_for_the_real_backbones(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox in snow\n")
    sizes = {name: train.parse_config(["--backbone", name, "--prompts", str(prompts)]) for name in ("sd35m", "sdxl", "sd35l", "flux-dev")}
    assert {name: (c.contexts, c.rollouts, c.reward) for name, c in sizes.items()} == {
        "sd35m": (32, 2, "hpsv2"), "sdxl": (32, 2, "hpsv2"), "sd35l": (16, 2, "hpsv2"), "flux-dev": (16, 2, "hpsv2"),
    }
    assert all(c.weight_decay == 1e-4 and c.grad_clip == 1.0 for c in sizes.values())


@pytest.mark.parametrize("backbone", ["sd35m", "sdxl", "flux-dev"])
def test_trains_a_real_backbone_family_from_a_local_folder(tiny_runs, backbone):
    """The real-backbone path end to end: from_pretrained on a saved tiny random pipeline, rollouts
    with CFG (or Flux's guidance embedding), the teacher reward, updates and the held-out table."""
    out = tiny_runs[0][backbone]
    rows = read_metrics(out)
    assert [row["iteration"] for row in rows] == [1, 2] and all(row["grad_norm"] > 0 for row in rows)
    checkpoint = torch.load(out / "ckpt.pt", weights_only=False)
    assert checkpoint["config"]["backbone"] == backbone and checkpoint["policy_config"]["steps"] == 2
    methods = {row["method"]: row for row in json.loads((out / "eval.json").read_text())["rows"]}
    assert methods["limit (teacher)"]["mean"] == 0.0 and methods["default"]["mean"] < 0.0


def test_missing_weights_exit_in_one_line_before_loading(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox in snow\n")
    result = run_script("train.py", ["--backbone", "sd35m", "--reward", "teacher", "--prompts", str(prompts)], tmp_path)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: sd35m: the weights of stabilityai/stable-diffusion-3.5-medium")
    assert "--model-path" in lines[0]
    assert not (tmp_path / "out").exists()
