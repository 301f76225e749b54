"""sample.py on the digits backbone: the files it promises and what they hold."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import backbones
import sample
from evaluate import MAIN_RUN, load_policy, policy_schedule
from prompts import context_noise

STEPS = 4


@pytest.fixture(scope="module")
def ckpt(digits_run):
    return str(digits_run / "ckpt.pt")


def test_defaults_after_train_write_images_grid_and_schedules(tmp_path, ckpt, monkeypatch, capsys):
    """`python sample.py` where `python train.py` left its run in the working directory: its files
    in samples/ next to the checkpoint, beside a user's file there, which stays as it was."""
    samples = tmp_path / os.path.dirname(MAIN_RUN) / "samples"
    samples.mkdir(parents=True)
    (samples / "notes.txt").write_text("my notes\n")
    shutil.copy(ckpt, samples.parent / "ckpt.pt")
    monkeypatch.chdir(tmp_path)
    sample.main([])
    assert str(samples) in capsys.readouterr().out
    assert (samples / "notes.txt").read_text() == "my notes\n"
    images = sorted(path.name for path in samples.glob("0*.png"))
    assert len(images) == 3 * 10  # one context per class: default, learned and the teacher
    files = ["grid.png", "notes.txt", "schedules.json", "schedules.png"]
    assert sorted(path.name for path in samples.iterdir()) == sorted(images + files)
    assert images[:3] == [
        f"000_a-handwritten-0_seed0_{name}.png" for name in ("default", "learned", "teacher")
    ]
    assert Image.open(samples / images[0]).size == (128, 128)  # 8x8 upscaled, nearest neighbours
    grid = Image.open(samples / "grid.png")
    assert grid.height >= 2.5 * grid.width  # ten rows of three square columns
    assert (samples / "schedules.png").stat().st_size > 0
    saved = json.loads((samples / "schedules.json").read_text())
    assert saved["default"] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert [c["prompt"] for c in saved["contexts"]] == [f"a handwritten {d}" for d in range(10)]


def test_images_are_the_two_schedules_from_one_noise_scored_by_the_runs_reward(tmp_path, ckpt):
    """Each image's score is the run's reward (here a stand-in: the mean latent), or minus the
    distance to the teacher when the teacher is the reward."""
    out = tmp_path / "samples"
    sample.main(
        ["--ckpt", ckpt, "--prompt", "a handwritten 3", "--prompt", "a handwritten 8"]
        + ["--seeds", "5", "6", "--out-dir", str(out)]
    )
    backbone = backbones.load_backbone("digits")
    policy, _ = load_policy(ckpt)
    prompts, seeds = ["a handwritten 3"] * 2 + ["a handwritten 8"] * 2, [5, 6, 5, 6]
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    learned_times = policy_schedule(policy, backbone)(noise, cond)
    saved = json.loads((out / "schedules.json").read_text())["contexts"]
    torch.testing.assert_close(torch.tensor([c["learned"] for c in saved]), learned_times)
    expected = {
        "default": backbone.sample(noise, cond, backbone.default_times(STEPS).expand(4, -1)),
        "learned": backbone.sample(noise, cond, learned_times),
        "teacher": backbone.reference(noise, cond),
    }
    written = {}
    for name, latents in expected.items():
        images = backbone.decode(latents)
        for index, (prompt, seed) in enumerate(zip(prompts, seeds)):
            path = out / f"{index:03d}_{prompt.replace(' ', '-')}_seed{seed}_{name}.png"
            written[name, index] = np.asarray(Image.open(path))
            assert np.array_equal(written[name, index], np.asarray(sample.to_pil(images[index])))
    assert not np.array_equal(written["default", 0], written["learned", 0])
    brightness = sample.sample_contexts(
        backbone, policy, prompts, seeds, reward=lambda latents, *_: latents.flatten(1).mean(1)
    )
    for name in ("default", "learned"):
        torch.testing.assert_close(brightness[name][3], expected[name].flatten(1).mean(1))
    plain = sample.sample_contexts(backbone, policy, prompts, seeds)
    torch.testing.assert_close(plain["learned"][3], -plain["learned"][2])


def test_stochastic_schedules_are_draws_reproducible_by_seed(tmp_path, ckpt):
    def learned_times(name, *extra):
        out = tmp_path / name
        args = ["--prompt", "a handwritten 1", "--seeds", "0", "1", "--out-dir", str(out), *extra]
        sample.main(["--ckpt", ckpt, *args])
        contexts = json.loads((out / "schedules.json").read_text())["contexts"]
        return torch.tensor([context["learned"] for context in contexts])

    mean = learned_times("mean")
    first, again = learned_times("a", "--stochastic"), learned_times("b", "--stochastic")
    other = learned_times("c", "--stochastic", "--draw-seed", "1")
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first, other) and not torch.equal(first, mean)
    # sum(alpha) is about 100 at initialisation: a draw's times have std below 0.05 around the mean
    assert (first - mean).abs().max() < 0.25


def test_tiny_flux_through_the_loop_and_through_the_stock_pipeline(tmp_path, tiny_runs):
    run = tiny_runs[0]["flux-dev"]
    args = ["--prompt", "a cat", "--seeds", "0", "1", "--out-dir"]
    sample.main(["--ckpt", str(run / "ckpt.pt"), *args, str(tmp_path / "loop")])
    sample.main(["--ckpt", str(run / "policy"), *args, str(tmp_path / "stock"), "--pipeline"])
    for out, size in ((tmp_path / "loop", 128), (tmp_path / "stock", 32)):
        default, learned = (
            Image.open(out / f"000_a-cat_seed0_{name}.png") for name in ("default", "learned")
        )
        # the loop's 32 px upscaled 4x; the pipeline's own images
        assert default.size == learned.size == (size, size)
        assert not np.array_equal(np.asarray(default), np.asarray(learned))
    saved = json.loads((tmp_path / "loop" / "schedules.json").read_text())
    assert len(saved["default"]) == 3 and saved["default"][-1] == 0.0
    # ends at the stop margin
    assert all(len(c["learned"]) == 3 and c["learned"][-1] > 0 for c in saved["contexts"])


def test_export_a_global_schedule(tmp_path, digits_global_run):
    sample.main(["--ckpt", str(digits_global_run / "policy"), "--export", str(tmp_path / "s.json")])
    exported = json.loads((tmp_path / "s.json").read_text())
    assert exported["backbone"] == "digits" and len(exported["times"]) == 5
    assert exported["times"][0] == 1.0 and exported["times"][-1] > 0  # the stop margin, not 0


def test_a_stepwise_checkpoint_samples_and_its_schedules_replay(tmp_path, digits_stepwise_run):
    """TPDM's policy picks its times while sampling: sample.py draws them, and the loop fed those
    times gives the same images."""
    out = tmp_path / "samples"
    ckpt = str(digits_stepwise_run / "ckpt.pt")
    sample.main(
        ["--ckpt", ckpt, "--prompt", "a handwritten 3", "--seeds", "0", "1", "--out-dir", str(out)]
    )
    saved = json.loads((out / "schedules.json").read_text())
    learned = torch.tensor([context["learned"] for context in saved["contexts"]])
    assert learned.shape == (2, STEPS + 1) and (learned[:, 1:] < learned[:, :-1]).all()
    policy, _ = load_policy(ckpt)
    backbone = backbones.load_backbone("digits")
    results = sample.sample_contexts(backbone, policy, ["a handwritten 3"] * 2, [0, 1])
    images, times, _, _ = results["learned"]
    torch.testing.assert_close(times, learned)
    noise = context_noise(backbone, [0, 1])
    cond = backbone.encode_prompts(["a handwritten 3"] * 2)
    torch.testing.assert_close(backbone.decode(backbone.sample(noise, cond, times)), images)
