"""evaluate.py on the digits backbone: the statistics, pairing, batching, the command line and resume."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import evaluate
import policy as policy_lib
import rewards
import rollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
STEPS = 4
REAL_LOAD_REWARD = rewards.load_reward


def write_checkpoint(path, kind="instance", steps=STEPS, backbone_name="digits", iteration=7, seed=0):
    """A checkpoint in train.py's format whose instance policy depends on its input: the head's last
    layer (zero at initialisation) gets random weights, so every context has its own schedule."""
    backbone = rollout.load_backbone("digits")
    torch.manual_seed(seed)
    policy = policy_lib.make_policy(kind, backbone.policy_dims, steps, init_times=backbone.default_times(steps))
    with torch.no_grad():
        if kind == "instance":
            policy.head[-1].weight.normal_(0.0, 0.3)
        else:
            policy.logits.add_(torch.randn(steps + 1))
    config = dict(backbone=backbone_name, model_path=None, steps=steps, resolution=None, guidance=None, reward="teacher",
                  reward_checkpoint=None, seed=seed, out_dir=os.path.dirname(path), dtype=None)
    torch.save(dict(policy=policy.state_dict(), policy_config=policy.config, optimizer={}, iteration=iteration,
                    rng={"torch": torch.get_rng_state()}, metrics_rows=iteration, config=config), path)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The digits tensors are tiny: a second intra-op thread only adds contention (10x slower
    reference solves on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def backbone():
    return rollout.load_backbone("digits")


@pytest.fixture(scope="module")
def teacher(backbone):
    return rewards.load_reward("teacher", backbone)


@pytest.fixture(autouse=True)
def shared_teacher(monkeypatch, teacher):
    """Every evaluate.main() call gets the one teacher reward of this module: its cache of reference
    solves (the slow part) is then filled once for the held-out contexts that all tests share."""
    real_load_reward = rewards.load_reward
    monkeypatch.setattr(rewards, "load_reward", lambda name, *args, **kwargs: teacher if name == "teacher"
                        else real_load_reward(name, *args, **kwargs))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("run") / "ckpt.pt"))


def test_summarize_matches_hand_computed_values():
    scores = {"default": torch.tensor([1.0, 2.0, 3.0, 4.0]), "learned": torch.tensor([2.0, 2.0, 5.0, 5.0])}
    default, learned = evaluate.summarize(scores)
    t3 = 3.182446305284263  # two-sided 95% Student-t quantile, 3 degrees of freedom
    # default: mean 2.5, sample variance 5/3; learned: mean 3.5, sample variance 3;
    # differences [1, 0, 2, 1]: mean 1, sample variance 2/3
    assert default["mean"] == pytest.approx(2.5) and default["sem"] == pytest.approx(math.sqrt(5 / 3 / 4))
    assert default["ci95"] == pytest.approx(t3 * math.sqrt(5 / 3 / 4))
    assert default["diff_mean"] is None and default["diff_ci95"] is None
    assert learned["mean"] == pytest.approx(3.5) and learned["ci95"] == pytest.approx(t3 * math.sqrt(3 / 4))
    assert learned["diff_mean"] == pytest.approx(1.0)
    assert learned["diff_ci95"] == pytest.approx(t3 * math.sqrt(2 / 3 / 4))
    table = evaluate.format_table([default, learned])
    assert "| default | 4 | 2.5 ± 2.054 | - |" in table
    assert "| learned | 4 | 3.5 ± 2.756 | +1 ± 1.299 |" in table


def test_summarize_refuses_unpaired_scores():
    with pytest.raises(ValueError, match="same contexts"):
        evaluate.summarize({"default": torch.zeros(3), "learned": torch.zeros(4)})


def test_heldout_contexts_and_noise(backbone):
    prompts, seeds = evaluate.heldout_contexts(backbone, 23)
    assert prompts[:11] == backbone.prompts + backbone.prompts[:1]
    assert seeds == list(range(10**6, 10**6 + 23))
    noise = evaluate.context_noise(backbone, seeds)
    assert noise.shape == (23, 1, 8, 8)
    torch.testing.assert_close(evaluate.context_noise(backbone, seeds[5:9]), noise[5:9], rtol=0, atol=0)
    assert not torch.equal(noise[0], noise[1])


def test_scores_equal_a_direct_computation_and_noise_is_paired(backbone, teacher, ckpt):
    _, policy = evaluate.load_checkpoint(ckpt)
    prompts, seeds = evaluate.heldout_contexts(backbone, 10)
    learned = evaluate.policy_schedule(policy, backbone)
    seen = {"default": [], "learned": []}

    def recording(name, times_fn):
        def method(noise, cond):
            seen[name].append(noise.clone())
            return times_fn(noise, cond)
        return method

    methods = {"default": recording("default", evaluate.default_schedule(backbone, STEPS)),
               "learned": recording("learned", learned)}
    scores = evaluate.evaluate(backbone, teacher, prompts, seeds, methods, batch_size=4)

    noise = torch.cat([backbone.sample_noise(1, torch.Generator().manual_seed(seed)) for seed in seeds])
    assert [len(batch) for batch in seen["default"]] == [4, 4, 2]
    torch.testing.assert_close(torch.cat(seen["default"]), noise, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(seen["learned"]), noise, rtol=0, atol=0)

    cond = backbone.encode_prompts(prompts)
    learned_times = learned(noise, cond)
    assert (learned_times[:, 1:-1] - learned_times[0, 1:-1]).abs().max() > 1e-3  # instance-level, not one schedule
    direct = {"default": teacher(backbone.sample(noise, cond, backbone.default_times(STEPS).expand(10, -1)), prompts, noise, cond),
              "learned": teacher(backbone.sample(noise, cond, learned_times), prompts, noise, cond)}
    for name in direct:
        torch.testing.assert_close(scores[name], direct[name])
    rows = evaluate.summarize(scores)
    assert rows[1]["mean"] == pytest.approx(direct["learned"].double().mean().item(), rel=1e-6)
    assert rows[1]["diff_mean"] == pytest.approx((direct["learned"] - direct["default"]).double().mean().item(), rel=1e-5)
    assert not torch.equal(scores["learned"], scores["default"])


def test_scores_do_not_depend_on_the_batch_size(backbone, teacher, ckpt):
    _, policy = evaluate.load_checkpoint(ckpt)
    prompts, seeds = evaluate.heldout_contexts(backbone, 10)
    methods = {"default": evaluate.default_schedule(backbone, STEPS), "learned": evaluate.policy_schedule(policy, backbone)}
    whole = evaluate.evaluate(backbone, teacher, prompts, seeds, methods, batch_size=64)
    pieces = evaluate.evaluate(backbone, teacher, prompts, seeds, methods, batch_size=3)
    for name in methods:
        torch.testing.assert_close(pieces[name], whole[name])
    # the teacher limit (a slow solve, so on three contexts): its own solution has no error
    methods["limit"] = "reference"
    whole = evaluate.evaluate(backbone, teacher, prompts[:3], seeds[:3], methods, batch_size=64)
    pieces = evaluate.evaluate(backbone, teacher, prompts[:3], seeds[:3], methods, batch_size=2)
    for name in methods:
        torch.testing.assert_close(pieces[name], whole[name])
    assert torch.all(whole["limit"] == 0) and torch.all(whole["default"] < 0)


# -----------------------------------------------------------------------------
# the command line


class Counter:
    """Counts the contexts passed to DigitsBackbone.sample and to the reward."""

    def __init__(self, monkeypatch, die_at_reward_call=None):
        self.sampled, self.scored, self.reward_calls = 0, 0, 0
        real_sample = rollout.DigitsBackbone.sample
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

        monkeypatch.setattr(rollout.DigitsBackbone, "sample", sample)
        monkeypatch.setattr(rewards, "load_reward", load_reward)


def read_table_means(path):
    """method -> mean of the first table in results.md."""
    means = {}
    for line in open(path).read().split("## ")[1].splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) == 4 and cells[1].isdigit():
            means[cells[0]] = float(cells[2].split("±")[0])
    return means


def test_cli_writes_table_scores_plots_and_resumes(tmp_path, monkeypatch, backbone, teacher, ckpt):
    global_ckpt = write_checkpoint(str(tmp_path / "global.pt"), kind="global")
    out = tmp_path / "eval"
    args = ["--ckpt", ckpt, "--global-ckpt", global_ckpt, "--out-dir", str(out), "--batch-size", "4"]

    # an interrupted run (killed in the second batch) keeps the first batch
    Counter(monkeypatch, die_at_reward_call=5)
    with pytest.raises(KeyboardInterrupt):
        evaluate.main([*args, "--count", "10"])
    store = json.loads((out / "scores.json").read_text())
    assert {m: len(store["scores"][m]["teacher"]) for m in store["scores"]} == {"default": 4, "learned": 4, "global": 4}

    counter = Counter(monkeypatch)
    evaluate.main([*args, "--count", "10"])
    assert counter.sampled == 3 * 6 and counter.scored == 3 * 6
    for name in ("results.md", "scores.json", "scores.png", "schedules.png"):
        assert (out / name).stat().st_size > 0
    assert not list(out.glob("*.tmp"))

    # the table agrees with scores computed here on the same contexts
    _, learned_policy = evaluate.load_checkpoint(ckpt)
    _, global_policy = evaluate.load_checkpoint(global_ckpt)
    prompts, seeds = evaluate.heldout_contexts(backbone, 10)
    noise, cond = evaluate.context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    direct = {"default": backbone.default_times(STEPS).expand(10, -1),
              "learned": evaluate.policy_schedule(learned_policy, backbone)(noise, cond),
              "global": evaluate.policy_schedule(global_policy, backbone)(noise, cond)}
    means = read_table_means(out / "results.md")
    store = json.loads((out / "scores.json").read_text())
    for name, times in direct.items():
        scores = teacher(backbone.sample(noise, cond, times), prompts, noise, cond)
        assert means[name] == pytest.approx(scores.double().mean().item(), rel=1e-3)  # 4 significant digits
        stored = [store["scores"][name]["teacher"][evaluate.context_key(p, s)] for p, s in zip(prompts, seeds)]
        torch.testing.assert_close(torch.tensor(stored), scores)
        stored_times = [store["times"][name][evaluate.context_key(p, s)] for p, s in zip(prompts, seeds)]
        torch.testing.assert_close(torch.tensor(stored_times), times.float())

    # a rerun does nothing new; a larger --count only the new contexts
    counter = Counter(monkeypatch)
    evaluate.main([*args, "--count", "10"])
    assert (counter.sampled, counter.reward_calls) == (0, 0)
    counter = Counter(monkeypatch)
    evaluate.main([*args, "--count", "13", "--limit", "11"])
    assert (counter.sampled, counter.scored) == (3 * 1, 3 * 1)
    assert "| default | 11 |" in (out / "results.md").read_text()


def test_cli_refuses_scores_of_another_checkpoint_iteration(tmp_path, ckpt):
    out = str(tmp_path / "eval")
    evaluate.main(["--ckpt", ckpt, "--out-dir", out, "--count", "3"])
    newer = write_checkpoint(str(tmp_path / "newer.pt"), iteration=8)
    with pytest.raises(SystemExit, match="use another --out-dir"):
        evaluate.main(["--ckpt", newer, "--out-dir", out, "--count", "3"])


def test_cli_per_style_tables_from_an_hpdv2_folder(tmp_path, ckpt):
    folder = tmp_path / "benchmark"
    folder.mkdir()
    for index, style in enumerate(evaluate.HPDV2_STYLES):  # digit prompts stand in for the real ones
        (folder / f"{style}.json").write_text(json.dumps([f"a handwritten {index}", f"a handwritten {index + 4}"]))
    prompts, styles = evaluate.load_hpdv2(str(folder))
    assert prompts[:4] == [f"a handwritten {i}" for i in range(4)] and styles[:4] == list(evaluate.HPDV2_STYLES)
    evaluate.main(["--ckpt", ckpt, "--hpdv2", str(folder), "--out-dir", str(tmp_path / "eval")])
    report = (tmp_path / "eval" / "results.md").read_text()
    for style in evaluate.HPDV2_STYLES:
        assert f"### teacher, {style}\n\n| method | n |" in report
    assert "| learned | 2 |" in report and "| learned | 8 |" in report


@pytest.mark.parametrize("flag, value, message", [
    ("--steps", "5", "was trained for L=4 steps, not L=5"),
    ("--backbone", "sd35m", "was trained on backbone 'digits', not 'sd35m'"),
])
def test_mismatched_checkpoint_fails_before_loading_anything(monkeypatch, ckpt, flag, value, message):
    monkeypatch.setattr(rollout, "load_backbone", lambda *a, **k: pytest.fail("loaded a backbone"))
    with pytest.raises(SystemExit, match=message) as error:
        evaluate.main(["--ckpt", ckpt, flag, value])
    assert "\n" not in str(error.value)


def test_mismatched_global_checkpoint_and_missing_prompts(tmp_path, monkeypatch, ckpt):
    other = write_checkpoint(str(tmp_path / "global8.pt"), kind="global", steps=8)
    sd35m = write_checkpoint(str(tmp_path / "sd35m.pt"), backbone_name="sd35m")
    monkeypatch.setattr(rollout, "load_backbone", lambda *a, **k: pytest.fail("loaded a backbone"))
    with pytest.raises(SystemExit, match="global8.pt was trained for L=8 steps, not L=4"):
        evaluate.main(["--ckpt", ckpt, "--global-ckpt", other])
    with pytest.raises(SystemExit, match="HPDv2 test prompts not found .*`hf download zhwang/HPDv2"):
        evaluate.main(["--ckpt", ckpt, "--hpdv2", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="needs prompts: --hpdv2 DIR or --prompts FILE"):
        evaluate.main(["--ckpt", sd35m])
    with pytest.raises(SystemExit, match="unknown reward 'beauty'; known: teacher"):
        evaluate.main(["--ckpt", ckpt, "--rewards", "teacher,beauty"])
    with pytest.raises(SystemExit, match="--schnell is the reference for flux-dev"):
        evaluate.main(["--ckpt", ckpt, "--schnell"])


def test_cli_error_is_one_line_on_stderr(tmp_path, ckpt):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"), "--ckpt", ckpt, "--steps", "5"],
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"evaluate.py: error: {ckpt} was trained for L=4 steps, not L=5"]


# -----------------------------------------------------------------------------
# a real backbone family: tiny random Flux-Dev and Flux-Schnell pipelines


def tiny_flux_loader(name, path=None, device=None, dtype=None, resolution=None, guidance=None):
    """Stands in for rollout.load_backbone: the tiny pipelines of tests/test_rollout_diffusers.py."""
    from test_rollout_diffusers import RESOLUTION, tiny_flux

    return rollout.from_pipeline(tiny_flux(guidance_embeds=name == "flux-dev"), name=name, resolution=RESOLUTION,
                                 guidance=guidance)


def write_flux_checkpoint(path, steps=2):
    backbone = tiny_flux_loader("flux-dev")
    torch.manual_seed(0)
    policy = policy_lib.make_policy("instance", backbone.policy_dims, steps, init_times=backbone.default_times(steps))
    with torch.no_grad():
        policy.head[-1].weight.normal_(0.0, 0.3)
    config = dict(backbone="flux-dev", model_path=None, steps=steps, resolution=None, guidance=None, reward="teacher",
                  reward_checkpoint=None, seed=0, out_dir=os.path.dirname(path), dtype=None)
    torch.save(dict(policy=policy.state_dict(), policy_config=policy.config, optimizer={}, iteration=1, rng={},
                    metrics_rows=1, config=config), path)
    return path


def test_cli_on_tiny_flux_with_schnell_as_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(rollout, "load_backbone", tiny_flux_loader)
    monkeypatch.setattr(rewards, "load_reward", REAL_LOAD_REWARD)  # a teacher of the flux backbone, not the digits one
    ckpt = write_flux_checkpoint(str(tmp_path / "ckpt.pt"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na red house on a hill\na dog\n")
    out = tmp_path / "eval"
    evaluate.main(["--ckpt", ckpt, "--prompts", str(prompts), "--rewards", "teacher", "--schnell", "--out-dir", str(out),
                   "--batch-size", "2"])
    store = json.loads((out / "scores.json").read_text())
    assert list(store["scores"]) == ["default", "learned", "schnell-2", "schnell-4"]
    keys = [evaluate.context_key(p, 10**6 + i) for i, p in enumerate(["a cat", "a red house on a hill", "a dog"])]
    assert all(len(store["scores"][m]["teacher"]) == 3 for m in store["scores"])
    assert len(store["times"]["schnell-4"][keys[0]]) == 5 and len(store["times"]["learned"][keys[0]]) == 3

    # Flux-Schnell samples from Flux-Dev's noise with its own text encoding and 4 default steps
    dev, schnell = tiny_flux_loader("flux-dev"), tiny_flux_loader("flux-schnell")
    teacher = rewards.load_reward("teacher", dev)
    noise = evaluate.context_noise(dev, [10**6, 10**6 + 1, 10**6 + 2])
    texts = ["a cat", "a red house on a hill", "a dog"]
    latents = schnell.sample(noise, schnell.encode_prompts(texts), schnell.default_times(4).expand(3, -1))
    direct = teacher(latents, texts, noise, dev.encode_prompts(texts))
    torch.testing.assert_close(torch.tensor([store["scores"]["schnell-4"]["teacher"][k] for k in keys]), direct)
    report = (out / "results.md").read_text()
    assert "| schnell-4 | 3 |" in report and "| learned | 3 |" in report
