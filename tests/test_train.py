"""train.py end to end: what it writes, resume, torchrun, the real-backbone path on tiny pipelines,
and bad input."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import ENV, ROOT, SCRIPTS, run_script

import rewards
import train
from comparator import tpdm as ppo_settings
from store import checkpoint as checkpoints
from store import files as folder


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
    assert [row["method"] for row in evaluation["rows"]] == [
        "default",
        "learned (mean)",
        "learned (sampled)",
        "limit (teacher)",
    ]
    assert evaluation["contexts"] == 128
    assert evaluation["rows"][-1]["mean"] == 0.0  # the teacher's own output has no error
    assert (digits_run / "train.png").stat().st_size > 0
    assert not list(digits_run.glob("*.tmp"))


def test_learned_schedule_beats_the_default_on_heldout_contexts(digits_run):
    rows = {
        row["method"]: row for row in json.loads((digits_run / "eval.json").read_text())["rows"]
    }
    learned = rows["learned (mean)"]
    # Paired over the same 128 held-out noises: the improvement must exceed 3.3 of its standard
    # errors (one-sided p < 0.0005). The half-width is a Student-t 95% one (127 dof: 1.979 sem).
    standard_error = learned["diff_ci95"] / 1.979
    assert learned["diff_mean"] > 3.3 * standard_error
    assert learned["mean"] > rows["default"]["mean"]


class Killed(Exception):
    pass


@pytest.mark.parametrize(
    "policy",
    [[], ["--policy", "stepwise"], ["--policy", "stepwise", "--optimizer", "ppo"]],
    ids=["instance", "stepwise", "stepwise-ppo"],
)
def test_resume_after_a_kill_matches_an_uninterrupted_run(tmp_path, monkeypatch, policy):
    args = ["--iterations", "7", "--ckpt-interval", "3", "--eval-contexts", "4", "--contexts", "8"]
    args += policy
    train.main(train.parse_config([*args, "--out-dir", str(tmp_path / "full")]))
    full = read_metrics(tmp_path / "full")

    # Kill the run in the middle of iteration 6's rollouts: the checkpoint of iteration 3 stays,
    # the rows of iterations 4 and 5 were logged after it.
    real_load_reward = rewards.load_reward

    def load_dying_reward(*a, **k):
        reward = real_load_reward(*a, **k)
        calls = {"n": 0}

        def dying(latents, prompts, *args):
            calls["n"] += (
                len(prompts) == 16
            )  # a training batch (8 contexts x 2 rollouts), not the held-out curve
            if calls["n"] == 6:
                raise Killed
            return reward(latents, prompts, *args)

        return dying

    monkeypatch.setattr(rewards, "load_reward", load_dying_reward)
    killed = tmp_path / "killed"
    with pytest.raises(Killed):
        train.main(train.parse_config([*args, "--out-dir", str(killed)]))
    assert torch.load(killed / "ckpt.pt", weights_only=False)["iteration"] == 3
    assert len(read_metrics(killed)) == 5
    monkeypatch.setattr(rewards, "load_reward", real_load_reward)
    train.main(train.parse_config([*args, "--out-dir", str(killed), "--resume"]))
    resumed = read_metrics(killed)

    assert [row["iteration"] for row in resumed] == list(range(1, 8))
    timing = {"rollout_s", "step_s"}

    def strip(rows):
        return [{k: v for k, v in row.items() if k not in timing} for row in rows]

    assert strip(resumed) == strip(full)
    final_full = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=False)["policy"]
    final_resumed = torch.load(killed / "ckpt.pt", weights_only=False)["policy"]
    for name in final_full:
        torch.testing.assert_close(final_resumed[name], final_full[name], rtol=0, atol=0)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    checkpoints.save_checkpoint(path, {"iteration": 1})

    def dies_halfway(file, mode="r"):  # killed while writing the temporary file
        with open(file, mode) as handle:
            handle.write(b"half a checkpoint")
        raise Killed

    monkeypatch.setattr(folder, "open", dies_halfway, raising=False)
    with pytest.raises(Killed):
        checkpoints.save_checkpoint(path, {"iteration": 2})
    assert torch.load(path, weights_only=False) == {"iteration": 1}


@pytest.mark.parametrize(
    "policy",
    [[], ["--policy", "stepwise"], ["--policy", "stepwise", "--optimizer", "ppo"]],
    ids=["instance", "stepwise", "stepwise-ppo"],
)
def test_two_process_torchrun_first_update_equals_single_process(tmp_path, policy):
    """The same global batch on two ranks gives the same rewards and, for REINFORCE, the same
    averaged gradient. PPO's minibatches are drawn per rank, so its update differs; it must run."""
    args = ["--iterations", "1", "--contexts", "8", "--eval-contexts", "4", "--baseline", "js"]
    args += policy
    train.main(train.parse_config([*args, "--out-dir", str(tmp_path / "single")]))
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    double = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node=2",
            os.path.join(ROOT, "train.py"),
            *args,
            "--out-dir",
            "double",
        ],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert double.returncode == 0, double.stderr
    assert "2 rank(s), 4 contexts each" in double.stdout
    # The same global batch gives the same rewards and the same averaged gradient.
    assert read_metrics(tmp_path / "double")[0]["reward"] == pytest.approx(
        read_metrics(tmp_path / "single")[0]["reward"], rel=1e-6
    )
    if "ppo" in policy:
        assert read_metrics(tmp_path / "double")[0]["grad_norm"] > 0
        return
    one = torch.load(tmp_path / "single" / "ckpt.pt", weights_only=False)["policy"]
    two = torch.load(tmp_path / "double" / "ckpt.pt", weights_only=False)["policy"]
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)
    # A non-zero gradient moved every parameter, so the comparison above is not between two no-ops.
    grad_norms = [read_metrics(tmp_path / name)[0]["grad_norm"] for name in ("single", "double")]
    assert grad_norms[0] > 0 and grad_norms[1] == pytest.approx(grad_norms[0], rel=1e-5)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--backbone", "sd4"),
        ("--reward", "beauty"),
        ("--baseline", "mean"),
        ("--init", "zeros"),
        ("--dtype", "fp8"),
        ("--policy", "local"),
    ],
)
def test_an_unknown_name_fails_in_one_line_with_the_choices(capsys, flag, value):
    with pytest.raises(SystemExit) as error:
        train.parse_config([flag, value])
    assert error.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        len(lines) == 1 and f"argument {flag}: invalid choice: '{value}' (choose from" in lines[0]
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--rollouts", "1"], "--rollouts must be at least 2 for a leave-one-out baseline"),
        (["--contexts", "2"], "--contexts must be at least 3 for --baseline js"),
        (
            ["--contexts", "3", "--baseline", "js-unbiased"],
            "--contexts must be at least 4 for --baseline js-unbiased",
        ),
        (["--iterations", "0"], "--iterations must be at least 1"),
        (["--iterations", "-5"], "--iterations must be at least 1"),
        (["--ckpt-interval", "0"], "--ckpt-interval must be at least 1"),
        (["--log-interval", "0"], "--log-interval must be at least 1"),
        (["--eval-contexts", "0"], "--eval-contexts must be at least 1"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--lr", "0"], "--lr must be a finite number > 0"),
        (["--grad-clip", "nan"], "--grad-clip must be a finite number > 0"),
        (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0"),
        (["--guidance", "nan"], "--guidance must be a finite number >= 0"),
        (["--guidance", "inf"], "--guidance must be a finite number >= 0"),
        (["--guidance", "2"], "--guidance 2.0: digits has no guidance input and runs no CFG"),
        (
            ["--backbone", "flux-schnell", "--guidance", "3.5"],
            "--guidance 3.5: flux-schnell has no guidance input",
        ),
        (["--resume"], "--resume but .*ckpt.pt does not exist"),
        (["--ppo-epochs", "0"], "--ppo-epochs must be at least 1"),
        (["--ppo-minibatches", "0"], "--ppo-minibatches must be at least 1"),
        (["--ppo-clip", "0"], "--ppo-clip must be a finite number > 0"),
        (["--concentration", "0"], "--concentration must be a finite number > 0"),
        (["--concentration", "nan"], "--concentration must be a finite number > 0"),
    ],
)
def test_bad_input_fails_in_one_line(tmp_path, args, message):
    config = train.parse_config([*args, "--out-dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=message) as error:
        train.check(config, world_size=1)
    assert "\n" not in str(error.value)


def test_contexts_must_split_over_ranks(tmp_path):
    config = train.parse_config(["--contexts", "9", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="not divisible by the 2 ranks"):
        train.check(config, world_size=2)


SHORT = ["--iterations", "3", "--contexts", "8", "--eval-contexts", "4", "--ckpt-interval", "2"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """A finished 3-iteration digits run, which the tests below damage or run again (as copies)."""
    out = tmp_path_factory.mktemp("short") / "out"
    train.main(train.parse_config([*SHORT, "--out-dir", str(out)]))
    return out


def copy_of(run, tmp_path):
    return shutil.copytree(run, tmp_path / "out")


def test_the_same_command_again_reports_the_finished_run_and_changes_nothing(
    short_run, tmp_path, capsys
):
    out = copy_of(short_run, tmp_path)
    before = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    train.main(train.parse_config([*SHORT, "--out-dir", str(out)]))
    printed = capsys.readouterr().out
    assert (
        f"{out} holds this run, finished at iteration 3" in printed
        and "| learned (mean) | 4 |" in printed
    )
    assert {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()} == before


def test_a_killed_run_continues_from_its_checkpoint_without_resume(short_run, tmp_path, capsys):
    out = copy_of(short_run, tmp_path)
    checkpoint = torch.load(out / "ckpt.pt", weights_only=True)
    torch.save(
        {**checkpoint, "iteration": 2}, out / "ckpt.pt"
    )  # as if killed after the checkpoint of iteration 2
    (out / "eval.json").unlink()
    train.main(train.parse_config([*SHORT, "--out-dir", str(out)]))
    assert f"continuing {out / 'ckpt.pt'} from iteration 2" in capsys.readouterr().out
    assert [row["iteration"] for row in read_metrics(out)] == [1, 2, 3] and (
        out / "eval.json"
    ).is_file()


def test_a_continuation_killed_before_its_report_is_not_finished(short_run, tmp_path, capsys):
    out = copy_of(short_run, tmp_path)
    report = json.loads((out / "eval.json").read_text())
    assert report["iteration"] == 3
    # the report of an earlier segment (iteration 2) beside the checkpoint of iteration 3
    (out / "eval.json").write_text(json.dumps({**report, "iteration": 2}))
    train.main(train.parse_config([*SHORT, "--out-dir", str(out)]))
    printed = capsys.readouterr().out
    assert "held-out evaluation" in printed and "finished at iteration" not in printed
    assert json.loads((out / "eval.json").read_text()) == report


def test_iterations_below_the_checkpoint_and_edited_prompts_are_refused(short_run, tmp_path):
    out = copy_of(short_run, tmp_path)
    with pytest.raises(SystemExit, match="holds iteration 3 of this run, past --iterations 2"):
        train.check(train.parse_config([*SHORT, "--iterations", "2", "--out-dir", str(out)]), 1)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a handwritten 3\na handwritten 7\n")
    checkpoint = torch.load(out / "ckpt.pt", weights_only=True)
    config = dict(checkpoint["config"], prompts=str(prompts))
    digest = train.prompts_digest(["a handwritten 3"], None)  # the file when the run began
    torch.save({**checkpoint, "config": config, "prompts_digest": digest}, out / "ckpt.pt")
    with pytest.raises(SystemExit, match="holds a run on other prompts: a prompt file changed"):
        train.check(
            train.parse_config([*SHORT, "--prompts", str(prompts), "--out-dir", str(out)]), 1
        )
    assert (out / "ckpt.pt").is_file()


def test_a_torn_last_metrics_line_is_dropped_on_resume(short_run, tmp_path, capsys):
    out = copy_of(short_run, tmp_path)
    checkpoint = torch.load(out / "ckpt.pt", weights_only=True)
    torch.save(
        {**checkpoint, "iteration": 2}, out / "ckpt.pt"
    )  # killed while appending the row of iteration 3
    text = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])
    (out / "eval.json").unlink()
    train.main(train.parse_config([*SHORT, "--out-dir", str(out)]))
    assert "dropped 1 torn line(s)" in capsys.readouterr().out
    assert [row["iteration"] for row in read_metrics(out)] == [1, 2, 3]


def test_a_second_writer_is_refused_naming_the_first_and_a_dead_one_blocks_nothing(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys, time; sys.path.insert(0, {ROOT!r}); from store import files as folder; "
            f"lock = folder.lock_run({str(out)!r}); "
            "print('locked', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            SystemExit, match=f"is in use by another run \\(PID {holder.pid}\\); wait for it to end"
        ) as error:
            train.main(train.parse_config([*SHORT, "--out-dir", str(out)]))
        assert "\n" not in str(error.value) and not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    train.main(
        train.parse_config([*SHORT, "--out-dir", str(out)])
    )  # the killed holder's lock went with it
    assert [row["iteration"] for row in read_metrics(out)] == [1, 2, 3]


def test_a_run_that_failed_before_its_first_checkpoint_is_never_mixed_with_the_next(
    tmp_path, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "written-by.json").write_text('{"program": "train.py"}')  # train.py took it
    (out / "metrics.jsonl").write_text(
        '{"iteration": 1, "reward": 0.5}\n{"iteration": 2, "rew'
    )  # a torn row too
    train.main(train.parse_config([*SHORT, "--seed", "3", "--out-dir", str(out)]))
    assert (
        "held 1 row(s) of a run that stopped before its first checkpoint" in capsys.readouterr().out
    )
    assert [row["iteration"] for row in read_metrics(out)] == [1, 2, 3]
    assert (out / "metrics.jsonl.failed").read_text().startswith('{"iteration": 1, "reward": 0.5}')


@pytest.mark.parametrize(
    "make, args, message",
    [
        (
            lambda tmp: (tmp / "file").write_text("x"),
            ["--out-dir", "{tmp}/file"],
            "--out-dir .*/file is a file, not a folder",
        ),
        (
            lambda tmp: (tmp / "file").write_text("x"),
            ["--out-dir", "{tmp}/file/run"],
            "is not writable here",
        ),
        (
            lambda tmp: None,
            ["--device", "cuda"],
            "--device cuda, but this machine has no CUDA device",
        ),
    ],
)
def test_unusable_places_and_devices_fail_in_one_line_before_loading(tmp_path, make, args, message):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    make(tmp_path)
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    with pytest.raises(SystemExit, match=message) as error:
        train.check(
            train.parse_config([*SHORT, "--out-dir", str(tmp_path / "out"), *args]), world_size=1
        )
    assert "\n" not in str(error.value)


def test_threads_above_the_core_count_are_capped(tmp_path, capsys):
    config = train.parse_config([*SHORT, "--threads", "1000", "--out-dir", str(tmp_path / "out")])
    train.check(config, world_size=1)
    assert config.threads == os.cpu_count() and "is more than the" in capsys.readouterr().out


@pytest.mark.parametrize(
    "change, message",
    [
        (
            ["--baseline", "rloo"],
            "holds a run with baseline='js', not 'rloo'; pass another --out-dir for this run "
            r"\(or --baseline js to continue that one\)",
        ),
        (["--seed", "1"], "holds a run with seed=0, not 1"),
        (["--steps", "8"], "holds a run with steps=4, not 8"),
        (["--eval-contexts", "9"], "holds a run with eval_contexts=4, not 9"),
        (  # a flag the run was started without: dropping it continues the run
            ["--reward-checkpoint", "elsewhere"],
            r"holds a run with reward_checkpoint=None, not 'elsewhere'; .*\(or drop "
            "--reward-checkpoint to",
        ),
    ],
)
def test_a_run_folder_of_another_run_is_refused(short_run, tmp_path, change, message):
    out = copy_of(short_run, tmp_path)
    with pytest.raises(SystemExit, match=message) as error:
        train.check(
            train.parse_config([*SHORT, *change, "--out-dir", str(out), "--resume"]), world_size=1
        )
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda out: (out / "ckpt.pt").write_bytes(b""), "is not a readable checkpoint"),
        (
            lambda out: (out / "ckpt.pt").write_bytes((out / "ckpt.pt").read_bytes()[:3000]),
            "is not a readable checkpoint",
        ),
        (
            lambda out: (out / "ckpt.pt").write_bytes(b"garbage" * 100),
            "is not a readable checkpoint",
        ),
        (
            lambda out: torch.save({"weights": torch.zeros(2)}, out / "ckpt.pt"),
            "is not a checkpoint written by train.py",
        ),
        (lambda out: (out / "metrics.jsonl").unlink(), "has no metrics.jsonl beside it"),
    ],
)
def test_a_damaged_run_folder_fails_in_one_line_and_keeps_its_files(
    short_run, tmp_path, damage, message
):
    out = copy_of(short_run, tmp_path)
    damage(out)
    before = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    with pytest.raises(SystemExit, match=message) as error:
        train.main(train.parse_config([*SHORT, "--out-dir", str(out), "--resume"]))
    assert "\n" not in str(error.value)
    assert {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()} == before


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "prompts.json",
            b'[{"text": "a handwritten 3"}]',
            "1 entries are neither a prompt nor a record",
        ),
        ("prompts.json", b'{"a handwritten 3": 1}', "holds a JSON dict, not a list"),
        (
            "prompts.json",
            b'[{"prompt": "a handwritten 3"',
            "is not a prompt file \\(JSONDecodeError",
        ),
        (
            "prompts.txt",
            b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
            "is not a prompt file \\(UnicodeDecodeError",
        ),
        ("prompts.txt", b"\n\n", "holds no prompts"),
    ],
)
def test_a_bad_prompt_file_fails_in_one_line_naming_it(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(SystemExit, match=message) as error:
        train.check(
            train.parse_config(["--prompts", str(path), "--out-dir", str(tmp_path / "out")]),
            world_size=1,
        )
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_prompt_the_backbone_cannot_take_fails_before_training(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a handwritten 3\na red fox\n")
    with pytest.raises(
        SystemExit,
        match="digits knows only the prompts 'a handwritten 0' .. 'a handwritten 9', "
        "got 'a red fox'",
    ):
        train.main(
            train.parse_config(
                [*SHORT, "--prompts", str(prompts), "--out-dir", str(tmp_path / "out")]
            )
        )
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_non_finite_reward_stops_in_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    real_load_reward = rewards.load_reward

    def load_broken_reward(*args, **kwargs):
        reward, calls = real_load_reward(*args, **kwargs), []

        def broken(latents, prompts, *rest):
            calls.append(len(prompts) == 16)  # training batches only
            scores = reward(latents, prompts, *rest)
            return torch.full_like(scores, float("nan")) if sum(calls) == 3 else scores

        return broken

    monkeypatch.setattr(rewards, "load_reward", load_broken_reward)
    with pytest.raises(
        SystemExit,
        match="iteration 3: 16 rewards are NaN or inf.*ckpt.pt holds the last good state",
    ) as error:
        train.main(train.parse_config([*SHORT, "--out-dir", str(tmp_path / "out")]))
    assert "\n" not in str(error.value)
    assert torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)["iteration"] == 2


def test_a_non_finite_reward_before_any_update_is_blamed_on_the_models(tmp_path, monkeypatch):
    def load_broken_reward(*args, **kwargs):
        return lambda latents, *rest: torch.full((latents.shape[0],), float("nan"))

    monkeypatch.setattr(rewards, "load_reward", load_broken_reward)
    with pytest.raises(SystemExit) as error:
        train.main(train.parse_config([*SHORT, "--out-dir", str(tmp_path / "out")]))
    assert str(error.value).startswith("error: iteration 1: 16 rewards are NaN or inf: before any ")
    assert "--lr" not in str(error.value) and "no checkpoint was written yet" in str(error.value)


def test_help_describes_every_flag_with_its_default_and_choices(capsys):
    with pytest.raises(SystemExit):
        train.parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    fields = train.dataclasses.fields(train.Config) + train.dataclasses.fields(train.tpdm.Settings)
    for field in fields:
        assert (
            f"--{field.name.replace('_', '-')}" in text
            and " ".join(field.metadata["help"].split()) in text
        ), field.name
    real = "sd35m,sd35l,sdxl,flux-dev,flux-schnell"
    small = "digits,digits-prompt,digits-noise,digits-xor,mini-sd3,mini-flux,mini-sdxl"
    assert "{" + real + "," + small + ",mini-flux-schnell}" in text
    # every default is shown, and none is "None"
    assert "AdamW weight decay (default: 0.0001)" in text and "(default: None)" not in text


def test_threads_one_for_the_embedded_backbones(tmp_path):
    def threads(*args):
        return train.parse_config([*args, "--out-dir", str(tmp_path / "out")]).threads

    assert (
        threads() == 1
        and threads("--backbone", "digits-noise") == 1
        and threads("--threads", "2") == 2
    )
    assert threads("--backbone", "sd35m", "--device", "cpu") is None


def test_the_names_train_offers_are_the_registries():
    """Every backbone has its training row; the other choices are the registries' own keys."""
    import backbones

    assert train.CHOICES["backbone"] == list(backbones.BACKBONES) == list(train.PRESETS)


@pytest.mark.parametrize(
    "command",
    [
        ["train.py"],
        ["evaluate.py"],
        ["sample.py"],
        ["toy_js.py"],
        ["-m", "evidence.ablation"],
        ["-m", "evidence.baseline_study"],
        ["-m", "evidence.comparator_study"],
        ["-m", "evidence.bench"],
        ["-m", "evidence.miniatures"],
        ["-m", "miniatures.build"],
    ],
)
def test_every_command_answers_help(command):
    """Each entry script and evidence command, as README and docs write it, answers --help."""
    result = SCRIPTS.run([*command, "--help"], ROOT)
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr


def test_no_arguments_is_the_digits_main_job():
    config = train.parse_config([])
    assert (config.backbone, config.reward, config.steps, config.baseline) == (
        "digits",
        "teacher",
        4,
        "js",
    )
    assert (config.contexts, config.rollouts, config.policy) == (32, 2, "instance")


def test_paper_batch_sizes_for_the_real_backbones(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox in snow\n")
    sizes = {
        name: train.parse_config(["--backbone", name, "--prompts", str(prompts)])
        for name in ("sd35m", "sdxl", "sd35l", "flux-dev")
    }
    assert {name: (c.contexts, c.rollouts, c.reward) for name, c in sizes.items()} == {
        "sd35m": (32, 2, "hpsv2"),
        "sdxl": (32, 2, "hpsv2"),
        "sd35l": (16, 2, "hpsv2"),
        "flux-dev": (16, 2, "hpsv2"),
    }
    assert all(c.weight_decay == 1e-4 and c.grad_clip == 1.0 for c in sizes.values())


@pytest.mark.parametrize("backbone", ["sd35m", "sdxl", "flux-dev"])
def test_trains_a_real_backbone_family_from_a_local_folder(tiny_runs, backbone):
    """The real-backbone path end to end: from_pretrained on a saved tiny random pipeline, rollouts
    with CFG (or Flux's guidance embedding), the teacher reward, updates and the held-out table."""
    out = tiny_runs[0][backbone]
    rows = read_metrics(out)
    assert [row["iteration"] for row in rows] == [1, 2] and all(
        row["grad_norm"] > 0 for row in rows
    )
    checkpoint = torch.load(out / "ckpt.pt", weights_only=False)
    assert (
        checkpoint["config"]["backbone"] == backbone and checkpoint["policy_config"]["steps"] == 2
    )
    methods = {row["method"]: row for row in json.loads((out / "eval.json").read_text())["rows"]}
    assert methods["limit (teacher)"]["mean"] == 0.0 and methods["default"]["mean"] < 0.0


@pytest.mark.parametrize("backbone", ["sd35m", "sdxl", "flux-dev"])
def test_the_stepwise_policy_trains_with_ppo_on_each_family(tiny_stepwise_runs, backbone):
    """TPDM's comparator on the real-backbone path: the policy picks the times inside the loop (in
    rollout parts of 3 samples), PPO updates, the held-out table with its schedules."""
    out = tiny_stepwise_runs[backbone]
    rows = read_metrics(out)
    assert [row["iteration"] for row in rows] == [1, 2]
    assert all(row["grad_norm"] > 0 and 0 <= row["clip_fraction"] <= 1 for row in rows)
    checkpoint = torch.load(out / "ckpt.pt", weights_only=False)
    assert checkpoint["policy_config"]["kind"] == "stepwise"
    methods = {row["method"] for row in json.loads((out / "eval.json").read_text())["rows"]}
    assert {"default", "learned (mean)", "learned (sampled)"} <= methods
    assert (out / "train.png").is_file() and (out / "policy" / "config.json").is_file()


def test_headline_command_ends_in_one_line_naming_the_weights(tmp_path):
    """`python train.py --backbone sd35m --steps 10` offline: past configuration and the shipped
    prompts, then one line naming the missing weights and how to get them, in seconds; on a CPU
    machine only with --device cpu."""
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as refused:
            train.check(
                train.parse_config(
                    ["--backbone", "sd35m", "--steps", "10", "--out-dir", str(tmp_path / "out")]
                ),
                world_size=1,
            )
        assert str(refused.value) == (
            "error: sd35m on a CPU takes hours per update; run on a CUDA machine, "
            "or pass --device cpu to insist (or try --backbone digits)"
        )
    started = time.perf_counter()
    result = run_script(
        "train.py", ["--backbone", "sd35m", "--steps", "10", "--device", "cpu"], tmp_path
    )
    assert time.perf_counter() - started < 30
    assert result.returncode != 0
    assert (
        "one update: B x K x L = 32 x 2 x 10 = 640 model evaluations (each a CFG pair), "
        "64 reward calls" in result.stdout
    )
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and "sd35m: the weights of stabilityai/stable-diffusion-3.5-medium are not available"
        in lines[0]
    )
    assert "hf auth login" in lines[0] and "licence" in lines[0] and "--model-path" in lines[0]
    assert (
        "HPS v2.1 checkpoint not found" in lines[0] or "hpsv2 reward needs" in lines[0]
    )  # every missing piece, one message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("reward", ["ocr", "geneval"])
def test_text_and_object_rewards_are_refused_on_the_embedded_backbones(tmp_path, reward):
    with pytest.raises(
        SystemExit,
        match=f"the {reward} reward reads text or objects, which the 8x8 digits images do not have",
    ):
        train.check(
            train.parse_config(["--reward", reward, "--out-dir", str(tmp_path / "out")]),
            world_size=1,
        )


@pytest.mark.parametrize(
    "reward, train_file, heldout_file",
    [
        ("ocr", "prompts/ocr_train.jsonl", "prompts/ocr_heldout.jsonl"),
        ("geneval", "prompts/geneval_train.jsonl", "prompts/geneval_heldout.jsonl"),
        ("hpsv2", "prompts/train.jsonl", "prompts/heldout.jsonl"),
    ],
)
def test_each_reward_trains_on_its_shipped_prompts(tmp_path, reward, train_file, heldout_file):
    config = train.parse_config(
        [
            "--backbone",
            "sd35m",
            "--reward",
            reward,
            "--device",
            "cpu",
            "--out-dir",
            str(tmp_path / "out"),
        ]
    )
    assert (config.prompts, config.eval_prompts) == (train_file, heldout_file)
    prompts = train.load_prompt_file(config.prompts)
    train.reward_lib.check_prompts(reward, prompts)  # every one is a prompt the reward can score
    assert len(prompts) >= 200


@pytest.mark.parametrize(
    "reward, message",
    [
        (
            "ocr",
            "OCR prompts need exactly one non-empty \"quoted\" target text: 'a red fox in snow'",
        ),
        ("geneval", "not a GenEval prompt .*'a red fox in snow'"),
    ],
)
def test_a_prompt_the_reward_cannot_score_fails_in_one_line(tmp_path, reward, message):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox in snow\n")
    config = train.parse_config(
        [
            "--backbone",
            "sd35m",
            "--reward",
            reward,
            "--device",
            "cpu",
            "--prompts",
            str(prompts),
            "--out-dir",
            str(tmp_path / "out"),
        ]
    )
    with pytest.raises(SystemExit, match=message) as error:
        train.check(config, world_size=1)
    assert "\n" not in str(error.value)


@pytest.mark.skipif(
    importlib.util.find_spec("easyocr") is not None, reason="the optional environment has easyocr"
)
def test_the_ocr_reward_without_its_environment_names_the_install_command(tmp_path, tiny_runs):
    with pytest.raises(
        SystemExit, match=r"the ocr reward needs easyocr .*: bash tests/hps_env.sh"
    ) as error:
        train.main(
            train.parse_config(
                [
                    "--backbone",
                    "sd35m",
                    "--model-path",
                    str(tiny_runs[1] / "sd3"),
                    "--reward",
                    "ocr",
                    "--device",
                    "cpu",
                    "--out-dir",
                    str(tmp_path / "out"),
                ]
            )
        )
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("backbone", ["digits-prompt", "digits-noise"])
def test_the_context_dependent_embedded_backbones_train_end_to_end(tmp_path, backbone):
    out = tmp_path / "out"
    train.main(
        train.parse_config(
            [
                "--backbone",
                backbone,
                "--iterations",
                "2",
                "--contexts",
                "4",
                "--eval-contexts",
                "8",
                "--out-dir",
                str(out),
            ]
        )
    )
    assert [row["iteration"] for row in read_metrics(out)] == [1, 2]
    checkpoint = torch.load(out / "ckpt.pt", weights_only=True)
    assert checkpoint["config"]["rollouts"] == 8  # these backbones' own default K
    assert (out / "eval.json").is_file() and (out / "policy" / "model.safetensors").is_file()


def test_hpdv2_prompts_offline_say_how_to_get_them(tmp_path):
    config = train.parse_config(
        ["--backbone", "sd35m", "--prompts", "hpdv2", "--device", "cpu", "--out-dir", str(tmp_path)]
    )
    started = time.perf_counter()
    with pytest.raises(
        SystemExit,
        match=r"HPDv2's train.json is not available: fetch it once online with "
        r"`hf download zhwang/HPDv2 train.json --repo-type dataset`",
    ) as error:
        train.check(config, world_size=1)
    assert time.perf_counter() - started < 5 and "\n" not in str(error.value)


def test_ppo_defaults_to_a_smaller_learning_rate_and_an_explicit_one_is_kept():
    reinforce = train.parse_config(["--policy", "stepwise"])
    ppo = train.parse_config(["--policy", "stepwise", "--optimizer", "ppo"])
    assert ppo.lr == pytest.approx(reinforce.lr * ppo_settings.LR_FACTOR)
    explicit = train.parse_config(["--policy", "stepwise", "--optimizer", "ppo", "--lr", "0.01"])
    assert explicit.lr == 0.01


def test_ppo_defaults_are_tpdms_settings_and_reinforce_keeps_the_projects():
    """TPDM's code: TRL's 4 epochs x 1 minibatch, clip 0.2, RLOO advantages, Adam(0.9, 0.99),
    eps 1e-5, no weight decay, a constant rate, head bias (2.5, 1.0), hidden-state inputs on the
    diffusers families, the Beta mode at inference; each overridable."""
    ppo = train.parse_config(
        ["--backbone", "mini-sd3", "--policy", "stepwise", "--optimizer", "ppo"]
    )
    assert (ppo.tpdm.ppo_epochs, ppo.tpdm.ppo_minibatches, ppo.tpdm.ppo_clip, ppo.grad_clip) == (
        4,
        1,
        0.2,
        1.0,
    )
    assert (ppo.baseline, ppo.weight_decay, ppo.lr_decay) == ("rloo", 0.0, "constant")
    assert (ppo.adam_beta2, ppo.adam_eps) == (0.99, 1e-5)
    assert (ppo.init, ppo.tpdm.policy_inputs, ppo.tpdm.inference) == ("tpdm", "hidden", "mode")
    embedded = train.parse_config(["--policy", "stepwise", "--optimizer", "ppo"])
    assert embedded.tpdm.policy_inputs == "sampler"  # the mixtures have no hidden states
    reinforce = train.parse_config(["--backbone", "mini-sd3", "--policy", "stepwise"])
    assert (reinforce.baseline, reinforce.weight_decay, reinforce.lr_decay) == (
        "js",
        1e-4,
        "cosine",
    )
    assert (reinforce.init, reinforce.tpdm.policy_inputs, reinforce.tpdm.inference) == (
        "default",
        "sampler",
        "mean",
    )
    instance = train.parse_config(["--optimizer", "ppo"])  # TPDM's optimiser, the policy's start
    assert (instance.init, instance.baseline, instance.adam_eps) == ("default", "rloo", 1e-5)
    project = train.parse_config(
        ["--policy", "stepwise", "--optimizer", "ppo", "--baseline", "js", "--init", "default"]
    )
    assert (project.baseline, project.init) == ("js", "default")
    for args, message in (
        (["--init", "tpdm"], "--init tpdm is the step-wise policy's, not the instance policy's"),
        (["--policy", "stepwise", "--policy-inputs", "hidden"], "digits is an exact mixture"),
    ):
        with pytest.raises(SystemExit, match=message):
            train.check(train.parse_config(args), world_size=1)
