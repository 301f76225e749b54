"""evaluate.py on train.py's checkpoints: statistics, pairing, batching, command line, resume."""

import json
import math

import pytest
import torch
from conftest import run_script

import backbones
import evaluate
import rewards
import rollout
from backbones import mixture, trained_backbone
from prompts import HPDV2_STYLES, context_noise, heldout_contexts, load_hpdv2
from scoring import paired as heldout
from store.checkpoint import load_checkpoint

STEPS = 4


def key(prompt, seed):
    """How scores.json keys a context."""
    return f"{seed}|{prompt}"


@pytest.fixture(scope="module")
def backbone():
    return backbones.load_backbone("digits")


@pytest.fixture(scope="module")
def teacher(backbone):
    return rewards.load_reward("teacher", backbone)


@pytest.fixture(autouse=True)
def shared_teacher(monkeypatch, teacher):
    """Every evaluate.main() call on digits gets the one teacher reward of this module: its cache of
    reference solves (the slow part) is filled once for the held-out contexts all tests share."""
    real_load_reward = rewards.load_reward
    monkeypatch.setattr(
        rewards,
        "load_reward",
        lambda name, chosen, *args, **kwargs: (
            teacher
            if name == "teacher" and chosen.name == "digits"
            else real_load_reward(name, chosen, *args, **kwargs)
        ),
    )


@pytest.fixture(scope="module")
def ckpt(digits_run):
    return str(digits_run / "ckpt.pt")


def test_summarize_matches_hand_computed_values():
    scores = {
        "default": torch.tensor([1.0, 2.0, 3.0, 4.0]),
        "learned": torch.tensor([2.0, 2.0, 5.0, 5.0]),
    }
    default, learned = heldout.summarize(scores)
    t3 = 3.182446305284263  # two-sided 95% Student-t quantile, 3 degrees of freedom
    # default: mean 2.5, sample variance 5/3; learned: mean 3.5, sample variance 3;
    # differences [1, 0, 2, 1]: mean 1, sample variance 2/3
    assert default["mean"] == pytest.approx(2.5) and default["ci95"] == pytest.approx(
        t3 * math.sqrt(5 / 3 / 4)
    )
    assert default["diff_mean"] is None and default["diff_ci95"] is None
    assert learned["mean"] == pytest.approx(3.5) and learned["ci95"] == pytest.approx(
        t3 * math.sqrt(3 / 4)
    )
    assert learned["diff_mean"] == pytest.approx(1.0)
    assert learned["diff_ci95"] == pytest.approx(t3 * math.sqrt(2 / 3 / 4))
    table = heldout.format_table([default, learned])
    assert "| default | 4 | 2.5 ± 2.054 | - |" in table
    assert "| learned | 4 | 3.5 ± 2.756 | +1 ± 1.299 |" in table


def test_summarize_refuses_unpaired_scores():
    with pytest.raises(ValueError, match="same contexts"):
        heldout.summarize({"default": torch.zeros(3), "learned": torch.zeros(4)})


def test_heldout_contexts_and_noise(backbone):
    prompts, seeds = heldout_contexts(backbone.prompts, 23)
    assert prompts[:11] == backbone.prompts + backbone.prompts[:1]
    assert seeds == list(range(10**6, 10**6 + 23))
    noise = context_noise(backbone, seeds)
    assert noise.shape == (23, 1, 8, 8)
    torch.testing.assert_close(context_noise(backbone, seeds[5:9]), noise[5:9], rtol=0, atol=0)
    assert not torch.equal(noise[0], noise[1])


def test_scores_equal_a_direct_computation_and_noise_is_paired(backbone, teacher, ckpt):
    _, policy = load_checkpoint(ckpt)
    prompts, seeds = heldout_contexts(backbone.prompts, 10)
    learned = heldout.policy_schedule(policy, backbone)
    seen = {"default": [], "learned": []}

    def recording(name, times_fn):
        def method(noise, cond):
            seen[name].append(noise.clone())
            return times_fn(noise, cond)

        return method

    methods = {
        "default": recording("default", heldout.default_schedule(backbone, STEPS)),
        "learned": recording("learned", learned),
    }
    scores = heldout.score_methods(backbone, teacher, prompts, seeds, methods, batch_size=4)

    noise = torch.cat(
        [backbone.sample_noise(1, torch.Generator().manual_seed(seed)) for seed in seeds]
    )
    assert [len(batch) for batch in seen["default"]] == [4, 4, 2]
    torch.testing.assert_close(torch.cat(seen["default"]), noise, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(seen["learned"]), noise, rtol=0, atol=0)

    cond = backbone.encode_prompts(prompts)
    learned_times = learned(noise, cond)[0]  # (times, latents)
    assert (
        learned_times - learned_times[0]
    ).abs().max() > 0  # instance-level: every context its own schedule
    direct = {
        "default": teacher(
            backbone.sample(noise, cond, backbone.default_times(STEPS).expand(10, -1)),
            prompts,
            noise,
            cond,
        ),
        "learned": teacher(backbone.sample(noise, cond, learned_times), prompts, noise, cond),
    }
    for name in direct:
        torch.testing.assert_close(scores[name], direct[name])
    rows = heldout.summarize(scores)
    assert rows[1]["mean"] == pytest.approx(direct["learned"].double().mean().item(), rel=1e-6)
    assert rows[1]["diff_mean"] == pytest.approx(
        (direct["learned"] - direct["default"]).double().mean().item(), rel=1e-5
    )
    assert not torch.equal(scores["learned"], scores["default"])


def test_scores_do_not_depend_on_the_batch_size(backbone, teacher, ckpt):
    _, policy = load_checkpoint(ckpt)
    prompts, seeds = heldout_contexts(backbone.prompts, 10)
    methods = {
        "default": heldout.default_schedule(backbone, STEPS),
        "learned": heldout.policy_schedule(policy, backbone),
    }
    whole = heldout.score_methods(
        backbone, teacher, prompts, seeds, methods, reference="limit", batch_size=64
    )
    pieces = heldout.score_methods(
        backbone, teacher, prompts, seeds, methods, reference="limit", batch_size=3
    )
    assert list(whole) == ["default", "learned", "limit"]
    for name in whole:
        torch.testing.assert_close(pieces[name], whole[name])
    # the teacher's own solution has no error
    assert torch.all(whole["limit"] == 0) and torch.all(whole["default"] < 0)


# -----------------------------------------------------------------------------
# the command line


class Counter:
    """Counts the contexts passed to the embedded backbone's sample and to the reward."""

    def __init__(self, monkeypatch, die_at_reward_call=None):
        self.sampled, self.scored, self.reward_calls = 0, 0, 0
        real_sample = mixture.MixtureBackbone.sample
        real_load_reward = rewards.load_reward  # the shared teacher

        def sample(backbone, noise, cond, times):
            self.sampled += len(noise)
            return real_sample(backbone, noise, cond, times)

        def load_reward(*args, **kwargs):
            reward = real_load_reward(*args, **kwargs)

            def counted(latents, prompts, noise, cond):
                self.reward_calls += 1
                if self.reward_calls == die_at_reward_call:
                    raise KeyboardInterrupt
                self.scored += len(latents)
                return reward(latents, prompts, noise, cond)

            return counted

        monkeypatch.setattr(mixture.MixtureBackbone, "sample", sample)
        monkeypatch.setattr(rewards, "load_reward", load_reward)


def read_table_means(path):
    """method -> mean of the first table in results.md."""
    means = {}
    for line in open(path).read().split("## ")[1].splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) == 4 and cells[1].isdigit():
            means[cells[0]] = float(cells[2].split("±")[0])
    return means


def test_cli_writes_table_scores_plots_and_resumes(
    tmp_path, monkeypatch, backbone, teacher, ckpt, digits_global_run
):
    global_ckpt = str(digits_global_run / "ckpt.pt")
    out = tmp_path / "eval"
    args = [
        "--ckpt",
        ckpt,
        "--global-ckpt",
        global_ckpt,
        "--out-dir",
        str(out),
        "--batch-size",
        "4",
    ]

    # a run stopped by Ctrl-C in the second batch keeps the first batch, and exits 130
    Counter(monkeypatch, die_at_reward_call=5)
    with pytest.raises(SystemExit) as stopped:
        evaluate.main([*args, "--count", "10"])
    assert stopped.value.code == 130
    store = json.loads((out / "scores.json").read_text())
    assert {m: len(store["scores"][m]["teacher"]) for m in store["scores"]} == {
        "default": 4,
        "learned": 4,
        "global": 4,
    }

    counter = Counter(monkeypatch)
    evaluate.main([*args, "--count", "10", "--figure"])
    assert counter.sampled == 3 * 6 and counter.scored == 3 * 6
    for name in ("results.md", "scores.json", "results.png"):
        assert (out / name).stat().st_size > 0
    assert not list(out.glob("*.tmp"))

    # the table agrees with scores computed here on the same contexts
    _, learned_policy = load_checkpoint(ckpt)
    _, global_policy = load_checkpoint(global_ckpt)
    prompts, seeds = heldout_contexts(backbone.prompts, 10)
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    direct = {
        "default": backbone.default_times(STEPS).expand(10, -1),
        "learned": heldout.policy_schedule(learned_policy, backbone)(noise, cond)[0],
        "global": heldout.policy_schedule(global_policy, backbone)(noise, cond)[0],
    }
    means = read_table_means(out / "results.md")
    store = json.loads((out / "scores.json").read_text())
    for name, times in direct.items():
        scores = teacher(backbone.sample(noise, cond, times), prompts, noise, cond)
        mean = scores.double().mean().item()
        assert means[name] == pytest.approx(mean, rel=1e-3)  # 4 significant digits
        torch.testing.assert_close(
            torch.tensor(
                [store["scores"][name]["teacher"][key(p, s)] for p, s in zip(prompts, seeds)]
            ),
            scores,
        )
        torch.testing.assert_close(
            torch.tensor([store["times"][name][key(p, s)] for p, s in zip(prompts, seeds)]),
            times.float(),
        )

    # a rerun does nothing new; a larger --count only the new contexts
    counter = Counter(monkeypatch)
    evaluate.main([*args, "--count", "10", "--figure"])
    assert (counter.sampled, counter.reward_calls) == (0, 0)
    counter = Counter(monkeypatch)
    evaluate.main([*args, "--count", "13", "--limit", "11"])
    assert (counter.sampled, counter.scored) == (3 * 1, 3 * 1)
    assert "| default | 11 |" in (out / "results.md").read_text()


def test_default_contexts_are_those_of_train_table(tmp_path, digits_run, ckpt):
    evaluate.main(["--ckpt", ckpt, "--out-dir", str(tmp_path / "eval")])
    means = read_table_means(tmp_path / "eval" / "results.md")
    table = {
        row["method"]: row for row in json.loads((digits_run / "eval.json").read_text())["rows"]
    }
    assert "| default | 128 |" in (tmp_path / "eval" / "results.md").read_text()
    assert means["default"] == pytest.approx(table["default"]["mean"], rel=1e-3)
    assert means["learned"] == pytest.approx(table["learned (mean)"]["mean"], rel=1e-3)


def test_scores_are_reused_for_the_same_weights_and_refused_for_others(tmp_path, ckpt):
    out = str(tmp_path / "eval")
    evaluate.main(["--ckpt", ckpt, "--out-dir", out, "--count", "3"])
    stored = json.loads((tmp_path / "eval" / "scores.json").read_text())
    # the same weights from policy/ and from another iteration's file: the stored scores hold
    policy_dir = ckpt.replace("ckpt.pt", "policy")
    checkpoint = torch.load(ckpt, weights_only=False)
    torch.save({**checkpoint, "iteration": checkpoint["iteration"] + 1}, tmp_path / "later.pt")
    for source in (policy_dir, str(tmp_path / "later.pt")):
        evaluate.main(["--ckpt", source, "--out-dir", out, "--count", "3"])
        assert json.loads((tmp_path / "eval" / "scores.json").read_text()) == stored
    # a run trained again into the same folder: other weights, so its old scores are stale
    weights = {name: value + 1e-3 for name, value in checkpoint["policy"].items()}
    torch.save({**checkpoint, "policy": weights}, tmp_path / "retrained.pt")
    with pytest.raises(SystemExit, match="holds 'learned' scores of .*use another --out-dir"):
        evaluate.main(["--ckpt", str(tmp_path / "retrained.pt"), "--out-dir", out, "--count", "3"])
    assert json.loads((tmp_path / "eval" / "scores.json").read_text()) == stored


def test_evaluate_takes_its_folder_and_leaves_others(tmp_path, ckpt):
    import fcntl

    out = tmp_path / "eval"
    out.mkdir()
    (out / "results.md").write_text("my notes\n")  # a user's file where evaluate.py would write
    with pytest.raises(SystemExit, match="holds results.md, which no run of evaluate.py wrote"):
        evaluate.main(["--ckpt", ckpt, "--out-dir", str(out), "--count", "2"])
    assert sorted(path.name for path in out.iterdir()) == ["results.md"]
    assert (out / "results.md").read_text() == "my notes\n"
    busy = tmp_path / "busy"
    busy.mkdir()
    with open(busy / "run.lock", "w") as lock:  # another evaluate.py writing there
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match="is in use by another run"):
            evaluate.main(["--ckpt", ckpt, "--out-dir", str(busy), "--count", "2"])
    assert not (busy / "scores.json").exists()
    with pytest.raises(SystemExit, match="--global-ckpt .* is a run of --policy instance"):
        evaluate.main(["--ckpt", ckpt, "--global-ckpt", ckpt, "--count", "2"])


def test_cli_per_style_tables_from_an_hpdv2_folder(tmp_path, ckpt):
    folder = tmp_path / "benchmark"
    folder.mkdir()
    for index, style in enumerate(HPDV2_STYLES):  # digit prompts stand in for the real ones
        (folder / f"{style}.json").write_text(
            json.dumps([f"a handwritten {index}", f"a handwritten {index + 4}"])
        )
    prompts, styles = load_hpdv2(str(folder))
    assert prompts[:4] == [f"a handwritten {i}" for i in range(4)] and styles[:4] == list(
        HPDV2_STYLES
    )
    evaluate.main(["--ckpt", ckpt, "--hpdv2", str(folder), "--out-dir", str(tmp_path / "eval")])
    report = (tmp_path / "eval" / "results.md").read_text()
    for style in HPDV2_STYLES:
        assert f"## teacher, {style}\n\n| method | n |" in report
    assert "| learned | 2 |" in report and "| learned | 8 |" in report


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--steps", "5", "was trained for L=4 steps, not L=5"),
        ("--backbone", "sd35m", "was trained on backbone 'digits', not 'sd35m'"),
    ],
)
def test_mismatched_checkpoint_fails_before_loading_anything(
    monkeypatch, ckpt, flag, value, message
):
    monkeypatch.setattr(
        backbones, "load_backbone", lambda *a, **k: pytest.fail("loaded a backbone")
    )
    with pytest.raises(SystemExit, match=message) as error:
        evaluate.main(["--ckpt", ckpt, flag, value])
    assert "\n" not in str(error.value)


def test_mismatched_global_checkpoint_and_missing_prompts(tmp_path, monkeypatch, ckpt, tiny_runs):
    sd35m = str(tiny_runs[0]["sd35m"] / "ckpt.pt")
    monkeypatch.setattr(
        backbones, "load_backbone", lambda *a, **k: pytest.fail("loaded a backbone")
    )
    with pytest.raises(
        SystemExit, match="sd35m/ckpt.pt was trained on backbone 'sd35m', not 'digits'"
    ):
        evaluate.main(["--ckpt", ckpt, "--global-ckpt", sd35m])
    with pytest.raises(
        SystemExit, match="HPDv2 test prompts not found .*`hf download zhwang/HPDv2"
    ):
        evaluate.main(["--ckpt", ckpt, "--hpdv2", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="--schnell is the reference for flux-dev"):
        evaluate.main(["--ckpt", ckpt, "--schnell"])


def test_cli_error_is_one_line_on_stderr(tmp_path, ckpt):
    result = run_script("evaluate.py", ["--ckpt", ckpt, "--steps", "5"], tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"evaluate.py: error: {ckpt} was trained for L=4 steps, not L=5"
    ]


def test_cli_on_tiny_flux_with_schnell_from_the_same_noise(tmp_path, monkeypatch, tiny_runs):
    runs, folder = tiny_runs
    monkeypatch.setattr(rollout.Backbone, "reference_steps", 4)  # the teacher as in training
    ckpt = str(runs["flux-dev"] / "ckpt.pt")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na red house on a hill\na dog\n")
    out = tmp_path / "eval"
    evaluate.main(
        [
            "--ckpt",
            ckpt,
            "--prompts",
            str(prompts),
            "--rewards",
            "teacher",
            "--schnell",
            "--schnell-path",
            str(folder / "flux-schnell"),
            "--out-dir",
            str(out),
            "--batch-size",
            "2",
        ]
    )
    store = json.loads((out / "scores.json").read_text())
    assert list(store["scores"]) == ["default", "learned", "schnell-2", "schnell-4"]
    texts = ["a cat", "a red house on a hill", "a dog"]
    keys = [key(p, 10**6 + i) for i, p in enumerate(texts)]
    assert all(len(store["scores"][m]["teacher"]) == 3 for m in store["scores"])
    assert (
        len(store["times"]["schnell-4"][keys[0]]) == 5
        and len(store["times"]["learned"][keys[0]]) == 3
    )

    # Flux-Schnell samples from Flux-Dev's noise with its own text encoding and 4 default steps
    config = torch.load(ckpt, weights_only=False)["config"]
    dev = trained_backbone(config, "cpu")
    schnell = backbones.load_backbone(
        "flux-schnell", path=str(folder / "flux-schnell"), resolution=config["resolution"]
    )
    noise = context_noise(dev, [10**6, 10**6 + 1, 10**6 + 2])
    latents = schnell.sample(
        noise, schnell.encode_prompts(texts), schnell.default_times(4).expand(3, -1)
    )
    direct = rewards.load_reward("teacher", dev)(latents, texts, noise, dev.encode_prompts(texts))
    torch.testing.assert_close(
        torch.tensor([store["scores"]["schnell-4"]["teacher"][k] for k in keys]), direct
    )
    report = (out / "results.md").read_text()
    assert "| schnell-4 | 3 |" in report and "| learned | 3 |" in report


def test_an_unknown_reward_fails_in_one_line_with_the_choices(capsys, ckpt):
    with pytest.raises(SystemExit) as error:
        evaluate.main(["--ckpt", ckpt, "--rewards", "teacher", "beauty"])
    assert error.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        len(lines) == 1 and "argument --rewards: invalid choice: 'beauty' (choose from" in lines[0]
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--count", "0"], "--count must be at least 1 \\(got 0\\)"),
        (["--limit", "0"], "--limit must be at least 1 \\(got 0\\)"),
        (["--limit", "-1"], "--limit must be at least 1 \\(got -1\\)"),
        (
            ["--reward-checkpoint", "teacher"],
            "--reward-checkpoint takes NAME=PATH .* got 'teacher'",
        ),
        (["--steps", "5"], "was trained for L=4 steps, not L=5"),
        (["--out-dir", "{file}"], "--out-dir .* is a file, not a folder"),
    ],
)
def test_bad_evaluate_input_fails_in_one_line_before_loading(
    tmp_path, monkeypatch, ckpt, args, message
):
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(
        backbones, "load_backbone", lambda *a, **k: pytest.fail("loaded a backbone")
    )
    with pytest.raises(SystemExit, match=message) as error:
        evaluate.main(
            ["--ckpt", ckpt, *(arg.replace("{file}", str(tmp_path / "file")) for arg in args)]
        )
    assert "\n" not in str(error.value)


def test_a_damaged_score_store_fails_in_one_line_and_is_kept(tmp_path, ckpt):
    (tmp_path / "written-by.json").write_text('{"program": "evaluate.py"}')  # a folder of ours
    (tmp_path / "scores.json").write_text('{"rows": {')
    with pytest.raises(
        SystemExit, match="scores.json is damaged \\(not JSON: JSONDecodeError\\); move it away"
    ) as error:
        evaluate.main(["--ckpt", ckpt, "--out-dir", str(tmp_path), "--limit", "2"])
    assert "\n" not in str(error.value) and (tmp_path / "scores.json").read_text() == '{"rows": {'


def test_a_seed_out_of_range_fails_in_one_line(capsys, ckpt):
    import sample

    for script in (sample, evaluate):
        flag = "--seeds" if script is sample else "--seed"
        with pytest.raises(SystemExit) as error:
            script.main(["--ckpt", ckpt, flag, "18446744073709551616"])
        assert error.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "a seed is an integer from 0 to 2^63 - 1" in lines[0]


@pytest.mark.parametrize("script", [evaluate, __import__("sample")])
def test_a_truncated_checkpoint_fails_in_one_line(tmp_path, ckpt, script):
    truncated = tmp_path / "ckpt.pt"
    truncated.write_bytes(open(ckpt, "rb").read()[:5000])
    with pytest.raises(SystemExit, match=f"{truncated} is not a readable checkpoint") as error:
        script.main(["--ckpt", str(truncated)])
    assert "\n" not in str(error.value)


class StandIn:
    """A GenEval-like reward whose per-image details are known: every image meets half of its
    requirements, and is correct when its prompt's digit is even."""

    def details(self, latents, prompts):
        return [dict(reward=0.5, correct=int(prompt[-1]) % 2 == 0) for prompt in prompts]


def test_second_columns_and_groups_of_a_fine_grained_reward(tmp_path, monkeypatch, ckpt):
    real_load_reward = rewards.load_reward
    monkeypatch.setattr(
        rewards,
        "load_reward",
        lambda name, *args, **kwargs: (
            StandIn() if name == "geneval" else real_load_reward(name, *args, **kwargs)
        ),
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps(dict(prompt=f"a handwritten {d}", tag="low" if d < 5 else "high")) + "\n"
            for d in range(10)
        )
    )
    evaluate.main(
        [
            "--ckpt",
            ckpt,
            "--prompts",
            str(prompts),
            "--rewards",
            "geneval",
            "--out-dir",
            str(tmp_path / "eval"),
        ]
    )
    report = (tmp_path / "eval" / "results.md").read_text()
    for table in (
        "## geneval\n",
        "## geneval correct\n",
        "## geneval correct, low\n",
        "## geneval correct, high\n",
    ):
        assert table in report

    def section(header):
        return report.split(f"## {header}\n")[1].split("##")[0]

    assert "| default | 5 | 0.4 ±" in section("geneval correct, high")  # digits 5-9: 6 and 8 even
    assert "| default | 5 | 0.6 ±" in section("geneval correct, low")  # digits 0-4: 0, 2 and 4
    # GenEval's overall: the mean over tags of the share of correct images, (3/5 + 2/5) / 2 for
    # both methods
    assert "mean over the 2 groups: default 0.5, learned 0.5" in report


def test_hpdv2_test_prompts_from_the_hub_offline_say_how_to_get_them(ckpt):
    with pytest.raises(
        SystemExit, match=r"HPDv2's benchmark/anime.json is not available: fetch it once online"
    ) as error:
        evaluate.main(["--ckpt", ckpt, "--hpdv2"])
    assert "\n" not in str(error.value)


def test_cli_scores_a_stepwise_checkpoint(tmp_path, digits_stepwise_run):
    out = tmp_path / "eval"
    ckpt = str(digits_stepwise_run / "ckpt.pt")
    evaluate.main(["--ckpt", ckpt, "--out-dir", str(out), "--count", "6", "--batch-size", "4"])
    scores = json.loads((out / "scores.json").read_text())["scores"]
    assert {name: len(columns["teacher"]) for name, columns in scores.items()} == {
        "default": 6,
        "learned": 6,
    }
    assert "| learned |" in (out / "results.md").read_text()
