"""train.py end to end: what it writes, its kept guarantees (exact resume after a kill, the atomic
checkpoint, a changed setting refused, a user's folder left alone, the door, non-finite rewards),
torchrun, and the real-backbone path on tiny pipelines."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ENV, ROOT, SCRIPTS, run_script

import rewards
import train
from comparator import tpdm


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as file:
        return [json.loads(line) for line in file]


def run(out_dir, *args):
    return train.main(train.parse_config([*args, "--out-dir", str(out_dir)]))


def test_a_run_writes_checkpoint_metrics_report_and_policy(digits_run):
    rows = read_metrics(digits_run)
    assert [row["iteration"] for row in rows] == list(range(1, 61))
    assert all(row["reward"] < 0 for row in rows)  # teacher fidelity is a negative error
    checkpoint = torch.load(digits_run / "ckpt.pt", weights_only=True)
    assert checkpoint["iteration"] == 60 and checkpoint["policy_config"]["steps"] == 4
    assert checkpoint["config"]["backbone"] == "digits" and checkpoint["metrics"] == rows
    evaluation = json.loads((digits_run / "eval.json").read_text())
    methods = ["default", "learned (mean)", "limit (teacher)"]
    assert [row["method"] for row in evaluation["rows"]] == methods
    assert evaluation["contexts"] == 128 and evaluation["iteration"] == 60
    assert evaluation["rows"][-1]["mean"] == 0.0  # the teacher's own output has no error
    assert sorted(os.listdir(digits_run)) == ["ckpt.pt", "eval.json", "metrics.jsonl", "policy"]


def test_learned_schedule_beats_the_default_on_heldout_contexts(digits_run):
    rows = {
        row["method"]: row for row in json.loads((digits_run / "eval.json").read_text())["rows"]
    }
    learned = rows["learned (mean)"]
    # Paired over the same 128 held-out noises: the improvement must exceed 3.3 of its standard
    # errors (one-sided p < 0.0005). The half-width is a Student-t 95% one (127 dof: 1.979 sem).
    assert learned["diff_mean"] > 3.3 * learned["diff_ci95"] / 1.979
    assert learned["mean"] > rows["default"]["mean"]


# -----------------------------------------------------------------------------
# exact resume: a kill at a moment the test chooses, then the same command


class Killed(Exception):
    pass


SHORT = ["--iterations", "7", "--ckpt-interval", "3", "--eval-contexts", "4", "--contexts", "8"]
FINISHED = ["eval.json", "metrics.jsonl", "policy/config.json", "policy/model.safetensors"]


def outputs(out_dir):
    """What a run leaves: its metrics rows (timing aside), eval.json and the policy's weights."""
    timing = {"rollout_s", "step_s"}
    rows = [{k: v for k, v in row.items() if k not in timing} for row in read_metrics(out_dir)]
    weights = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)["policy"]
    return rows, json.loads((out_dir / "eval.json").read_text()), weights


def assert_same(resumed, full):
    rows, report, weights = outputs(resumed)
    full_rows, full_report, full_weights = outputs(full)
    assert rows == full_rows and report == full_report
    for name in full_weights:
        torch.testing.assert_close(weights[name], full_weights[name], rtol=0, atol=0)


def dying_reward(at_call, fault=None):
    """rewards.load_reward whose training call at_call (8 contexts x 2 rollouts) raises Killed, or
    returns fault(its scores)."""
    real_load_reward = rewards.load_reward

    def load(*args, **kwargs):
        reward, calls = real_load_reward(*args, **kwargs), []

        def dying(latents, prompts, *rest):
            calls.append(len(prompts) == 16)  # a training batch, not the held-out curve
            if sum(calls) == at_call and fault is None:
                raise Killed
            scores = reward(latents, prompts, *rest)
            return fault(scores) if sum(calls) == at_call else scores

        return dying

    return load


@pytest.mark.parametrize(
    "policy",
    [[], ["--policy", "stepwise"], ["--policy", "stepwise", "--optimizer", "ppo"]],
    ids=["instance", "stepwise", "stepwise-ppo"],
)
def test_a_run_killed_in_its_loop_continues_to_the_same_numbers(tmp_path, monkeypatch, policy):
    run(tmp_path / "full", *SHORT, *policy)
    monkeypatch.setattr(rewards, "load_reward", dying_reward(at_call=6))
    killed = tmp_path / "killed"
    with pytest.raises(Killed):  # in iteration 6: ckpt.pt holds 3, metrics.jsonl rows 1-5
        run(killed, *SHORT, *policy)
    assert torch.load(killed / "ckpt.pt", weights_only=True)["iteration"] == 3
    assert len(read_metrics(killed)) == 5
    monkeypatch.undo()
    run(killed, *SHORT, *policy)  # the same command, no flag
    assert [row["iteration"] for row in read_metrics(killed)] == list(range(1, 8))
    assert_same(killed, tmp_path / "full")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "out"
    run(out, *SHORT)
    return out


def test_a_kill_while_the_checkpoint_is_written_keeps_the_last_one(tmp_path, monkeypatch, full_run):
    real_save, saves = torch.save, []

    def dying_save(state, path, *args, **kwargs):  # the third (iteration 6) dies half written
        saves.append(path)
        if len(saves) == 3:
            with open(path, "wb") as file:
                file.write(b"half a checkpoint")
            raise Killed
        return real_save(state, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dying_save)
    killed = tmp_path / "killed"
    with pytest.raises(Killed):
        run(killed, *SHORT)
    assert saves[2] == str(killed / "ckpt.pt.tmp")  # a temporary file, then os.replace
    assert torch.load(killed / "ckpt.pt", weights_only=True)["iteration"] == 3
    monkeypatch.undo()
    run(killed, *SHORT)
    assert_same(killed, full_run)
    assert not (killed / "ckpt.pt.tmp").exists()


def test_a_full_disk_while_the_policy_is_saved_leaves_the_saved_one(
    tmp_path, monkeypatch, full_run
):
    out = shutil.copytree(full_run, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (out / "policy").iterdir()}

    def full_disk(folder, *args):  # a first file written, then no space left
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, "model.safetensors"), "wb").close()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(train, "save_policy", full_disk)
    with pytest.raises(OSError, match="No space left"):
        run(out, *SHORT)  # a finished run: straight to the policy and the report
    assert {p.name: p.read_bytes() for p in (out / "policy").iterdir()} == before


def test_a_kill_during_the_final_report_then_the_same_command_writes_it(
    tmp_path, monkeypatch, full_run
):
    def dying_report(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(train, "heldout_report", dying_report)
    killed = tmp_path / "killed"
    with pytest.raises(Killed):
        run(killed, *SHORT)
    assert not (killed / "eval.json").exists()
    monkeypatch.undo()
    run(killed, *SHORT)  # the loop is empty: straight to the report
    assert_same(killed, full_run)
    run(killed, *SHORT)  # a finished run again: the same numbers rewritten
    assert_same(killed, full_run)


def test_more_iterations_continue_a_finished_run_and_how_it_runs_may_change(tmp_path, full_run):
    out = shutil.copytree(full_run, tmp_path / "out")
    how = ["--rollout-batch", "5", "--eval-contexts", "5", "--log-interval", "2", "--threads", "2"]
    run(out, *SHORT[2:], *how, "--iterations", "9")
    assert [row["iteration"] for row in read_metrics(out)] == list(range(1, 10))
    assert read_metrics(out)[:7] == read_metrics(full_run)


# -----------------------------------------------------------------------------
# a changed setting, a user's folder


@pytest.mark.parametrize(
    "change, keys",
    [(["--lr", "0.01"], "lr"), (["--baseline", "rloo", "--seed", "1"], "baseline, seed")],
)
def test_a_changed_setting_is_refused_on_resume_naming_it(tmp_path, full_run, change, keys):
    out = shutil.copytree(full_run, tmp_path / "out")
    before = {name: (out / name).stat().st_mtime_ns for name in os.listdir(out)}
    config = train.parse_config([*SHORT, *change, "--out-dir", str(out)])
    with pytest.raises(SystemExit, match=f"is a run with other {keys}; pass another") as error:
        train.check(config, world_size=1)
    assert "\n" not in str(error.value)
    assert {name: (out / name).stat().st_mtime_ns for name in os.listdir(out)} == before


@pytest.mark.parametrize(
    "mine",
    [["notes.txt"], ["eval.json"], ["metrics.jsonl"], ["policy/config.json"], FINISHED],
    ids=["notes", "eval", "metrics", "policy", "finished-run-without-ckpt"],
)
def test_a_fresh_run_starts_only_in_an_empty_folder(tmp_path, mine):
    """A folder holding anything but ckpt.pt's own temporary, without a ckpt.pt to continue, is
    refused in one line and left byte for byte as it was (a finished run whose ckpt.pt was deleted
    included)."""
    out = tmp_path / "mine"
    for name in mine:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(f"my {name}")
    with pytest.raises(SystemExit, match="holds files but no ckpt.pt to continue") as error:
        run(out, *SHORT)
    assert "\n" not in str(error.value)
    assert {str(p.relative_to(out)): p.read_text() for p in out.rglob("*") if p.is_file()} == {
        name: f"my {name}" for name in mine
    }


def test_a_resume_compares_prompt_files_by_content(tmp_path, monkeypatch):
    """The same prompts under another spelling continue; an edited file is refused."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"a handwritten {digit}\n" for digit in range(10)))
    first = tmp_path / "first"
    run(first, *SHORT, "--iterations", "1", "--prompts", str(prompts))
    monkeypatch.chdir(tmp_path)
    run(first, *SHORT, "--iterations", "2", "--prompts", "./prompts.txt")  # continued
    prompts.write_text("a handwritten 3\n")
    config = train.parse_config([*SHORT, "--prompts", str(prompts), "--out-dir", str(first)])
    with pytest.raises(SystemExit, match="a run with other prompt file contents"):
        train.check(config, world_size=1)


def test_ctrl_c_ends_in_one_line_and_the_same_command_continues(tmp_path, full_run):
    """Ctrl-C before the first update: the checkpoint written before the first iteration makes
    the run one that the same command continues to the uninterrupted run's files."""
    fault = """
import rewards
real = rewards.load_reward
def load(*args, **kwargs):
    reward = real(*args, **kwargs)
    def interrupted(latents, prompts, *rest):
        if len(prompts) == 16:  # the first training batch
            raise KeyboardInterrupt
        return reward(latents, prompts, *rest)
    return interrupted
rewards.load_reward = load
"""
    args = [*SHORT, "--out-dir", "out"]
    stopped = SCRIPTS.run(["train.py", *args], tmp_path, fault)
    assert stopped.returncode == 1 and stopped.stderr.splitlines() == [
        "error: interrupted; the same command continues from the last checkpoint"
    ]
    assert torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)["iteration"] == 0
    assert run_script("train.py", args, tmp_path).returncode == 0
    assert_same(tmp_path / "out", full_run)


# -----------------------------------------------------------------------------
# the door: one line each, before anything heavy loads


SCORED, UNSCORED = ["--reward"], ["--prompts", "prompts/digit_train.txt"]  # no text, no objects


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--rollouts", "1"], "--rollouts must be at least 2"),
        (["--contexts", "2"], "--contexts must be at least 3"),
        (["--contexts", "3", "--baseline", "js-unbiased"], "--contexts must be at least 4"),
        (["--iterations", "0"], "--iterations must be at least 1"),
        (["--eval-contexts", "0"], "--eval-contexts must be at least 1"),
        (["--ppo-epochs", "0"], "--ppo-epochs must be at least 1"),
        (["--seed", "-1"], "--seed must be at least 0"),
        (["--seed", str(2**27)], "--seed must be below 2\\^27"),
        (["--lr", "0"], "--lr, --concentration, --grad-clip, --adam-eps: > 0"),
        (["--concentration", "nan"], "--concentration must be a finite number"),
        (["--lr", "inf"], "--lr must be a finite number"),
        (["--guidance", "nan"], "--guidance must be a finite number"),
        (["--threads", "-1"], "--threads must be at least 0"),
        (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
        (["--adam-beta2", "1"], "--adam-beta2 must be in \\[0, 1\\)"),
        (["--guidance", "2"], "digits runs no --guidance"),
        (["--resolution", "8"], "digits draws one size: drop --resolution"),
        (["--reward", "ocr"], "digits: no text in 8x8 digits"),
        (["--reward", "preference"], "the preference reward reads the 16x16 handwritten digits"),
        (["--init", "tpdm"], "need --policy stepwise"),
        (["--policy", "stepwise", "--policy-inputs", "hidden"], "no --policy-inputs hidden"),
        (["--backbone", "sd35m"], "sd35m on a CPU takes hours per update"),
        (["--prompts", "no/such/file.txt"], "no/such/file.txt"),
        (["--contexts", "9"], "--contexts is not divisible by the 2 ranks"),
        (["--backbone", "sd35m", "--device", "cpu", *SCORED, "ocr", *UNSCORED], "quoted"),
        (["--backbone", "sd35m", "--device", "cpu", *SCORED, "geneval", *UNSCORED], "GenEval"),
    ],
)
def test_bad_input_fails_in_one_line(tmp_path, args, message):
    if args == ["--backbone", "sd35m"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    config = train.parse_config([*args, "--out-dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=message) as error:
        train.check(config, world_size=2)  # as under torchrun with 2 ranks
    assert str(error.value).startswith("error: ") and "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


DAMAGED = dict(
    truncated=lambda path: path.write_bytes(path.read_bytes()[:200]),
    empty=lambda path: path.write_bytes(b""),
    other=lambda path: torch.save({"weights": torch.zeros(1)}, path),
    folder=lambda path: (path.unlink(), path.mkdir()),
)


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_run_folder_ends_in_one_line_and_stays_as_it_was(tmp_path, full_run, damage):
    out = shutil.copytree(full_run, tmp_path / "out")
    DAMAGED[damage](out / "ckpt.pt")
    before = {str(p): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit, match="is not a checkpoint of train.py") as error:
        run(out, *SHORT)
    assert "\n" not in str(error.value)
    assert {str(p): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--out-dir", ""], "a folder"),
        (["--out-dir", "README.md"], "a folder"),
        (["--out-dir", "read-only/out"], "read-only is not a folder that can be written"),
        (["--out-dir", "out", "--prompts", "bad.jsonl"], "bad.jsonl: record 1"),
    ],
)
def test_an_unusable_out_dir_or_prompt_file_ends_in_one_line(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("mine")
    (tmp_path / "read-only").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"text": "a handwritten 3"}\n')
    # a read-only folder as a user sees it (root may write anywhere)
    monkeypatch.setattr(os, "access", lambda path, mode: "read-only" not in str(path))
    with pytest.raises(SystemExit, match=message) as error:
        train.check(train.parse_config(args), world_size=1)
    assert "\n" not in str(error.value)
    assert sorted(os.listdir(tmp_path)) == ["README.md", "bad.jsonl", "read-only"]


def test_a_terminal_without_unicode_gets_the_whole_run(tmp_path):
    ascii_stdout = "import sys; sys.stdout = open(1, 'w', encoding='ascii', closefd=False)"
    args = [*SHORT, "--out-dir", "out"]
    assert SCRIPTS.run(["train.py", *args], tmp_path, ascii_stdout).returncode == 0
    assert (tmp_path / "out" / "eval.json").exists()


@pytest.mark.parametrize(
    "args",
    [["--device", "cuda"], ["--backbone", "sd35m", "--steps", "10", "--device", "cpu"]],
    ids=["cuda-without-cuda", "headline-offline"],
)
def test_a_command_that_cannot_run_here_ends_in_one_line(tmp_path, args):
    """--device cuda on a CPU machine at the door; the headline command offline ends with the hub's
    own message on the missing weights, made one line. Nothing is written."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = run_script("train.py", args, tmp_path)
    lines = result.stderr.strip().splitlines()  # above it, the library's own warnings if any
    assert result.returncode == 1 and lines[-1].startswith("error: "), lines
    assert ("--model-path" in lines[-1]) == ("sd35m" in args)  # the way out of a gated model
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_a_non_finite_reward_stops_in_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    not_a_number = dying_reward(5, lambda scores: torch.full_like(scores, float("nan")))
    monkeypatch.setattr(rewards, "load_reward", not_a_number)
    with pytest.raises(SystemExit, match="iteration 5: a reward is NaN or inf.*ckpt.pt") as error:
        run(tmp_path / "out", *SHORT)
    assert "\n" not in str(error.value)
    assert torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)["iteration"] == 3


def test_piped_into_head_a_run_ends_without_a_traceback(tmp_path):
    """`python train.py | head -2` ends as a shell command does (SIGPIPE), with no bar in a log."""
    args = "--iterations 30 --log-interval 1 --contexts 4 --eval-contexts 4 --out-dir out"
    command = f"{sys.executable} {os.path.join(ROOT, 'train.py')} {args} | head -2"
    result = subprocess.run(
        command, shell=True, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert len(result.stdout.splitlines()) == 2 and result.stderr == "", result.stderr


# -----------------------------------------------------------------------------
# configuration


def test_no_arguments_is_the_digits_main_job_and_the_real_backbones_take_the_papers_sizes():
    config = train.parse_config([])
    assert (config.backbone, config.reward, config.steps, config.baseline) == (
        "digits", "teacher", 4, "js"
    )  # fmt: skip
    assert (config.contexts, config.rollouts, config.policy) == (32, 2, "instance")
    assert config.out_dir == "out/digits-L4-instance-s0"
    papers = {"sd35m": 32, "sdxl": 32, "sd35l": 16, "flux-dev": 16}  # its "batch size", as B
    for name, contexts in papers.items():
        real = train.parse_config(["--backbone", name])
        assert (real.contexts, real.rollouts, real.reward) == (contexts, 2, "hpsv2")


@pytest.mark.parametrize(
    "reward, train_file, heldout_file",
    [
        ("ocr", "prompts/ocr_train.jsonl", "prompts/ocr_heldout.jsonl"),
        ("geneval", "prompts/geneval_train.jsonl", "prompts/geneval_heldout.jsonl"),
        ("hpsv2", "prompts/train.jsonl", "prompts/heldout.jsonl"),
    ],
)
def test_each_reward_trains_on_its_shipped_prompts(reward, train_file, heldout_file):
    config = train.parse_config(["--backbone", "sd35m", "--reward", reward])
    assert (config.prompts, config.eval_prompts) == (train_file, heldout_file)
    prompts = train.load_prompt_file(config.prompts)
    rewards.check_prompts(reward, prompts)  # every one is a prompt the reward can score
    assert len(prompts) >= 200


def test_ppo_defaults_are_tpdms_settings_and_reinforce_keeps_the_projects():
    """TPDM's code: TRL's 4 epochs x 1 minibatch, clip 0.2, RLOO advantages, Adam(0.9, 0.99),
    eps 1e-5, no weight decay, a constant rate, head bias (2.5, 1.0), hidden-state inputs on the
    diffusers families, the Beta mode at inference, a smaller rate; each overridable."""
    ppo = train.parse_config(
        ["--backbone", "mini-sd3", "--policy", "stepwise", "--optimizer", "ppo"]
    )
    reinforce = train.parse_config(["--backbone", "mini-sd3", "--policy", "stepwise"])
    assert (ppo.ppo_epochs, ppo.ppo_minibatches, ppo.ppo_clip) == (4, 1, 0.2)
    assert (ppo.baseline, ppo.weight_decay, ppo.lr_decay) == ("rloo", 0.0, "constant")
    assert (ppo.adam_beta2, ppo.adam_eps, ppo.lr) == (0.99, 1e-5, reinforce.lr * tpdm.LR_FACTOR)
    assert (ppo.init, ppo.policy_inputs, ppo.inference) == ("tpdm", "hidden", "mode")
    assert train.parse_config(["--policy", "stepwise", "--optimizer", "ppo"]).policy_inputs == (
        "sampler"  # the mixtures have no hidden states
    )
    assert (reinforce.baseline, reinforce.init, reinforce.policy_inputs) == (
        "js",
        "default",
        "sampler",
    )
    chosen = ["--policy", "stepwise", "--optimizer", "ppo", "--baseline", "js", "--lr", "0.01"]
    assert (train.parse_config(chosen).baseline, train.parse_config(chosen).lr) == ("js", 0.01)


COMMANDS = (
    "train.py evaluate.py sample.py toy_js.py miniatures.build evidence.bench evidence.ablation"
)
COMMANDS += " evidence.baseline_study evidence.comparator_study evidence.miniatures"


@pytest.mark.parametrize("command", COMMANDS.split())
def test_every_command_answers_help(command):
    script = [command] if command.endswith(".py") else ["-m", command]
    result = SCRIPTS.run([*script, "--help"], ROOT)
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr


# -----------------------------------------------------------------------------
# torchrun; the real backbones' path on tiny pipelines


@pytest.mark.parametrize(
    "policy",
    [[], ["--policy", "stepwise"], ["--policy", "stepwise", "--optimizer", "ppo"]],
    ids=["instance", "stepwise", "stepwise-ppo"],
)
def test_two_process_torchrun_first_update_equals_single_process(tmp_path, policy):
    """The same global batch on two ranks gives the same rewards and, for REINFORCE, the same
    averaged gradient. PPO's minibatches are drawn per rank, so its update differs; it must run."""
    args = ["--iterations", "1", "--contexts", "8", "--eval-contexts", "4", *policy]
    run(tmp_path / "single", *args)
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--standalone", "--nproc_per_node=2", os.path.join(ROOT, "train.py")]
    double = subprocess.run(
        [*command, *args, "--out-dir", "double"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert double.returncode == 0, double.stderr
    assert "2 rank(s), 4 contexts each" in double.stdout
    names = ("single", "double")
    single_row, double_row = (read_metrics(tmp_path / name)[0] for name in names)
    assert double_row["reward"] == pytest.approx(single_row["reward"], rel=1e-6)
    # the held-out report, scored half by each rank, is the single process's
    single, double = (json.loads((tmp_path / n / "eval.json").read_text())["rows"] for n in names)
    assert [row["method"] for row in double] == [row["method"] for row in single]
    for one, two in zip(single, double):
        assert two["mean"] == pytest.approx(one["mean"], rel=1e-4, abs=1e-7)
    if "ppo" in policy:
        assert double_row["grad_norm"] > 0
        return
    one = torch.load(tmp_path / "single" / "ckpt.pt", weights_only=True)["policy"]
    two = torch.load(tmp_path / "double" / "ckpt.pt", weights_only=True)["policy"]
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)
    # A non-zero gradient moved every parameter, so the comparison above is not between two no-ops.
    assert single_row["grad_norm"] > 0
    assert double_row["grad_norm"] == pytest.approx(single_row["grad_norm"], rel=1e-5)


def test_ranks_wait_for_a_slow_load_rather_than_time_out(tmp_path, monkeypatch):
    """A rank that loads (or compiles) its model minutes after another is waited for."""
    seen = {}

    def init_process_group(*args, **options):
        seen.update(options)
        raise Killed

    monkeypatch.setattr(train.dist, "init_process_group", init_process_group)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(Killed):
        run(tmp_path / "out", *SHORT)
    assert seen["timeout"].total_seconds() >= 3600


@pytest.mark.parametrize("backbone", ["sd35m", "sdxl", "flux-dev"])
def test_each_family_trains_from_a_local_folder(tiny_runs, tiny_stepwise_runs, backbone):
    """The real-backbone path end to end: from_pretrained on a saved tiny random pipeline, rollouts
    with CFG (or Flux's guidance embedding), the teacher reward, updates and the held-out table;
    and so TPDM's comparator, its policy picking the times inside the loop (in rollout parts of 3
    samples), with PPO."""
    for out, kind in (
        (tiny_runs[0][backbone], "instance"),
        (tiny_stepwise_runs[backbone], "stepwise"),
    ):
        rows = read_metrics(out)
        assert [row["iteration"] for row in rows] == [1, 2]
        assert all(row["grad_norm"] > 0 for row in rows)
        assert kind == "instance" or all(0 <= row["clip_fraction"] <= 1 for row in rows)
        checkpoint = torch.load(out / "ckpt.pt", weights_only=True)
        assert checkpoint["config"]["backbone"] == backbone
        assert checkpoint["policy_config"].get("kind", "instance") == kind
        table = json.loads((out / "eval.json").read_text())["rows"]
        methods = {row["method"]: row["mean"] for row in table}
        assert methods["limit (teacher)"] == 0.0 and methods["default"] < 0.0
        assert "learned (mean)" in methods


@pytest.mark.parametrize("backbone", ["sd35m", "sdxl", "flux-dev"])
def test_prompts_are_encoded_once_and_the_text_encoders_dropped(tiny_runs, monkeypatch, backbone):
    """Before the loop the training and held-out prompts are encoded once, without negatives, and
    the negative (empty) prompt once for all; the text encoders are then dropped and no prompt is
    encoded again. The kept rows equal the pipeline's encoding of the same prompts, and a run given
    its backbone already built (train.main's `loaded`) is the run that loads it (tiny_runs')."""
    from conftest import small_policies

    import backbones
    import rollout

    small_policies(monkeypatch)
    monkeypatch.setattr(rollout.Backbone, "reference_steps", 4)
    original = torch.load(tiny_runs[0][backbone] / "ckpt.pt", weights_only=True)
    settings = {k: v for k, v in original["config"].items() if k in ("device", "resolution")}
    built = backbones.load_backbone(backbone, path=original["config"]["model_path"], **settings)
    prompts = (tiny_runs[1] / "prompts.txt").read_text().splitlines()
    direct = built.encode_prompts(prompts)
    calls, encode_prompt = [], type(built.pipe).encode_prompt

    def counted(pipe, prompt=None, **options):
        calls.append((len(prompt), options.get("do_classifier_free_guidance", False)))
        return encode_prompt(pipe, prompt=prompt, **options)

    monkeypatch.setattr(type(built.pipe), "encode_prompt", counted)
    config = train.Config(
        **dict(original["config"], out_dir=str(tiny_runs[1] / f"once_{backbone}"))
    )
    train.main(config, loaded=(built, rewards.load_reward("teacher", built)))
    negatives = [(1, True)] if built.cfg else []
    assert calls == [(3, False)] + negatives  # 3 prompts (the held-out ones are the same), then ""
    names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    assert all(getattr(built.pipe, name, None) is None for name in names)
    kept = built.encode_prompts(prompts)
    assert len(calls) == 1 + len(negatives) and kept.keys() == direct.keys()
    for key, value in direct.items():
        torch.testing.assert_close(kept[key], value, rtol=1e-5, atol=1e-6)
    again = torch.load(tiny_runs[1] / f"once_{backbone}" / "ckpt.pt", weights_only=True)["policy"]
    for name, value in original["policy"].items():
        torch.testing.assert_close(again[name], value, rtol=1e-5, atol=1e-7)
