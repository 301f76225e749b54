"""
Paired evaluation of learned sampling schedules on held-out contexts.

Every method (the default schedule, the learned schedule at its Dirichlet mean, optionally a
learned global schedule, the teacher and, for Flux-Dev and mini-flux, their distilled Schnell
models) samples from the *same* initial noise for each context (prompt + seed), so differences are
paired: each row gives its mean and its paired difference to the default, with 95% Student-t
intervals. train.py's held-out curve and final table (eval.json) are computed here too.

CPU, the embedded digits backbone (after `python train.py`):
    python evaluate.py [--global-ckpt out/digits-L4-global-s0/ckpt.pt]
One GPU, HPSv2 and CLIP on the 3,200 HPDv2 test prompts (once: `hf download zhwang/HPDv2
--repo-type dataset --include "benchmark/*.json" --local-dir data/HPDv2`):
    python evaluate.py --ckpt out/sd35m-L10-instance-s0/ckpt.pt --hpdv2 data/HPDv2/benchmark
    python evaluate.py --ckpt out/flux-dev-L5-instance-s0/ckpt.pt --hpdv2 data/HPDv2/benchmark \
        --schnell --limit 400

Writes results.md (the tables, per style where the prompts have styles) and scores.json (every
score, per method, reward and context) into --out-dir (default: eval/ next to the checkpoint).
"""

import argparse
import contextlib
import json
import math
import os
import signal
import sys
from pickle import UnpicklingError

import torch
import torch.distributed as dist
from huggingface_hub import hf_hub_download
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm import tqdm

import backbones
import rewards as reward_lib
from comparator.tpdm import StepwisePolicy
from policy import GlobalPolicy, SchedulePolicy
from prompts import (
    HELDOUT_SEED,
    context_noise,
    heldout_contexts,
    load_hpdv2,
    load_prompt_file,
    noise_seed,
)

# the checkpoint of `python train.py` (its default --out-dir): evaluate.py's and sample.py's default
MAIN_RUN = os.path.join("out", "digits-L4-instance-s0", "ckpt.pt")
GAIN_CONTEXTS = 32  # held-out contexts of the gain logged at each checkpoint (heldout_gain)
# every policy kind (train.py's --policy), by the name its checkpoint records
POLICIES = {"instance": SchedulePolicy, "global": GlobalPolicy, "stepwise": StepwisePolicy}
# what reading a checkpoint that is missing, damaged or of another program raises
DAMAGED = EOFError, LookupError, OSError, RuntimeError, SafetensorError, UnpicklingError, ValueError


# ---- a trained policy, rebuilt from its checkpoint; the doors of evaluate.py and sample.py
def load_policy(source):
    """(policy on the CPU in eval mode, the configuration train.py trained it with) from a ckpt.pt,
    a policy/ folder or a Hub repository id; strict: every weight must match its network. A source
    whose first folder exists here is local: missing, it is a FileNotFoundError before any Hub call;
    damaged, a ValueError that names it."""
    local = os.path.exists(source.split("/")[0]) or source.count("/") != 1  # else user/name
    if local and not os.path.exists(source):
        raise FileNotFoundError(f"no checkpoint at {source}: train one with python train.py")
    try:
        if os.path.isfile(source):
            state = torch.load(source, map_location="cpu", weights_only=True)
            training = dict(state["config"], iteration=state["iteration"])
            arguments = dict(state["policy_config"], training_config=training)
            arguments, weights = dict(arguments, backbone=training["backbone"]), state["policy"]
        else:  # the Hub format (policy.save_policy): a policy/ folder or a Hub repository id
            paths = [os.path.join(source, name) for name in ("config.json", "model.safetensors")]
            if not os.path.isdir(source):  # a Hub repository id
                paths = [hf_hub_download(source, os.path.basename(path)) for path in paths]
            with open(paths[0]) as file:
                arguments, weights = json.load(file), load_file(paths[1])
        kind = arguments.get("kind", "instance" if "latent_channels" in arguments else "global")
        policy = POLICIES[kind](**arguments)
        policy.load_state_dict(weights)
    except DAMAGED as error:
        reason = f"{type(error).__name__}: {' '.join(str(error).split()).split('. ')[0]}"
        raise ValueError(f"cannot read a policy from {source}: {reason.rstrip(': ')}") from error
    training = policy.training_config or dict(backbone=policy.backbone, steps=policy.steps)
    return policy.eval(), training


def out_folder(args, name):
    """--out-dir, else `name` next to a local checkpoint (in the working folder for a hub id): the
    door's check that it is a folder, or one that can be made, where files can be written."""
    beside = os.path.dirname(os.path.abspath(args.ckpt)) if os.path.exists(args.ckpt) else "."
    out_dir = args.out_dir or os.path.join(beside, name)
    check_writable(out_dir)
    return out_dir


def check_writable(out_dir):
    """ValueError unless `out_dir` is a folder, or one that can be made, where files can be written
    (the doors of train.py, evaluate.py and sample.py)."""
    existing = os.path.abspath(out_dir)
    while not os.path.exists(existing):  # the nearest folder that exists: where it is made
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise ValueError(f"--out-dir {out_dir}: {existing} is not a folder that can be written")


def load_rewards(names, backbone, device, local):
    """name -> reward of each of `names` that loads (`local`: name -> its weights), else a note."""
    rewards = {}
    for name in names:
        try:
            rewards[name] = reward_lib.load_reward(name, backbone, device, local.get(name))
        except (ImportError, OSError, ValueError) as error:
            print(f"skipping reward {name}: {' '.join(str(error).split())}")
    return rewards


@contextlib.contextmanager
def one_line_errors(interrupted="interrupted"):
    """The handler at each command's entry (train.py, evaluate.py, sample.py, the studies): a
    user's input's error (a missing or damaged file, a refused value) or Ctrl-C (`interrupted`)
    ends in one `error:` line and exit status 1, not a traceback; under torchrun rank 0 says it.
    A bug's other exceptions keep theirs."""
    if hasattr(sys.stdout, "reconfigure"):  # a terminal's, not a captured stream
        sys.stdout.reconfigure(errors="backslashreplace")  # an ASCII terminal prints the ±
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # | head: end quietly
    try:
        yield
    except (OSError, ValueError, KeyboardInterrupt) as error:
        message = f"error: {' '.join(str(error).split()) or interrupted}"
        raise SystemExit(message if int(os.environ.get("RANK", "0")) == 0 else 1) from None


# ---- methods: callables (noise, cond) -> times (N, L+1), or (times, latents) when they sample
def policy_schedule(policy, backbone, draws=None):
    """A trained policy's schedule: its mean, or one draw from `draws` (TPDM's with its latents)."""
    return torch.no_grad()(lambda noise, cond: policy.schedule(backbone, noise, cond, draws))


def run_method(backbone, method, noise, cond):
    """(times, latents) of a method: its times run by the sampler, or what it sampled itself."""
    used = method(noise, cond)
    return used if isinstance(used, tuple) else (used, backbone.sample(noise, cond, used))


def fixed_schedule(times):
    """The same schedule times (L+1,) for every context."""
    return lambda noise, cond: times.to(noise.device).expand(noise.shape[0], -1)


def default_schedule(backbone, steps):
    return fixed_schedule(backbone.default_times(steps))


# ---- scores, paired
@torch.no_grad()
def score_table(
    backbone, rewards, prompts, seeds, methods, reference=None, batch_size=64, progress=False
):
    """Score contexts (prompts[i], seeds[i]) with every method (name -> method) and reward (name ->
    reward) on the same noise; `reference` names a row of backbone.reference (the teacher).
    Returns row -> column (each reward's metrics) -> Tensor (N,), and row -> times (N, L+1)."""
    samplers = {**methods, **({reference: None} if reference else {})}  # None: the teacher
    table, times = {}, {}
    for start in tqdm(range(0, len(prompts), batch_size), disable=None if progress else True):
        texts = prompts[start : start + batch_size]
        noise = context_noise(backbone, seeds[start : start + batch_size])
        cond = backbone.encode_prompts(texts)
        for name, method in samplers.items():
            if method is None:
                latents = backbone.reference(noise, cond)
            else:
                used, latents = run_method(backbone, method, noise, cond)
                times.setdefault(name, []).append(used.float().cpu())
            for reward_name, reward in rewards.items():  # for OCR and GenEval a second column
                columns = reward_lib.metrics(reward, reward_name, latents, texts, noise, cond)
                for column, values in columns.items():
                    table.setdefault(name, {}).setdefault(column, []).append(values)
    table = {name: {key: torch.cat(v) for key, v in row.items()} for name, row in table.items()}
    return table, {name: torch.cat(values) for name, values in times.items()}


def score_methods(
    backbone, reward, prompts, seeds, methods, reference=None, batch_size=64, progress=False
):
    """score_table for one reward: name -> Tensor (N,). Under torchrun each rank scores its share
    of the contexts (a contiguous block) and every rank gets all the scores, in order."""
    ranks, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    share = torch.arange(len(prompts)).tensor_split(ranks)[rank]
    mine = [prompts[i] for i in share], [seeds[i] for i in share]
    options = (methods, reference, batch_size, progress and rank == 0)
    table = score_table(backbone, {"reward": reward}, *mine, *options)
    scores = {name: columns["reward"].cpu() for name, columns in table[0].items()}
    if ranks > 1:
        parts = [None] * ranks
        dist.all_gather_object(parts, scores)
        names = dict.fromkeys(name for part in parts for name in part)
        scores = {name: torch.cat([part[name] for part in parts if name in part]) for name in names}
    return scores


def mean_ci(values):
    """(mean, 95% Student-t half-width) of a 1-D tensor; the half-width is nan for n < 2."""
    from scipy.stats import t as student_t  # scipy comes with scikit-learn

    values, n = values.double(), values.numel()
    if n < 2:
        return values.mean().item(), math.nan
    sem = (values.std() / math.sqrt(n)).item()
    return values.mean().item(), float(student_t.ppf(0.975, n - 1)) * sem


def summarize(scores):
    """One row per method: n, mean, ci95 (half-width of the 95% interval) and the paired difference
    to the default method on the same contexts (diff_mean, diff_ci95; None for the default)."""
    rows, default = [], scores.get("default")
    for name, values in scores.items():
        row = dict(method=name, n=values.numel(), diff_mean=None, diff_ci95=None)
        row["mean"], row["ci95"] = mean_ci(values)
        if default is not None and name != "default":
            assert values.shape == default.shape, "paired scores need the same contexts"
            row["diff_mean"], row["diff_ci95"] = mean_ci(values - default)
        if values.numel() < 2:  # one context has no interval: null in JSON, not NaN
            row["ci95"] = row["diff_ci95"] = None
        rows.append(row)
    return rows


def format_table(rows):
    """Markdown table of summarize()'s rows: mean ± 95% CI and paired difference ± 95% CI, each
    column with one number of decimals (4 significant digits of its largest entry)."""

    def column(*keys):  # value -> text with the decimals of this column
        values = [abs(row[key]) for row in rows for key in keys if row[key] not in (None, 0)]
        decimals = max(0, 3 - math.floor(math.log10(max(values)))) if values else 4
        return lambda value, sign="": "-" if value is None else f"{value:{sign}.{decimals}f}"

    mean, diff = column("mean", "ci95"), column("diff_mean", "diff_ci95")
    lines = ["| method | n | mean ± 95% CI | diff to default ± 95% CI |", "|---|---|---|---|"]
    for row in rows:
        paired = "-"
        if row["diff_mean"] is not None:
            paired = f"{diff(row['diff_mean'], '+')} ± {diff(row['diff_ci95'])}"
        lines.append(f"| {row['method']} | {row['n']} | {mean(row['mean'])} ± "
                     f"{mean(row['ci95'])} | {paired} |")  # fmt: skip
    return "\n".join(lines)


# ---- train.py's held-out curve and final report
def default_scores(backbone, reward, prompts, seeds, steps, batch_size=64):
    """The default schedule's scores on these contexts, computed once per backbone and reward (the
    studies in evidence/ train many policies on one)."""
    memo = backbone.__dict__.setdefault("default_scores", {})
    key = (reward, steps, tuple(prompts), tuple(seeds))  # the reward itself: no id reused
    if key not in memo:
        default = {"default": default_schedule(backbone, steps)}
        memo[key] = score_methods(backbone, reward, prompts, seeds, default, None, batch_size)
    return memo[key]["default"]


def heldout_gain(backbone, reward, heldout, steps, batch_size=64):
    """A function policy -> the mean paired gain of its mean schedule over the default on the first
    GAIN_CONTEXTS held-out contexts, the same at every checkpoint: train.py's curve."""
    prompts, seeds = (part[:GAIN_CONTEXTS] for part in heldout)
    default = default_scores(backbone, reward, prompts, seeds, steps, batch_size)

    def gain(policy):
        learned = {"learned": policy_schedule(policy, backbone)}
        scores = score_methods(backbone, reward, prompts, seeds, learned, None, batch_size)
        return (scores["learned"] - default).mean().item()

    return gain


def heldout_report(
    out_dir, backbone, reward, policy, contexts, reward_name, iteration, batch_size=64, realism=True
):
    """train.py's final table on its held-out contexts: the policy's mean schedule against the
    default, `batch_size` contexts per model call (train.py's --rollout-batch: the end of a run fits
    where its loop fits), split across torchrun's ranks; rank 0 prints it and writes eval.json
    (last, and whole: the studies in evidence/ take an existing one as a finished run). On a
    miniature the realism measure is added, unless `realism` is False."""
    prompts, seeds = contexts
    learned = {"learned (mean)": policy_schedule(policy, backbone)}
    teacher = "limit (teacher)" if reward_name == "teacher" else None  # the reward's target
    scores = score_methods(backbone, reward, prompts, seeds, learned, teacher, batch_size, True)
    default = default_scores(backbone, reward, prompts, seeds, policy.steps, batch_size)
    scores = dict(default=default, **scores)
    if dist.is_initialized() and dist.get_rank() > 0:
        return
    rows = summarize(scores)
    print(f"\nheld-out evaluation: {len(seeds)} contexts, reward {reward_name}, L = {policy.steps}")
    print(format_table(rows))
    report = dict(rows=rows, steps=policy.steps, contexts=len(seeds), reward=reward_name)
    report.update(iteration=iteration)
    if realism and backbones.BACKBONES[backbone.name].get("folder"):  # a miniature
        from miniatures.realism import realism_report

        methods = dict(default=default_schedule(backbone, policy.steps), **learned)
        report.update(realism_report(backbone, methods, prompts, seeds))
    path = os.path.join(out_dir, "eval.json")
    with open(path + ".tmp", "w") as file:
        json.dump(report, file)
    os.replace(path + ".tmp", path)


parser = argparse.ArgumentParser(description="Paired evaluation of learned sampling schedules.")
add = parser.add_argument
add("--ckpt", default=MAIN_RUN, help=f"train.py's ckpt.pt or policy/ folder (default: {MAIN_RUN})")
add("--global-ckpt", help="optional checkpoint of a global schedule (same backbone and L)")
add("--out-dir", help="output folder; default: eval/ next to --ckpt (a hub id: here)")
add("--prompts", help="prompt file (.txt, .json, .jsonl); default: the run's held-out prompts")
add("--hpdv2", nargs="?", const="hub", help="HPDv2 test prompts: folder of <style>.json, else hub")
add("--count", type=int, help="contexts (prompts cycled); default: the run's held-out count")
add("--seed", type=noise_seed, default=HELDOUT_SEED, help="context i uses noise seed SEED + i")
add("--limit", type=int, help="evaluate only the first N contexts (HPDv2: styles interleaved)")
add("--rewards", nargs="+", choices=list(reward_lib.REWARDS), metavar="NAME",
    help="default: the training reward (+ clip with hpsv2)")  # fmt: skip
add("--reward-checkpoint", action="append", default=[], metavar="NAME=PATH", help="local weights")
add("--reference", action="store_true", help="also score the teacher solution (backbone.reference)")
add("--schnell", action="store_true", help="flux-dev, mini-flux: add the distilled Schnell model")
add("--schnell-path", help="local Flux-Schnell folder; default: the hub cache or the miniature")
add("--batch-size", type=int, help="contexts per batch; default: the run's --rollout-batch")
add("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")


def main(argv=None):
    args = parser.parse_args(argv)
    # ---------------- the door ----------------
    for flag in ("count", "limit", "batch_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if any("=" not in item for item in args.reward_checkpoint):
        raise ValueError("--reward-checkpoint takes NAME=PATH")
    learned, config = load_policy(args.ckpt)
    steps, trained_on = config["steps"], config["backbone"]
    policies = {"learned": learned}
    if args.global_ckpt:
        policies["global"], global_config = load_policy(args.global_ckpt)
        run = policies["global"].config["kind"], global_config["backbone"], global_config["steps"]
        if run != ("global", trained_on, steps):
            raise ValueError(f"--global-ckpt is no global policy's run on {trained_on}, L={steps}")
    if args.schnell and trained_on not in backbones.DISTILLED:
        raise ValueError(f"--schnell is for {' and '.join(backbones.DISTILLED)}, not {trained_on}")
    prompt_list, styles = None, None  # styles group the tables: HPDv2's, a .jsonl's style or tag
    if args.hpdv2:
        prompt_list, styles = load_hpdv2(None if args.hpdv2 == "hub" else args.hpdv2)
    elif prompt_file := args.prompts or config["eval_prompts"]:
        prompt_list, styles = load_prompt_file(prompt_file, groups=True)
    out_dir = out_folder(args, "eval")
    local = {config["reward"]: config.get("reward_checkpoint")}  # reward -> its local weights
    local.update(item.split("=", 1) for item in args.reward_checkpoint)
    beside = ["clip"] if config["reward"] == "hpsv2" else []
    reward_names = args.rewards or [config["reward"], *beside]

    # ---------------- contexts, backbone, rewards ----------------
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    torch.set_num_threads(config.get("threads") or torch.get_num_threads())  # the run's
    backbone = backbones.trained_backbone(config, device)
    own = not (args.hpdv2 or args.prompts)  # train.py's held-out prompts: its count by default
    count = args.count or (config["eval_contexts"] if own else None)
    prompts, seeds = heldout_contexts(prompt_list or backbone.prompts, count, args.seed)
    styles = [styles[i % len(styles)] if styles else None for i in range(len(prompts))]
    prompts, seeds, styles = prompts[: args.limit], seeds[: args.limit], styles[: args.limit]
    backbone.keep_encoded(prompts)  # once, and the text encoders dropped, where the set fits
    rewards = load_rewards(reward_names, backbone, device, local)
    if not rewards:
        raise ValueError(f"none of the rewards {reward_names} loaded")

    # ---------------- score every method on the same contexts ----------------
    methods = {"default": default_schedule(backbone, steps)}
    methods |= {name: policy_schedule(p.to(device), backbone) for name, p in policies.items()}
    runs = [(backbone, methods, "reference" if args.reference else None)]
    if args.schnell:  # the same seeds give Flux-Schnell the same noise: its rows are paired too
        distilled = backbones.DISTILLED[trained_on]  # flux-schnell, or mini-flux-schnell
        options = dict(device=device, dtype=backbone.dtype, resolution=config["resolution"])
        schnell = backbones.load_backbone(distilled, path=args.schnell_path, **options)
        counts = sorted({4, steps})  # its distilled step count, and L
        runs.append((schnell, {f"schnell-{n}": default_schedule(schnell, n) for n in counts}, None))
    print(f"backbone {trained_on}, L={steps}, {len(prompts)} contexts, rewards {list(rewards)}")
    batch_size = args.batch_size or config.get("rollout_batch") or 256  # as its loop, or all
    tables, times = {}, {}  # column -> row -> Tensor (N,); row -> (N, L+1)
    for model, rows, reference in runs:
        table, used = score_table(model, rewards, prompts, seeds, rows, reference, batch_size, True)
        for name, columns in table.items():
            for column, values in columns.items():
                tables.setdefault(column, {})[name] = values
        times.update(used)

    # ---------------- write ----------------
    lines = [
        f"# Evaluation of {args.ckpt}\n\nbackbone {trained_on}, L = {steps} steps, {len(prompts)} "
        "contexts (prompt + noise seed), every method on the same noise. Mean ± half-width of the "
        "95% Student-t interval; diff = paired difference to the default schedule on the same "
        "contexts. Higher is better.\n"
    ]
    groups = sorted(set(styles) - {None})
    masks = {g: torch.tensor([g in (None, style) for style in styles]) for g in [None, *groups]}
    for column, scores in tables.items():
        for group, mask in masks.items():
            lines += [f"## {column}" + (f", {group}" if group else ""), ""]
            lines += [format_table(summarize({k: v[mask] for k, v in scores.items()})), ""]
        if groups:  # the mean of the groups' means: GenEval's overall score
            means = {row: [v[masks[g]].mean().item() for g in groups] for row, v in scores.items()}
            overall = ", ".join(f"{row} {sum(m) / len(m):.4g}" for row, m in means.items())
            lines += [f"mean over the {len(groups)} groups: {overall}", ""]
        print(f"\n{column}\n{format_table(summarize(scores))}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.md"), "w") as file:
        file.write("\n".join(lines))
    contexts = [dict(prompt=p, seed=s, style=g) for p, s, g in zip(prompts, seeds, styles)]
    scores = {name: {row: v.tolist() for row, v in rows.items()} for name, rows in tables.items()}
    stored = dict(contexts=contexts, scores=scores, times={k: v.tolist() for k, v in times.items()})
    with open(os.path.join(out_dir, "scores.json"), "w") as file:
        json.dump(stored, file)
    print(f"\nwrote {os.path.join(out_dir, 'results.md')} and scores.json")


if __name__ == "__main__":
    with one_line_errors():
        main()
