"""
The evidence behind the README's "Learned schedules" tables, on the embedded backbones: on the same
held-out contexts, the default schedule, the best time shift, the oracle schedules (best global, best
per prompt class, best per sub-population, best per context with hindsight), a learned global
schedule and learned instance-level schedules with each baseline, over several training seeds.

    python ablation.py --jobs 2                             # 3 backbones x 6 trainings x 3 seeds (about 75 minutes, 2 idle cores)
    python ablation.py --backbones digits-prompt --seeds 0  # one backbone, one seed of each training

Each training is `python train.py --backbone B --seed S [--baseline ...] [--policy global]` with that
backbone's defaults; runs already finished (their eval.json exists) and oracles already computed
(oracles.json) are read, not repeated, so an interrupted ablation resumes.

Oracles. The embedded backbones are exact and differentiable in the times, so the best schedule for a
set of contexts is found by gradient descent through the L-step sampler itself: times from a softmax
over L+1 increments, Adam on the mean teacher error. Global, per-class and per-sub-population
schedules are fitted on 1,000 training contexts (seeds apart from the held-out ones) and scored on the
held-out contexts; the per-context optimum is fitted on each held-out context itself (hindsight, no
policy can reach it). The sub-population of a context is the sign of its noise mean, which the
digits-noise sub-population a trajectory reaches follows for 97% of contexts.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from checkpoints import write_json_atomic
from policy import increments_from_times, times_from_increments
from prompts import HELDOUT_SEED, context_noise, heldout_contexts

parser = argparse.ArgumentParser(description="embedded backbones: oracles, baselines, global vs instance-level")
parser.add_argument("--out-dir", default="out/ablation", help="one folder per backbone and training below this")
parser.add_argument("--backbones", nargs="+", default=["digits", "digits-prompt", "digits-noise"])
parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds")
parser.add_argument("--steps", type=int, default=4, help="L")
parser.add_argument("--jobs", type=int, default=1, help="trainings run at the same time, one CPU thread each")
TRAININGS = {  # name -> train.py arguments
    "global, js": ["--baseline", "js", "--policy", "global"],
    "instance, js": ["--baseline", "js"],
    "instance, js, constant lr": ["--baseline", "js", "--lr-decay", "constant"],
    "instance, js-unbiased": ["--baseline", "js-unbiased"],
    "instance, rloo": ["--baseline", "rloo"],
    "instance, xctx": ["--baseline", "xctx"],
}
SHIFTS = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0]
FIT_SEED, FIT_CONTEXTS, HELDOUT_CONTEXTS = 2 * 10**6, 1000, 256  # oracles are fitted on these, reported on train.py's held-out set


def shifted(times, shift):
    """The time shift of SD3/Flux schedulers, t -> shift t / (1 + (shift - 1) t): > 1 spends more
    steps at high noise, < 1 more at low noise."""
    return shift * times / (1 + (shift - 1) * times)


def teacher_errors(backbone, contexts, times):
    """Per context, the mean squared distance of the L-step sample to the teacher: (N,)."""
    noise, cond, teacher = contexts
    return (backbone.sample(noise, cond, times) - teacher).square().flatten(1).mean(1)


def best_schedules(backbone, contexts, groups, steps, iterations, lr=0.05):
    """The schedule (G, L+1) of each group minimising its contexts' mean teacher error; groups (N,)
    holds each context's group in 0..G-1. Starts at the default schedule with a 5e-3 stop margin."""
    start = increments_from_times(backbone.default_times(steps).double())
    start[-1] = 5e-3
    logits = (start / start.sum()).log().repeat(int(groups.max()) + 1, 1).requires_grad_(True)  # (G, L+1)
    optimizer = torch.optim.Adam([logits], lr=lr)
    for _ in range(iterations):
        loss = teacher_errors(backbone, contexts, times_from_increments(torch.softmax(logits, -1))[groups]).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return times_from_increments(torch.softmax(logits.detach(), -1)).float()


def contexts(backbone, count, seed):
    """`count` contexts of the backbone's prompts from noise seed `seed` on, with their teacher."""
    prompts, seeds = heldout_contexts(backbone.prompts, count, seed)
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    return noise, cond, backbone.reference(noise, cond)


# the groups of contexts the oracles fit a schedule per: the prompt's class, the sign of the noise mean
GROUPINGS = {"class": lambda context: context[1]["label"], "sub-population": lambda context: (context[0].flatten(1).mean(1) > 0).long()}


def oracles(backbone, steps):
    """Teacher error on the held-out contexts of the default, the best shift and the oracle schedules,
    with the oracles' schedules."""
    fit, heldout = contexts(backbone, FIT_CONTEXTS, FIT_SEED), contexts(backbone, HELDOUT_CONTEXTS, HELDOUT_SEED)
    default = backbone.default_times(steps)
    with torch.no_grad():
        shift_errors = {s: teacher_errors(backbone, fit, shifted(default, s).expand(FIT_CONTEXTS, -1)).mean().item() for s in SHIFTS}
        best_shift = min(shift_errors, key=shift_errors.get)
    rows = {"default": default.expand(HELDOUT_CONTEXTS, -1), f"best time shift ({best_shift})": shifted(default, best_shift).expand(HELDOUT_CONTEXTS, -1)}
    schedules = {"global": best_schedules(backbone, fit, torch.zeros(FIT_CONTEXTS, dtype=torch.long), steps, 300)}
    rows["oracle: best global schedule"] = schedules["global"].expand(HELDOUT_CONTEXTS, -1)
    for name, group in GROUPINGS.items():
        schedules[name] = best_schedules(backbone, fit, group(fit), steps, 300)
        rows[f"oracle: best schedule per {name}"] = schedules[name][group(heldout)]
    rows["oracle: best schedule per context (hindsight)"] = best_schedules(backbone, heldout, torch.arange(HELDOUT_CONTEXTS), steps, 600)
    with torch.no_grad():
        errors = {name: teacher_errors(backbone, heldout, times).mean().item() for name, times in rows.items()}
    return dict(errors=errors, schedules={name: times.tolist() for name, times in schedules.items()})


@torch.no_grad()
def without_stop_margin(backbone, oracle, grouping):
    """The teacher error of the best per-group schedules with their stop margin t_L set to 0: how much
    the learnable margin is worth."""
    heldout = contexts(backbone, HELDOUT_CONTEXTS, HELDOUT_SEED)
    times = torch.tensor(oracle["schedules"][grouping])
    times[:, -1] = 0.0
    return teacher_errors(backbone, heldout, times[GROUPINGS[grouping](heldout)]).mean().item()


def train_run(backbone, name, seed, args):
    out_dir = os.path.join(args.out_dir, backbone, name.replace(", ", "-").replace(" ", "-"), f"seed{seed}")
    if not os.path.isfile(os.path.join(out_dir, "eval.json")):
        command = [sys.executable, "train.py", "--backbone", backbone, "--seed", str(seed), "--steps", str(args.steps),
                   "--out-dir", out_dir, *TRAININGS[name]]
        if os.path.isfile(os.path.join(out_dir, "ckpt.pt")):
            command.append("--resume")
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "train.log"), "w") as log:  # train.py's output, progress bars included
            subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=log,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(out_dir, "eval.json")) as file:
        return {row["method"]: row["mean"] for row in json.load(file)["rows"]}["learned (mean)"]


def plot(path, backbone, oracle, checkpoints):
    """The learned mean schedules per prompt class and per sub-population (instance-level, first seed)
    against the learned global schedule and the oracles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from checkpoints import load_checkpoint
    from evaluate import policy_schedule

    (_, instance), (_, global_policy) = load_checkpoint(checkpoints["instance, js"]), load_checkpoint(checkpoints["global, js"])
    prompts, seeds = heldout_contexts(backbone.prompts, HELDOUT_CONTEXTS)
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    times = policy_schedule(instance, backbone)(noise, cond)
    global_times = policy_schedule(global_policy, backbone)(noise[:1], cond)[0]
    groups = {"class": cond["label"], "sub-population": (noise.flatten(1).mean(1) > 0).long()}
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    steps = range(times.shape[1])
    for ax, (name, group) in zip(axes, groups.items()):
        for index, value in enumerate(group.unique().tolist()):
            label = f"digit {value}" if name == "class" else ("noise mean > 0" if value else "noise mean < 0")
            ax.plot(steps, times[group == value].mean(0), "-o", markersize=3, color=f"C{index}", label=f"learned, {label}")
            ax.plot(steps, torch.tensor(oracle["schedules"][name][value]), ":", color=f"C{index}")
        ax.plot(steps, global_times, "k-", linewidth=2, label="learned global")
        ax.plot(steps, torch.tensor(oracle["schedules"]["global"][0]), "k:", label="oracles (dotted)")
        ax.set(title=f"{backbone.name}: mean learned schedule per {name}", xlabel="step index l", xticks=list(steps))
        ax.legend(fontsize=6, ncol=2)
    axes[0].set_ylabel("time t_l (1 = noise, 0 = data)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(args):
    import rollout

    torch.set_num_threads(1)  # the embedded backbones' tensors are tiny
    runs = [(name, training, seed) for name in args.backbones for training in TRAININGS for seed in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:  # each training is its own process; the oracles are fitted meanwhile
        trainings = pool.map(lambda run: -train_run(*run, args), runs)
        oracle = {}
        for name in args.backbones:
            path = os.path.join(args.out_dir, name, "oracles.json")
            if not os.path.isfile(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_json_atomic(path, oracles(rollout.load_backbone(name), args.steps))
            with open(path) as file:
                oracle[name] = json.load(file)
        errors = dict(zip(runs, trainings))
    lines = []
    for name in args.backbones:
        learned = {training: [errors[name, training, seed] for seed in args.seeds] for training in TRAININGS}
        default, best_global = oracle[name]["errors"]["default"], oracle[name]["errors"]["oracle: best global schedule"]
        grouping = "sub-population" if name == "digits-noise" else "class"
        group = oracle[name]["errors"][f"oracle: best schedule per {grouping}"]
        lines += [f"\n{name}, L = {args.steps}, teacher error on {HELDOUT_CONTEXTS} held-out contexts, seeds {args.seeds}",
                  "| schedule | error (mean over seeds) | spread (min-max) | vs default | gap captured (spread) |", "|---|---|---|---|---|"]
        backbone = rollout.load_backbone(name)
        margin_free = without_stop_margin(backbone, oracle[name], grouping)
        oracle[name]["errors"][f"oracle: best schedule per {grouping}, with t_L = 0"] = margin_free
        for row, values in [*((row, [error]) for row, error in oracle[name]["errors"].items()), *((f"learned {t}", v) for t, v in learned.items())]:
            mean = statistics.mean(values)
            spread = f"{min(values):.5f}-{max(values):.5f}" if len(values) > 1 else "-"
            shares = [100 * (best_global - value) / (best_global - group) for value in values]
            captured = f"{statistics.mean(shares):.0f}% ({min(shares):.0f}-{max(shares):.0f}%)" if row.startswith("learned") else "-"
            lines.append(f"| {row} | {mean:.5f} | {spread} | {100 * (mean / default - 1):+.1f}% | {captured} |")
        lines.append(f"gap captured = (best global - learned) / (best global - best per {grouping}) on the same contexts")
        for seed, instance, glob in zip(args.seeds, learned["instance, js"], learned["global, js"]):
            lines.append(f"seed {seed}: learned instance-level (js) {100 * (1 - instance / glob):.1f}% below learned global")
        seed_dir = lambda training: os.path.join(args.out_dir, name, training.replace(", ", "-").replace(" ", "-"), f"seed{args.seeds[0]}", "ckpt.pt")
        plot(os.path.join(args.out_dir, name, "schedules.png"), backbone, oracle[name],
             {t: seed_dir(t) for t in ("instance, js", "global, js")})
    print("\n".join(lines))
    with open(os.path.join(args.out_dir, "results.md"), "w") as file:
        file.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(parser.parse_args())
