"""sample.py on the digits backbone: the files it promises, what they hold, and its errors."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import run_script
from PIL import Image

import backbones
import sample
from prompts import context_noise
from scoring import figures
from scoring import paired as heldout
from store.checkpoint import load_checkpoint

STEPS = 4


@pytest.fixture(scope="module")
def ckpt(digits_run):
    return str(digits_run / "ckpt.pt")


def run_sample(args, cwd):
    return run_script("sample.py", args, cwd)


def test_defaults_after_train_write_images_grid_and_schedules(tmp_path, ckpt, monkeypatch, capsys):
    # `python sample.py` where `python train.py` left its run in the working directory
    run = tmp_path / os.path.dirname(sample.MAIN_RUN)
    run.mkdir(parents=True)
    shutil.copy(ckpt, run / "ckpt.pt")
    monkeypatch.chdir(tmp_path)
    sample.main([])
    stdout = capsys.readouterr().out
    samples = run / "samples"
    assert str(samples) in stdout
    images = sorted(path.name for path in samples.glob("0*.png"))
    assert len(images) == 3 * 10  # one context per class: default, learned and the teacher
    assert images[:3] == [
        f"000_a-handwritten-0_seed0_{name}.png" for name in ("default", "learned", "teacher")
    ]
    assert Image.open(samples / images[0]).size == (128, 128)  # 8x8 upscaled, nearest neighbours
    grid = Image.open(samples / "grid.png")
    assert grid.height >= 2.5 * grid.width  # ten rows of three square columns
    # every context's distance to the teacher, learned and default, is printed (and titles the
    # grid's images)
    assert stdout.count("learned times") == stdout.count("distance to the teacher 0") == 10
    assert (samples / "schedules.png").stat().st_size > 0
    saved = json.loads((samples / "schedules.json").read_text())
    assert saved["default"] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert [c["prompt"] for c in saved["contexts"]] == [f"a handwritten {d}" for d in range(10)]
    # the per-context gains and losses are counted, from the printed distances
    pairs = [
        line.split("distance to the teacher ")[1]
        for line in stdout.splitlines()
        if "distance to the teacher " in line
    ]
    closer = sum(
        float(pair.split()[0]) < float(pair.split("(default ")[1].rstrip(")")) for pair in pairs
    )
    assert f"better on {closer} of 10 contexts, worse on {10 - closer}" in stdout


def test_a_global_schedule_is_drawn_as_one_line():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    default = torch.linspace(1, 0, 5)
    for learned, lines in (
        (torch.tensor([[1.0, 0.6, 0.3, 0.1, 0.0]] * 6), 2),
        (torch.rand(6, 5), 7),
    ):
        figure, ax = plt.subplots()
        figures.draw_schedules(ax, learned, default, [f"context {i}" for i in range(6)])
        # one learned line (a global policy) or one per context, and the default
        assert len(ax.get_lines()) == lines
        plt.close(figure)


def test_results_figure_draws_the_schedules_as_a_shift_from_the_default(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    default = torch.linspace(1, 0, 5)
    learned = default + 0.01 * torch.randn(50, 5)
    saved = {}
    real_savefig = plt.Figure.savefig

    def keep(figure, *args, **kwargs):
        saved["axes"] = figure.axes
        return real_savefig(figure, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plt.Figure, "savefig", keep)
        figures.plot_results(
            str(tmp_path / "results.png"),
            {"teacher": {"default": torch.zeros(50), "learned": torch.rand(50)}},
            {"learned": learned},
            default,
        )
    mean_line = saved["axes"][-1].get_lines()[-1]
    np.testing.assert_allclose(
        mean_line.get_ydata(), (learned - default).mean(0).numpy(), atol=1e-6
    )


def test_images_are_the_two_schedules_from_the_same_noise(tmp_path, ckpt):
    out = tmp_path / "samples"
    sample.main(
        [
            "--ckpt",
            ckpt,
            "--prompt",
            "a handwritten 3",
            "--prompt",
            "a handwritten 8",
            "--seeds",
            "5",
            "6",
            "--out-dir",
            str(out),
        ]
    )
    backbone = backbones.load_backbone("digits")
    _, policy = load_checkpoint(ckpt)
    prompts, seeds = ["a handwritten 3"] * 2 + ["a handwritten 8"] * 2, [5, 6, 5, 6]
    noise = torch.cat(
        [backbone.sample_noise(1, torch.Generator().manual_seed(seed)) for seed in seeds]
    )
    cond = backbone.encode_prompts(prompts)
    learned_times = heldout.policy_schedule(policy, backbone)(noise, cond)[0]
    expected = {
        "default": backbone.default_times(STEPS).expand(4, -1),
        "learned": learned_times,
        "teacher": None,
    }
    saved = json.loads((out / "schedules.json").read_text())
    torch.testing.assert_close(
        torch.tensor([c["learned"] for c in saved["contexts"]]), learned_times
    )
    for name, times in expected.items():
        images = backbone.decode(
            backbone.reference(noise, cond)
            if times is None
            else backbone.sample(noise, cond, times)
        )
        for index, (prompt, seed) in enumerate(zip(prompts, seeds)):
            written = np.asarray(
                Image.open(out / f"{index:03d}_{sample.slug(prompt)}_seed{seed}_{name}.png")
            )
            assert np.array_equal(written, np.asarray(sample.to_pil(images[index])))
    default = np.asarray(Image.open(out / "000_a-handwritten-3_seed5_default.png"))
    learned = np.asarray(Image.open(out / "000_a-handwritten-3_seed5_learned.png"))
    assert not np.array_equal(default, learned)


def test_stochastic_schedules_are_draws_reproducible_by_seed(tmp_path, ckpt):
    def learned_times(name, *extra):
        sample.main(
            [
                "--ckpt",
                ckpt,
                "--prompt",
                "a handwritten 1",
                "--seeds",
                "0",
                "1",
                "--out-dir",
                str(tmp_path / name),
                *extra,
            ]
        )
        return torch.tensor(
            [
                c["learned"]
                for c in json.loads((tmp_path / name / "schedules.json").read_text())["contexts"]
            ]
        )

    mean = learned_times("mean")
    first, again = learned_times("a", "--stochastic"), learned_times("b", "--stochastic")
    other = learned_times("c", "--stochastic", "--draw-seed", "1")
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first, other) and not torch.equal(first, mean)
    # sum(alpha) is about 100 at initialisation: a draw's times have std below 0.05 around the mean
    assert (first - mean).abs().max() < 0.25


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "5"], "was trained for L=4 steps, not L=5"),
        (["--backbone", "flux-dev"], "was trained on backbone 'digits', not 'flux-dev'"),
    ],
)
def test_mismatched_checkpoint_fails_in_one_line_before_loading(monkeypatch, ckpt, args, message):
    monkeypatch.setattr(
        backbones, "load_backbone", lambda *a, **k: pytest.fail("loaded a backbone")
    )
    with pytest.raises(SystemExit, match=message) as error:
        sample.main(["--ckpt", ckpt, *args])
    assert "\n" not in str(error.value)


def test_missing_checkpoint_and_missing_prompts(tmp_path, monkeypatch, tiny_runs):
    sd35m = str(tiny_runs[0]["sd35m"] / "ckpt.pt")
    monkeypatch.setattr(
        backbones, "load_backbone", lambda *a, **k: pytest.fail("loaded a backbone")
    )
    with pytest.raises(SystemExit, match="needs --prompt TEXT or --prompts FILE"):
        sample.main(["--ckpt", sd35m])
    result = run_sample(["--ckpt", "nowhere/ckpt.pt"], tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "sample.py: error: no checkpoint at nowhere/ckpt.pt (train one with `python train.py`)"
    ]


def test_tiny_flux_backbone(tmp_path, tiny_runs):
    out = tmp_path / "samples"
    sample.main(
        [
            "--ckpt",
            str(tiny_runs[0]["flux-dev"] / "ckpt.pt"),
            "--prompt",
            "a cat",
            "--seeds",
            "0",
            "1",
            "--out-dir",
            str(out),
        ]
    )
    default = Image.open(out / "000_a-cat_seed0_default.png")
    assert default.size == (128, 128)  # 32 px upscaled 4x
    assert not np.array_equal(
        np.asarray(default), np.asarray(Image.open(out / "000_a-cat_seed0_learned.png"))
    )
    assert (out / "grid.png").is_file() and (out / "schedules.png").is_file()
    saved = json.loads((out / "schedules.json").read_text())
    assert len(saved["default"]) == 3 and saved["default"][-1] == 0.0
    # ends at the stop margin
    assert all(len(c["learned"]) == 3 and c["learned"][-1] > 0 for c in saved["contexts"])


def test_a_prompt_digits_does_not_know_fails_in_one_line(ckpt):
    with pytest.raises(
        SystemExit,
        match="digits knows only the prompts 'a handwritten 0' .. 'a handwritten 9', got 'a cat'",
    ):
        sample.main(["--ckpt", ckpt, "--prompt", "a handwritten 3", "--prompt", "a cat"])


def test_pipeline_path_writes_the_stock_pipeline_images(tmp_path, tiny_runs):
    runs, _ = tiny_runs
    out = tmp_path / "samples"
    sample.main(
        [
            "--ckpt",
            str(runs["flux-dev"] / "policy"),
            "--prompt",
            "a cat",
            "--seeds",
            "0",
            "--pipeline",
            "--out-dir",
            str(out),
        ]
    )
    default, learned = (
        Image.open(out / f"000_a-cat_seed0_{name}.png") for name in ("default", "learned")
    )
    assert default.size == learned.size == (32, 32)  # the pipeline's own images: no upscaling
    assert not np.array_equal(np.asarray(default), np.asarray(learned))


def test_export_a_global_schedule(tmp_path, digits_global_run, ckpt):
    sample.main(
        ["--ckpt", str(digits_global_run / "policy"), "--export", str(tmp_path / "schedule.json")]
    )
    exported = json.loads((tmp_path / "schedule.json").read_text())
    assert (
        exported["backbone"] == "digits"
        and len(exported["times"]) == 5
        and exported["times"][0] == 1.0
    )
    assert exported["times"][-1] > 0  # the stop margin, not a final 0
    with pytest.raises(SystemExit, match="only a global one exports") as error:
        sample.main(["--ckpt", ckpt, "--export", str(tmp_path / "instance.json")])
    assert "\n" not in str(error.value)


def test_a_stepwise_checkpoint_samples_and_its_schedules_replay(tmp_path, digits_stepwise_run):
    """TPDM's policy picks its times while sampling: sample.py draws them, and the loop fed those
    times gives the same images; --pipeline refuses it in one line."""
    out = tmp_path / "samples"
    ckpt = str(digits_stepwise_run / "ckpt.pt")
    sample.main(
        ["--ckpt", ckpt, "--prompt", "a handwritten 3", "--seeds", "0", "1", "--out-dir", str(out)]
    )
    saved = json.loads((out / "schedules.json").read_text())
    learned = torch.tensor([context["learned"] for context in saved["contexts"]])
    assert learned.shape == (2, STEPS + 1) and (learned[:, 1:] < learned[:, :-1]).all()
    _, policy = load_checkpoint(ckpt)
    backbone = backbones.load_backbone("digits")
    results = sample.sample_contexts(backbone, policy, ["a handwritten 3"] * 2, [0, 1])
    images, times, _, _ = results["learned"]
    torch.testing.assert_close(times, learned)
    noise = context_noise(backbone, [0, 1])
    cond = backbone.encode_prompts(["a handwritten 3"] * 2)
    torch.testing.assert_close(backbone.decode(backbone.sample(noise, cond, times)), images)
    with pytest.raises(SystemExit, match="step-wise policy .* without --pipeline"):
        sample.main(["--ckpt", ckpt, "--pipeline", "--out-dir", str(out)])


def test_contexts_are_compared_by_the_runs_reward(ckpt):
    """The score of each image is the run's reward (here a stand-in: the mean latent), or minus
    the distance to the teacher when the teacher is the reward."""
    _, policy = load_checkpoint(ckpt)
    backbone = backbones.load_backbone("digits")
    prompts, seeds = ["a handwritten 3", "a handwritten 8"], [0, 1]

    def brightness(latents, prompts, noise, cond):
        return latents.flatten(1).mean(1)

    scored = sample.sample_contexts(backbone, policy, prompts, seeds, reward=brightness)
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    for name in ("default", "learned"):
        _, times, _, scores = scored[name]
        latents = backbone.sample(noise, cond, times)
        torch.testing.assert_close(scores, latents.flatten(1).mean(1))
    plain = sample.sample_contexts(backbone, policy, prompts, seeds)
    torch.testing.assert_close(plain["learned"][3], -plain["learned"][2])
