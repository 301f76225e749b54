"""
The digits evidence behind the README's table: on the same held-out contexts, the default schedule,
the best hand-tuned global schedule (a grid over a time shift), a learned global schedule and learned
instance-level schedules with each baseline, over several seeds.

    python ablation.py                              # 3 seeds x 5 trainings, about 10 minutes on 2 CPU cores
    python ablation.py --seeds 0 --iterations 60    # a quick look

Each training is `python train.py` with the settings below; runs already finished (their eval.json
exists) are read, not repeated, so an interrupted ablation resumes.
"""

import argparse
import json
import os
import statistics

import train
from evaluate import evaluate, fixed_schedule
from prompts import heldout_contexts
from rewards import load_reward
from rollout import load_backbone

parser = argparse.ArgumentParser(description="digits ablation: baselines, global vs instance-level, shift grid")
parser.add_argument("--out-dir", default="out/ablation", help="one folder per training below this")
parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds")
parser.add_argument("--steps", type=int, default=4, help="L")
parser.add_argument("--iterations", type=int, default=None, help="policy updates per training (train.py's default)")
VARIANTS = {  # name -> train.py arguments
    "instance, js": ["--baseline", "js"],
    "instance, js-unbiased": ["--baseline", "js-unbiased"],
    "instance, rloo": ["--baseline", "rloo"],
    "instance, xctx": ["--baseline", "xctx"],
    "global, js": ["--baseline", "js", "--policy", "global"],
}
SHIFTS = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0]
VALIDATION_SEED = 2 * 10**6  # the shift is chosen on these contexts, reported on the held-out ones


def shifted(times, shift):
    """The time shift of SD3/Flux schedulers, t -> shift t / (1 + (shift - 1) t): > 1 spends more
    steps at high noise, < 1 more at low noise."""
    return shift * times / (1 + (shift - 1) * times)


def shift_grid(backbone, reward, steps, contexts):
    """Teacher reward of every shifted uniform schedule on validation contexts; the best shift."""
    prompts, seeds = heldout_contexts(backbone.prompts, contexts, seed=VALIDATION_SEED)
    uniform = backbone.default_times(steps)
    methods = {shift: fixed_schedule(shifted(uniform, shift)) for shift in SHIFTS}
    scores = evaluate(backbone, reward, prompts, seeds, methods)
    return max(SHIFTS, key=lambda shift: scores[shift].mean().item()), {s: scores[s].mean().item() for s in SHIFTS}


def main(args):
    results = {}  # method -> list over seeds of the held-out mean reward
    shares = []  # per iteration: share of time outside rollouts and rewards
    for seed in args.seeds:
        for name, extra in VARIANTS.items():
            out_dir = os.path.join(args.out_dir, name.replace(", ", "-"), f"seed{seed}")
            eval_path = os.path.join(out_dir, "eval.json")
            if not os.path.isfile(eval_path):
                argv = ["--out-dir", out_dir, "--seed", str(seed), "--steps", str(args.steps), *extra]
                if args.iterations is not None:
                    argv += ["--iterations", str(args.iterations)]
                train.main(train.parse_config(argv))
            with open(eval_path) as file:
                rows = {row["method"]: row for row in json.load(file)["rows"]}
            results.setdefault(name, []).append(rows["learned (mean)"]["mean"])
            default = rows["default"]["mean"]  # the same held-out contexts in every run
            with open(os.path.join(out_dir, "metrics.jsonl")) as file:
                metrics = [json.loads(line) for line in file]
            shares += [1 - row["rollout_s"] / row["step_s"] for row in metrics]

    backbone = load_backbone("digits")
    reward = load_reward("teacher", backbone)
    best, grid = shift_grid(backbone, reward, args.steps, contexts=256)
    prompts, seeds = heldout_contexts(backbone.prompts, 256)
    best_scores = evaluate(backbone, reward, prompts, seeds, {"shift": fixed_schedule(shifted(backbone.default_times(args.steps), best))})
    print("shift grid on validation contexts (mean teacher reward): " + ", ".join(f"{s}: {v:+.5f}" for s, v in grid.items()))

    table = [("default (uniform)", [default]), (f"best shift ({best}, global)", [best_scores["shift"].mean().item()])]
    table += [(f"learned {name}", values) for name, values in results.items()]
    lines = [
        f"digits, L = {args.steps}, teacher error (minus reward) on 256 held-out contexts, seeds {args.seeds}",
        "| schedule | error, mean over seeds | spread (min-max) | vs default |",
        "|---|---|---|---|",
    ]
    for name, values in table:
        errors = [-value for value in values]
        mean = statistics.mean(errors)
        lines.append(f"| {name} | {mean:.5f} | {min(errors):.5f}-{max(errors):.5f} | {100 * (mean / -default - 1):+.1f}% |")
    lines.append(f"\nshare of a training iteration outside rollouts and rewards: {100 * statistics.mean(shares):.1f}% (mean over all iterations)")
    print("\n".join(lines))
    with open(os.path.join(args.out_dir, "results.md"), "w") as file:
        file.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(parser.parse_args())
