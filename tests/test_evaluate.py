"""evaluate.py on train.py's checkpoints: statistics, pairing, batching, the command line and
what it writes."""

import json
import math

import pytest
import torch

import backbones
import evaluate
import rewards
import rollout
from backbones import trained_backbone
from policy import load_policy
from prompts import HPDV2_STYLES, context_noise, heldout_contexts, load_hpdv2

STEPS = 4


@pytest.fixture(scope="module")
def backbone():
    return backbones.load_backbone("digits")


@pytest.fixture(scope="module")
def teacher(backbone):
    return rewards.load_reward("teacher", backbone)


class StandIn:
    """A GenEval-like reward whose per-image details are known: every image meets half of its
    requirements, and is correct when its prompt's digit is even."""

    def details(self, latents, prompts):
        return [dict(reward=0.5, correct=int(prompt[-1]) % 2 == 0) for prompt in prompts]


@pytest.fixture(autouse=True)
def shared_teacher(monkeypatch, teacher):
    """Every evaluate.main() call on digits gets the one teacher reward of this module: its cache of
    reference solves (the slow part) is filled once for the held-out contexts all tests share. The
    geneval reward is StandIn."""
    real_load_reward = rewards.load_reward

    def load_reward(name, chosen, *args, **kwargs):
        if name == "geneval":
            return StandIn()
        if name == "teacher" and chosen.name == "digits":
            return teacher
        return real_load_reward(name, chosen, *args, **kwargs)

    monkeypatch.setattr(rewards, "load_reward", load_reward)


@pytest.fixture(scope="module")
def ckpt(digits_run):
    return str(digits_run / "ckpt.pt")


def test_summarize_matches_hand_computed_values():
    scores = {
        "default": torch.tensor([1.0, 2.0, 3.0, 4.0]),
        "learned": torch.tensor([2.0, 2.0, 5.0, 5.0]),
    }
    default, learned = evaluate.summarize(scores)
    t3 = 3.182446305284263  # two-sided 95% Student-t quantile, 3 degrees of freedom
    # default: mean 2.5, sample variance 5/3; learned: mean 3.5, sample variance 3;
    # differences [1, 0, 2, 1]: mean 1, sample variance 2/3
    ci95 = [t3 * math.sqrt(variance / 4) for variance in (5 / 3, 3, 2 / 3)]
    assert (default["mean"], default["ci95"]) == pytest.approx((2.5, ci95[0]))
    assert default["diff_mean"] is None and default["diff_ci95"] is None
    assert (learned["mean"], learned["ci95"]) == pytest.approx((3.5, ci95[1]))
    assert (learned["diff_mean"], learned["diff_ci95"]) == pytest.approx((1.0, ci95[2]))
    table = evaluate.format_table([default, learned])
    assert "| default | 4 | 2.500 ± 2.054 | - |" in table  # one number of decimals per column
    assert "| learned | 4 | 3.500 ± 2.756 | +1.000 ± 1.299 |" in table
    small = dict(default, mean=0.003874, ci95=9.822e-05)  # no 9.822e-05 beside 0.003874
    assert "| default | 4 | 0.003874 ± 0.000098 | - |" in evaluate.format_table([small])


def test_scores_are_paired_and_whatever_the_batch(backbone, teacher, ckpt):
    """Each method gets each context's own noise, in batches, and a context's score is the same in
    any batch (the CLI test below checks the scores against a direct computation)."""
    policy, _ = load_policy(ckpt)
    prompts, seeds = heldout_contexts(backbone.prompts, 10)
    methods = dict(
        default=evaluate.default_schedule(backbone, STEPS),
        learned=evaluate.policy_schedule(policy, backbone),
    )
    seen = {name: [] for name in methods}  # the noise each method is called with, per batch

    def recording(name):
        def method(noise, cond):
            seen[name].append(noise.clone())
            return methods[name](noise, cond)

        return method

    scores = evaluate.score_methods(
        backbone, teacher, prompts, seeds, {name: recording(name) for name in methods}, batch_size=4
    )
    noise = torch.cat(
        [backbone.sample_noise(1, torch.Generator().manual_seed(seed)) for seed in seeds]
    )
    assert [len(batch) for batch in seen["default"]] == [4, 4, 2]
    torch.testing.assert_close(torch.cat(seen["default"]), noise, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(seen["learned"]), noise, rtol=0, atol=0)
    assert not torch.equal(scores["learned"], scores["default"])
    # in one batch, with the teacher's own solution, which has no error, as a reference
    whole = evaluate.score_methods(
        backbone, teacher, prompts, seeds, methods, reference="limit", batch_size=64
    )
    assert list(whole) == ["default", "learned", "limit"]
    for name in methods:
        torch.testing.assert_close(whole[name], scores[name])
    assert torch.all(whole["limit"] == 0) and torch.all(whole["default"] < 0)


def score_on_rank(rank, world_size, rendezvous, results):
    """One gloo rank of the split held-out scoring: the contexts it sampled and all the scores."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world_size)  # fmt: skip
    backbone, sampled = backbones.load_backbone("digits"), []
    default = evaluate.default_schedule(backbone, STEPS)
    counted = dict(default=lambda noise, cond: sampled.append(len(noise)) or default(noise, cond))
    prompts, seeds = heldout_contexts(backbone.prompts, 10)
    reward = rewards.load_reward("teacher", backbone)
    scores = evaluate.score_methods(backbone, reward, prompts, seeds, counted, "limit", 4)
    torch.save(dict(sampled=sampled, scores=scores), f"{results}-{rank}.pt")
    dist.destroy_process_group()


def test_held_out_scoring_is_split_across_ranks_and_gathered_in_order(tmp_path, backbone, teacher):
    """Under torchrun each rank samples its own block of the contexts (5 of 10 here, in chunks of
    4), and every rank gets the scores of all of them: one process's, to float32 rounding (its
    chunks of 4 hold other contexts together)."""
    results = str(tmp_path / "scores")
    args = (2, str(tmp_path / "rendezvous"), results)
    torch.multiprocessing.spawn(score_on_rank, args=args, nprocs=2)
    prompts, seeds = heldout_contexts(backbone.prompts, 10)
    default = evaluate.default_schedule(backbone, STEPS)
    alone = evaluate.score_methods(backbone, teacher, prompts, seeds, dict(default=default),
                                   "limit", 4)  # fmt: skip
    for rank in range(2):
        found = torch.load(f"{results}-{rank}.pt", weights_only=True)
        assert found["sampled"] == [4, 1]  # its 5 contexts, in chunks of 4
        assert list(found["scores"]) == ["default", "limit"]
        for name, values in alone.items():
            torch.testing.assert_close(found["scores"][name], values, rtol=1e-6, atol=1e-9)


# -----------------------------------------------------------------------------
# the command line


def read_table_means(path):
    """method -> mean of the first table in results.md."""
    means = {}
    for line in open(path).read().split("## ")[1].splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) == 4 and cells[1].isdigit():
            means[cells[0]] = float(cells[2].split("±")[0])
    return means


def test_cli_writes_the_table_and_every_score_of_every_method(
    tmp_path, backbone, teacher, ckpt, digits_global_run
):
    """results.md and scores.json agree with scores computed here on the same contexts; --limit
    keeps the first contexts of --count; a user's file in --out-dir is left as it was."""
    global_ckpt = str(digits_global_run / "ckpt.pt")
    out = tmp_path / "eval"
    out.mkdir()
    (out / "notes.txt").write_text("my notes\n")
    evaluate.main(
        ["--ckpt", ckpt, "--global-ckpt", global_ckpt, "--out-dir", str(out), "--batch-size", "4"]
        + ["--count", "13", "--limit", "10"]
    )
    learned_policy, _ = load_policy(ckpt)
    global_policy, _ = load_policy(global_ckpt)
    prompts, seeds = heldout_contexts(backbone.prompts, 10)
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    direct = {
        "default": backbone.default_times(STEPS).expand(10, -1),
        "learned": evaluate.policy_schedule(learned_policy, backbone)(noise, cond)[0],
        "global": evaluate.policy_schedule(global_policy, backbone)(noise, cond)[0],
    }
    means = read_table_means(out / "results.md")
    assert "| default | 10 |" in (out / "results.md").read_text()
    store = json.loads((out / "scores.json").read_text())
    assert store["contexts"] == [
        dict(prompt=prompt, seed=seed, style=None) for prompt, seed in zip(prompts, seeds)
    ]
    assert list(store["scores"]) == ["teacher"] and list(store["times"]) == list(direct)
    for name, times in direct.items():
        scores = teacher(backbone.sample(noise, cond, times), prompts, noise, cond)
        assert means[name] == pytest.approx(scores.double().mean().item(), rel=1e-3)  # 4 digits
        torch.testing.assert_close(torch.tensor(store["scores"]["teacher"][name]), scores)
        torch.testing.assert_close(torch.tensor(store["times"][name]), times.float())
    assert sorted(path.name for path in out.iterdir()) == ["notes.txt", "results.md", "scores.json"]
    assert (out / "notes.txt").read_text() == "my notes\n"


def test_default_contexts_are_those_of_train_table(tmp_path, digits_run, ckpt):
    evaluate.main(["--ckpt", ckpt, "--out-dir", str(tmp_path / "eval")])
    means = read_table_means(tmp_path / "eval" / "results.md")
    table = {
        row["method"]: row for row in json.loads((digits_run / "eval.json").read_text())["rows"]
    }
    assert "| default | 128 |" in (tmp_path / "eval" / "results.md").read_text()
    assert means["default"] == pytest.approx(table["default"]["mean"], rel=1e-3)
    assert means["learned"] == pytest.approx(table["learned (mean)"]["mean"], rel=1e-3)


def test_cli_per_style_tables_from_an_hpdv2_folder(tmp_path, ckpt):
    folder = tmp_path / "benchmark"
    folder.mkdir()
    for index, style in enumerate(HPDV2_STYLES):  # digit prompts stand in for the real ones
        (folder / f"{style}.json").write_text(
            json.dumps([f"a handwritten {index}", f"a handwritten {index + 4}"])
        )
    prompts, styles = load_hpdv2(str(folder))
    assert prompts[:4] == [f"a handwritten {i}" for i in range(4)]
    assert styles[:4] == list(HPDV2_STYLES)
    evaluate.main(["--ckpt", ckpt, "--hpdv2", str(folder), "--out-dir", str(tmp_path / "eval")])
    report = (tmp_path / "eval" / "results.md").read_text()
    for style in HPDV2_STYLES:
        assert f"## teacher, {style}\n\n| method | n |" in report
    assert "| learned | 2 |" in report and "| learned | 8 |" in report


def test_cli_on_tiny_flux_with_schnell_from_the_same_noise(tmp_path, monkeypatch, tiny_runs):
    runs, folder = tiny_runs
    monkeypatch.setattr(rollout.Backbone, "reference_steps", 4)  # the teacher as in training
    ckpt = str(runs["flux-dev"] / "ckpt.pt")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na red house on a hill\na dog\n")
    out = tmp_path / "eval"
    evaluate.main(
        ["--ckpt", ckpt, "--prompts", str(prompts), "--rewards", "teacher", "--schnell"]
        + ["--schnell-path", str(folder / "flux-schnell"), "--out-dir", str(out)]
        + ["--batch-size", "2"]
    )
    store = json.loads((out / "scores.json").read_text())
    scores = store["scores"]["teacher"]
    assert list(scores) == ["default", "learned", "schnell-2", "schnell-4"]
    texts = ["a cat", "a red house on a hill", "a dog"]
    assert [context["prompt"] for context in store["contexts"]] == texts
    assert all(len(values) == 3 for values in scores.values())
    assert len(store["times"]["schnell-4"][0]) == 5 and len(store["times"]["learned"][0]) == 3

    # Flux-Schnell samples from Flux-Dev's noise with its own text encoding and 4 default steps
    config = torch.load(ckpt, weights_only=True)["config"]
    dev = trained_backbone(config, "cpu")
    schnell = backbones.load_backbone(
        "flux-schnell", path=str(folder / "flux-schnell"), resolution=config["resolution"]
    )
    noise = context_noise(dev, [10**6, 10**6 + 1, 10**6 + 2])
    latents = schnell.sample(
        noise, schnell.encode_prompts(texts), schnell.default_times(4).expand(3, -1)
    )
    direct = rewards.load_reward("teacher", dev)(latents, texts, noise, dev.encode_prompts(texts))
    torch.testing.assert_close(torch.tensor(scores["schnell-4"]), direct)
    report = (out / "results.md").read_text()
    assert "| schnell-4 | 3 |" in report and "| learned | 3 |" in report


@pytest.mark.parametrize(
    "args, message",
    [
        (["--count", "0"], "--count must be at least 1"),
        (["--limit", "-1"], "--limit must be at least 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--reward-checkpoint", "teacher"], "--reward-checkpoint takes NAME=PATH"),
        (["--global-ckpt", "{ckpt}"], "--global-ckpt must be a run of --policy global at L = 4"),
        (["--schnell"], "--schnell is for flux-dev and mini-flux, not digits"),
        (["--seed", str(2**64)], "argument --seed: a seed is an integer from 0 to 2^63 - 1"),
        (["--ckpt", "out/none/ckpt.pt"], "no checkpoint at out/none/ckpt.pt: train one with"),
    ],
)
def test_bad_evaluate_input_is_refused_at_the_door(capsys, monkeypatch, ckpt, args, message):
    """Refused with the usage and one error line, before a backbone loads."""
    monkeypatch.setattr(
        backbones, "load_backbone", lambda *a, **k: pytest.fail("loaded a backbone")
    )
    with pytest.raises(SystemExit) as stop:
        evaluate.main(["--ckpt", ckpt, *(arg.replace("{ckpt}", ckpt) for arg in args)])
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: " + message in last


def test_second_columns_and_groups_of_a_fine_grained_reward(tmp_path, ckpt):
    prompts = tmp_path / "prompts.jsonl"
    rows = [dict(prompt=f"a handwritten {d}", tag="low" if d < 5 else "high") for d in range(10)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "eval"
    args = ["--ckpt", ckpt, "--prompts", str(prompts), "--rewards", "geneval"]
    evaluate.main([*args, "--out-dir", str(out)])
    report = (out / "results.md").read_text()

    def section(header):
        return report.split(f"## {header}\n")[1].split("##")[0]

    assert "| default | 10 | 0.5000 ±" in section("geneval correct")  # the even digits
    assert "| default | 5 | 0.4000 ±" in section(
        "geneval correct, high"
    )  # digits 5-9: 6 and 8 even
    assert "| default | 5 | 0.6000 ±" in section("geneval correct, low")  # digits 0-4: 0, 2 and 4
    assert "mean over the 2 groups: default 0.5," in section("geneval correct, low")  # GenEval's
    assert "| learned | 10 | 0.5000 ±" in section("geneval")


def test_cli_scores_a_stepwise_checkpoint(tmp_path, digits_stepwise_run):
    out = tmp_path / "eval"
    ckpt = str(digits_stepwise_run / "ckpt.pt")
    evaluate.main(["--ckpt", ckpt, "--out-dir", str(out), "--count", "6", "--batch-size", "4"])
    scores = json.loads((out / "scores.json").read_text())["scores"]["teacher"]
    assert {name: len(values) for name, values in scores.items()} == {"default": 6, "learned": 6}
    assert "| learned |" in (out / "results.md").read_text()


def test_the_heldout_report_calls_the_model_in_rollout_batch_chunks(tmp_path, tiny_runs):
    """The end of a run fits where its loop fits: in train.py's held-out report the frozen model
    sees at most --rollout-batch samples per call (the CFG pair doubles them), teacher included."""
    policy, config = load_policy(str(tiny_runs[0]["sd35m"] / "ckpt.pt"))
    backbone, seen = trained_backbone(config, torch.device("cpu")), []
    hook = backbone.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(len(kwargs["hidden_states"])), with_kwargs=True
    )
    reward = rewards.load_reward("teacher", backbone)
    prompts, seeds = heldout_contexts(["a red fox in snow", "a blue car"], 7)
    evaluate.heldout_report(tmp_path, backbone, reward, policy, (prompts, seeds), "teacher", 2, 3)
    hook.remove()
    assert backbone.cfg and max(seen) == 2 * 3 and 2 * 1 in seen  # chunks of 3, 3 and 1 contexts


def test_a_jsonl_of_plain_prompts_evaluates(tmp_path, ckpt):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(f"a handwritten {d}") + "\n" for d in range(3)))
    evaluate.main(["--ckpt", ckpt, "--prompts", str(prompts), "--out-dir", str(tmp_path / "eval")])
    assert "| learned | 3 |" in (tmp_path / "eval" / "results.md").read_text()
