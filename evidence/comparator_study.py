"""
The comparator TPDM as its own code trains it (comparator/tpdm.py, `--policy stepwise --optimizer
ppo`) against the paper's single-pass policy with James-Stein, on an embedded backbone and the
trained miniatures, with the one setting of TPDM's that cannot transfer, the learning rate, tuned on
training contexts.

    python -m evidence.comparator_study --jobs 2   # about 65 min on 2 idle cores
    python -m evidence.comparator_study --backbones mini-sd3 --seeds 0 --jobs 2   # a part of it

1. The learning rate of step-wise PPO, per backbone: each rate of RATES trains once (training seed
   TUNING_RUN), at that backbone's defaults otherwise, and is scored at its deterministic schedule
   on training prompts with noise seeds TUNING_SEED, TUNING_SEED + 1, ... (apart from the training
   seeds, 2^32 and up, and the held-out ones, 10^6 and up). The best mean reward wins; a best rate
   at the edge of the grid adds the next rate beyond it (at most EXTEND times).
2. Rows, seeds 0, 1, 2 each, `python train.py --backbone B --seed S [flags]` at the backbone's
   defaults (the same contexts, rollouts, iterations and model-call budget L), scored on train.py's
   own held-out contexts (eval.json): the default schedule; the single-pass policy with JS (the
   paper's method); step-wise PPO with TPDM's settings at the tuned rate; the step-wise policy under
   this project's REINFORCE with JS (this project's variant, TPDM's place in the loop), reading the
   sampler's state and prediction, and on the diffusers backbones the same reading the denoiser's
   hidden states, as TPDM does, which tells what it reads from how it is trained. Mean and 95%
   Student-t interval over seeds; the difference to the single-pass policy paired by seed.
The report goes to docs/RESULTS.md (section "comparator"); runs already finished are read.
"""

import argparse
import functools
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

import backbones
from evaluate import load_policy, policy_schedule, score_methods
from evidence.results import (
    commit,
    heldout_mean,
    interval,
    one_line_errors,
    record,
    run_training,
    this_commit_only,
)
from prompts import TUNING_SEED, heldout_contexts, load_prompt_file
from rewards import load_reward

STUDIED = ["digits-prompt", "mini-sd3", "mini-flux", "mini-sdxl"]
RATES = [3e-5, 1e-4, 3e-4]  # around REINFORCE's 3e-3 x comparator.tpdm.LR_FACTOR = 1e-4
RATE_STEP = 10**0.5  # between neighbours of the grid, and to an added rate
EXTEND = 2
WINDOW = 20  # iterations averaged for the training reward at the start and at the end
TUNING_RUN = 100  # the training seed of the tuning runs, apart from the compared seeds
TUNING_CONTEXTS = 256  # training prompts with tuning noise (prompts.TUNING_SEED)
SINGLE_ROW, PPO_ROW = "single-pass, JS (the paper's method)", "step-wise, PPO with TPDM's settings"
HIDDEN_ROW = "step-wise, REINFORCE with JS, hidden-state inputs"
ROWS = {  # name -> train.py flags; PPO's row gets --lr, tuned
    SINGLE_ROW: [],
    PPO_ROW: ["--policy", "stepwise", "--optimizer", "ppo"],
    "step-wise, REINFORCE with JS (this project's variant)": ["--policy", "stepwise"],
    HIDDEN_ROW: ["--policy", "stepwise", "--policy-inputs", "hidden"],
}


def rows(name):
    """The rows that run on backbone `name`: the hidden-state row needs a denoiser, which the
    embedded mixtures have not."""
    import backbones

    mixture = backbones.BACKBONES[name]["family"] == "mixture"
    return [row for row in ROWS if not (mixture and row == HIDDEN_ROW)]


parser = argparse.ArgumentParser(
    description="TPDM as its code trains it against the paper's policy"
)
add = parser.add_argument
add("--out-dir", default="out/comparator-study", help="one folder per backbone and training")
add("--backbones", nargs="+", default=STUDIED, help="embedded or mini-* backbones")
add("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds of the compared rows")
add("--jobs", type=int, default=1, help="trainings run at the same time, one CPU thread each")


def folder(args, name, row, seed, rate=None):
    label = row.split(",")[0] + ("-ppo" if row == PPO_ROW else "")
    label += "-hidden" if row == HIDDEN_ROW else ""
    label += f"-lr{rate:.3g}" if rate is not None else ""
    return os.path.join(args.out_dir, name, f"{label.replace(' ', '-')}-s{seed}")


def train(args, name, row, seed, rate=None):
    flags = ROWS[row] + (["--lr", f"{rate:.6g}"] if rate is not None else [])
    arguments = ["--backbone", name, "--seed", str(seed), *flags]
    return run_training(folder(args, name, row, seed, rate), arguments)


@functools.cache
def tuning_setup(name, reward_name):
    """The backbone, its reward and the tuning contexts (prompts, noise seeds), loaded once per
    backbone for all of its rates."""

    backbone = backbones.load_backbone(name)
    train_file = backbones.BACKBONES[name].get("prompts", [None])[0]
    prompts = load_prompt_file(train_file) if train_file else backbone.prompts
    return (
        backbone,
        load_reward(reward_name, backbone),
        *heldout_contexts(prompts, TUNING_CONTEXTS, TUNING_SEED),
    )


@torch.no_grad()
def tuning_score(args, name, rate):
    """The mean reward of a tuning run's deterministic schedule on the tuning contexts."""

    path = os.path.join(folder(args, name, PPO_ROW, TUNING_RUN, rate), "ckpt.pt")
    policy, config = load_policy(path)
    backbone, reward, prompts, seeds = tuning_setup(name, config["reward"])
    scores = score_methods(
        backbone, reward, prompts, seeds, {"learned": policy_schedule(policy, backbone)}
    )
    return scores["learned"].mean().item()


def tune(args, pool, name, pending):
    """The rate of best tuning score for `name` ({rate: score}, the chosen rate); `pending` holds
    the futures of the grid's runs, and a best rate at the grid's edge adds the next one."""
    path = os.path.join(args.out_dir, name, "tuning.json")
    scores = {}
    if os.path.isfile(path):
        with open(path) as file:
            scores = {float(rate): score for rate, score in json.load(file).items()}
    for extended in range(EXTEND + 1):
        for rate, future in pending.items():
            future.result()
            if rate not in scores:
                scores[rate] = tuning_score(args, name, rate)
        with open(path, "w") as file:
            json.dump({f"{rate:.6g}": score for rate, score in scores.items()}, file)
        best = max(scores, key=scores.get)
        rates = sorted(scores)
        if best not in (rates[0], rates[-1]) or extended == EXTEND:
            break
        beyond = best / RATE_STEP if best == rates[0] else best * RATE_STEP
        pending = {beyond: pool.submit(train, args, name, PPO_ROW, TUNING_RUN, beyond)}
    return scores, best


def training_reward(reports, part):
    """The training reward over the iterations `part` (a slice of metrics.jsonl's rows), averaged
    over the runs `reports`: did it rise?"""
    return statistics.mean(
        statistics.mean(row["reward"] for row in metrics[part]) for _, metrics in reports
    )


def main(args):

    started = commit()
    this_commit_only(args.out_dir)
    with ThreadPoolExecutor(args.jobs) as pool:
        grids = {
            name: {
                rate: pool.submit(train, args, name, PPO_ROW, TUNING_RUN, rate) for rate in RATES
            }
            for name in args.backbones
        }
        fixed = {
            (name, row, seed): pool.submit(train, args, name, row, seed)
            for name in args.backbones
            for row in rows(name)
            if row != PPO_ROW
            for seed in args.seeds
        }
        tuned, runs = {}, {}
        for name in args.backbones:
            tuned[name] = tune(args, pool, name, grids[name])
            for seed in args.seeds:
                runs[name, PPO_ROW, seed] = pool.submit(
                    train, args, name, PPO_ROW, seed, tuned[name][1]
                )
        runs.update(fixed)
        runs = {key: future.result() for key, future in runs.items()}

    lines = []
    for name in args.backbones:
        scores, rate = tuned[name]
        first, _ = runs[name, SINGLE_ROW, args.seeds[0]]
        realism = "realism" in first
        digits = 5 if first["reward"] == "teacher" else 3
        lines += [
            f"{name}, L = {first['steps']}, reward {first['reward']}; step-wise PPO's learning "
            f"rate on {TUNING_CONTEXTS} training contexts (training seed {TUNING_RUN}): "
            + ", ".join(f"{r:.3g}: {s:.{digits}f}" for r, s in sorted(scores.items()))
            + f"; chosen {rate:.3g}",
            "",
            "| schedule | held-out reward | minus single-pass (paired by seed) | "
            + ("Frechet distance | " if realism else "")
            + f"training reward, first -> last {WINDOW} iterations | s / iteration |",
            "|---|---|---|" + ("---|" if realism else "") + "---|---|",
        ]
        default = heldout_mean(first, "default")
        frechet = f" {first['realism']['default']['frechet']:.3f} |" if realism else ""
        lines.append(f"| default | {default:.{digits}f} | - |{frechet} - | - |")
        single = [heldout_mean(runs[name, SINGLE_ROW, seed][0]) for seed in args.seeds]
        for row in rows(name):
            reports = [runs[name, row, seed] for seed in args.seeds]
            values = [heldout_mean(report) for report, _ in reports]
            difference = "-"
            if row != SINGLE_ROW:
                difference = interval([v - s for v, s in zip(values, single)], digits)
            cells = [interval(values, digits), difference]
            if realism:
                cells.append(
                    interval([r["realism"]["learned (mean)"]["frechet"] for r, _ in reports], 3)
                )
            start = training_reward(reports, slice(None, WINDOW))
            end = training_reward(reports, slice(-WINDOW, None))
            cells.append(f"{start:.{digits}f} -> {end:.{digits}f}")
            seconds = statistics.mean(
                statistics.median(m["step_s"] for m in metrics) for _, metrics in reports
            )
            label = f"{row}, lr {rate:.3g}" if row == PPO_ROW else row
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {seconds:.2f} |")
        lines.append("")
    print("\n".join(lines))
    command = " ".join(["python -m evidence.comparator_study", *sys.argv[1:]])
    record("comparator", command, lines, at=started)


if __name__ == "__main__":
    with one_line_errors():
        main(parser.parse_args())
