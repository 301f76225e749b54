"""evaluate.py on train.py's checkpoints: statistics, pairing, batching, the command line and
what it writes; load_policy; a user's mistakes with evaluate.py, sample.py and toy_js.py."""

import functools
import json
import math
import shlex
import shutil

import pytest
import torch
from conftest import SCRIPTS

import backbones
import evaluate
import rewards
import rollout
from backbones import trained_backbone
from evaluate import load_policy
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
    scores = dict(
        default=torch.tensor([1.0, 2.0, 3.0, 4.0]), learned=torch.tensor([2.0, 2.0, 5.0, 5.0])
    )
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

    def recording(name, noise, cond):
        seen[name].append(noise.clone())
        return methods[name](noise, cond)

    recorded = {name: functools.partial(recording, name) for name in methods}
    scores = evaluate.score_methods(backbone, teacher, prompts, seeds, recorded, batch_size=4)
    noise = torch.cat([backbone.sample_noise(1, torch.Generator().manual_seed(s)) for s in seeds])
    assert [len(batch) for batch in seen["default"]] == [4, 4, 2]
    torch.testing.assert_close(torch.cat(seen["default"]), noise, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(seen["learned"]), noise, rtol=0, atol=0)
    assert not torch.equal(scores["learned"], scores["default"])
    # in one batch, with the teacher's own solution, which has no error, as a reference
    whole = evaluate.score_methods(backbone, teacher, prompts, seeds, methods, "limit", 64)
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
    prompts, seeds = heldout_contexts(backbone.prompts, 10)
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    direct = {
        "default": backbone.default_times(STEPS).expand(10, -1),
        "learned": evaluate.policy_schedule(load_policy(ckpt)[0], backbone)(noise, cond),
        "global": evaluate.policy_schedule(load_policy(global_ckpt)[0], backbone)(noise, cond),
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


def test_cli_per_style_tables_from_an_hpdv2_folder(tmp_path, ckpt):
    folder = tmp_path / "benchmark"
    folder.mkdir()
    for index, style in enumerate(HPDV2_STYLES):  # digit prompts stand in for the real ones
        pair = [f"a handwritten {index}", f"a handwritten {index + 4}"]
        (folder / f"{style}.json").write_text(json.dumps(pair))
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
    path, resolution = str(folder / "flux-schnell"), config["resolution"]
    schnell = backbones.load_backbone("flux-schnell", path=path, resolution=resolution)
    noise = context_noise(dev, [10**6, 10**6 + 1, 10**6 + 2])
    times = schnell.default_times(4).expand(3, -1)
    latents = schnell.sample(noise, schnell.encode_prompts(texts), times)
    direct = rewards.load_reward("teacher", dev)(latents, texts, noise, dev.encode_prompts(texts))
    torch.testing.assert_close(torch.tensor(scores["schnell-4"]), direct)
    report = (out / "results.md").read_text()
    assert "| schnell-4 | 3 |" in report and "| learned | 3 |" in report


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
    # digits 5-9: 6 and 8 even
    assert "| default | 5 | 0.4000 ±" in section("geneval correct, high")
    assert "| default | 5 | 0.6000 ±" in section("geneval correct, low")  # digits 0-4: 0, 2 and 4
    assert "mean over the 2 groups: default 0.5," in section("geneval correct, low")  # GenEval's
    assert "| learned | 10 | 0.5000 ±" in section("geneval")


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


def test_by_default_the_table_of_train_py_even_on_an_ascii_terminal(tmp_path, digits_run, ckpt):
    """With no flag but --ckpt, evaluate.py scores train.py's held-out contexts: its table is
    eval.json's. An ASCII terminal gets the tables' ± escaped, not a traceback."""
    ascii_stdout = "import sys; sys.stdout = open(1, 'w', encoding='ascii', closefd=False)"
    command = ["evaluate.py", "--ckpt", ckpt, "--out-dir", "eval"]
    result = SCRIPTS.run(command, tmp_path, ascii_stdout)
    assert result.returncode == 0 and "| default | 128 | " in result.stdout  # train.py's count
    assert "\\xb1" in result.stdout  # the tables' ±, escaped
    means = read_table_means(tmp_path / "eval" / "results.md")
    rows = json.loads((digits_run / "eval.json").read_text())["rows"]
    table = {row["method"]: row["mean"] for row in rows}
    assert means["default"] == pytest.approx(table["default"], rel=1e-3)
    assert means["learned"] == pytest.approx(table["learned (mean)"], rel=1e-3)


def test_a_weight_missing_from_a_checkpoint_is_an_error(digits_run, tmp_path):
    """load_policy is strict, for a ckpt.pt as for a policy folder (one load_state_dict; that both
    load the same policy: tests/test_pipeline.py): a missing weight is an error naming the file,
    not a silently fresh layer."""
    state = torch.load(digits_run / "ckpt.pt", weights_only=True)
    del state["policy"]["head.3.bias"]
    torch.save(state, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="ckpt.pt: RuntimeError: .*Missing key.*head.3.bias"):
        load_policy(str(tmp_path / "ckpt.pt"))


# -----------------------------------------------------------------------------
# a user's mistakes: one line, and nothing of the user's lost

BEFORE = "import backbones; backbones.load_backbone = None  # refused before a backbone loads"
CTRL_C = "import backbones, os; backbones.load_backbone = lambda *a, **k: os.kill(os.getpid(), 2)"
RUN = "out/digits-L4-instance-s0"  # evaluate.MAIN_RUN's folder: the scripts' default --ckpt
MISTAKES = [
    ("evaluate.py --ckpt garbage.pt", "cannot read a policy from garbage.pt", BEFORE),
    ("evaluate.py --ckpt truncated.pt", "from truncated.pt: RuntimeError: PytorchStream", BEFORE),
    ("evaluate.py --ckpt folder", "from folder: FileNotFoundError", BEFORE),
    ("evaluate.py --ckpt out/digits-L4-instance-s1", "no checkpoint at out/digits-L4-", BEFORE),
    ("evaluate.py --prompts empty.txt", "empty.txt holds no prompts", BEFORE),
    ("evaluate.py --prompts missing.txt", "No such file or directory: 'missing.txt'", BEFORE),
    ("evaluate.py --out-dir afile/eval", "--out-dir afile/eval:", BEFORE),
    ("evaluate.py --count 0", "--count must be at least 1", BEFORE),
    ("evaluate.py --reward-checkpoint teacher", "--reward-checkpoint takes NAME=PATH", BEFORE),
    (f"evaluate.py --global-ckpt {RUN}/ckpt.pt", "--global-ckpt is no global policy's", BEFORE),
    ("evaluate.py --global-ckpt noise.pt", "--global-ckpt is no global policy's run on", BEFORE),
    ("evaluate.py --schnell", "--schnell is for flux-dev and mini-flux, not digits", BEFORE),
    ("evaluate.py", "error: interrupted", CTRL_C),  # Ctrl-C
    ("sample.py --prompt 'a handwritten 12'", "got 'a handwritten 12'", ""),
    ("sample.py --out-dir afile", "--out-dir afile:", BEFORE),
    ("sample.py --batch-size 0", "--batch-size must be at least 1", BEFORE),
    ("sample.py --pipeline", "--pipeline needs a diffusers backbone", BEFORE),
    ("sample.py --ckpt {sd35m}", "backbone sd35m needs --prompt TEXT or --prompts FILE", BEFORE),
    (f"sample.py --ckpt {RUN}/policy --export s.json", "--export is for a global policy", BEFORE),
    ("toy_js.py --out-dir afile", "File exists: 'afile'", ""),
]


def user_files(folder):
    return {path: path.read_bytes() if path.is_file() else None for path in folder.rglob("*")}


@pytest.mark.parametrize("command, message, fault", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_users_mistake_ends_in_one_line_and_nothing_of_theirs_is_lost(
    request, tmp_path, digits_run, digits_global_run, command, message, fault
):
    """One `error:` line naming the file or flag, exit status 1; every file of the user's folder as
    it was and none added (s.json: --export is refused before it is opened). noise.pt: a global
    run of another backbone. A missing run folder under a folder here is no Hub id (offline)."""
    shutil.copytree(digits_run / "policy", tmp_path / RUN / "policy")
    shutil.copy(digits_run / "ckpt.pt", tmp_path / RUN)
    state = torch.load(digits_global_run / "ckpt.pt", weights_only=True)
    state["config"]["backbone"] = "digits-noise"
    torch.save(state, tmp_path / "noise.pt")
    whole = (tmp_path / RUN / "ckpt.pt").read_bytes()
    mine = {"truncated.pt": whole[: len(whole) // 2], "garbage.pt": bytes(range(256))}
    mine |= {"empty.txt": b"\n", "afile": b"mine\n", "s.json": b'{"mine": 1}\n'}
    for name, data in mine.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "folder").mkdir()
    if "{sd35m}" in command:  # a diffusers backbone: its prompts are for the user to give
        run = request.getfixturevalue("tiny_runs")[0]["sd35m"]
        command = command.replace("{sd35m}", str(run / "ckpt.pt"))
    before = user_files(tmp_path)
    result = SCRIPTS.run(shlex.split(command), tmp_path, fault)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and message in lines[0]
    assert user_files(tmp_path) == before
