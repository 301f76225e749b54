"""
The evidence on the embedded backbones (docs/RESULTS.md, section "embedded"): on the same
held-out contexts, the default schedule, the best time shift, the oracle schedules (best global,
best per prompt class, best per sub-population, best per context with hindsight), a learned global
schedule and learned instance-level schedules with each baseline, over several training seeds.

    # 3 backbones x 6 trainings x 3 seeds, about 75 min on 2 idle cores
    python -m evidence.ablation --jobs 2
    python -m evidence.ablation --backbones digits-xor --trainings "global, js" "instance, js" \
        --jobs 2
    python -m evidence.ablation --backbones digits-prompt --seeds 0  # one seed per training
    python -m evidence.ablation --miniatures --jobs 2  # the miniatures: L x 2 policies x 3 seeds
    python -m evidence.ablation --distilled --jobs 2  # learned schedules against the distilled one
    python -m evidence.ablation --backbones digits-prompt digits-noise --trainings "global, js" \
        "instance, js" "stepwise, js" "stepwise, ppo" --jobs 2  # the comparator TPDM
    python -m evidence.ablation --miniatures --backbones mini-sd3 --mini-steps 3 \
        --mini-trainings global instance stepwise "stepwise, ppo" --jobs 2

The miniatures (mini-sd3, mini-flux, mini-sdxl: trained real pipelines, miniatures/build.py) have no
exact oracle; their table holds, for L = 2, 3 and 4 on the same held-out contexts (held-out
paraphrases, fresh noise), the default schedule, the best time shift (picked on other contexts), the
learned global and instance-level schedules (JS, each miniature's defaults, three seeds), scored by
the preference reward, the classifier's accuracy, the realism measures (miniatures/realism.py) and
the teacher error, with the number of default steps that matches each row's reward and its
realism; it goes to docs/RESULTS.md, and the figure to docs/miniatures.png.

Each training is `python train.py --backbone B --seed S [--baseline ...] [--policy global]` with
that backbone's defaults; runs already finished (their eval.json exists) and oracles already
computed (oracles.json) are read, not repeated, so an interrupted ablation resumes.

Oracles. The embedded backbones are exact and differentiable in the times, so the best schedule for
a set of contexts is found by gradient descent through the L-step sampler itself: times from a
softmax over L+1 increments, Adam on the mean teacher error. Global, per-class and
per-sub-population schedules are fitted on 1,000 training contexts (seeds apart from the held-out
ones) and scored on the held-out contexts; the per-context optimum is fitted on each held-out
context itself (hindsight, no policy can reach it). The sub-population of a context is the sign of
its noise mean, which the digits-noise sub-population a trajectory reaches follows for 97% of
contexts.
"""

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

import backbones
from evaluate import default_schedule, fixed_schedule, load_policy, policy_schedule, score_table
from evidence.results import (
    REPOSITORY,
    commit,
    heldout_mean,
    interval,
    one_line_errors,
    record,
    run_training,
    this_commit_only,
    write_json_atomic,
)
from miniatures.data import prompt_lists
from miniatures.realism import realism_measure, realism_table
from policy import increments_from_times, times_from_increments
from prompts import HELDOUT_SEED, context_noise, heldout_contexts
from rewards import load_reward

DEFAULT_BACKBONES = ["digits", "digits-prompt", "digits-noise"]
parser = argparse.ArgumentParser(
    description="embedded backbones: oracles, baselines, global vs instance-level"
)
add = parser.add_argument
add("--out-dir", default="out/ablation", help="one folder per backbone and training below this")
add("--backbones", nargs="+", default=DEFAULT_BACKBONES)
add("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds")
add("--steps", type=int, default=4, help="L")
add(
    "--trainings",
    nargs="+",
    metavar="NAME",
    help="some of TRAININGS, e.g. 'global, js' (default: all but the stepwise ones)",
)
add("--jobs", type=int, default=1, help="trainings run at the same time, one CPU thread each")
add("--miniatures", action="store_true", help="the miniatures' evidence instead (L = 2, 3, 4)")
add("--mini-steps", type=int, nargs="+", default=[2, 3, 4], help="the miniatures' L")
add(
    "--distilled",
    action="store_true",
    help="mini-flux with learned schedules against the distilled mini-flux-schnell",
)
add(
    "--mini-trainings",
    nargs="+",
    metavar="NAME",
    help="of MINI_TRAININGS; default: global instance",
)

TRAININGS = {  # name -> train.py arguments
    "global, js": ["--baseline", "js", "--policy", "global"],
    "instance, js": ["--baseline", "js"],
    "instance, js, constant lr": ["--baseline", "js", "--lr-decay", "constant"],
    "instance, js-unbiased": ["--baseline", "js-unbiased"],
    "instance, rloo": ["--baseline", "rloo"],
    "instance, xctx": ["--baseline", "xctx"],
    # TPDM (comparator/tpdm.py): the step-wise policy, under this project's REINFORCE and under PPO
    "stepwise, js": ["--policy", "stepwise"],
    "stepwise, ppo": ["--policy", "stepwise", "--optimizer", "ppo"],  # TPDM's settings
}
SHIFTS = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0]
# oracles are fitted on these, reported on train.py's held-out set
FIT_SEED, FIT_CONTEXTS, HELDOUT_CONTEXTS = 2 * 10**6, 1000, 256


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
    logits = (start / start.sum()).log().repeat(int(groups.max()) + 1, 1)  # (G, L+1)
    logits.requires_grad_(True)
    optimizer = torch.optim.Adam([logits], lr=lr)
    for _ in range(iterations):
        loss = teacher_errors(
            backbone, contexts, times_from_increments(torch.softmax(logits, -1))[groups]
        ).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return times_from_increments(torch.softmax(logits.detach(), -1)).float()


def contexts(backbone, count, seed):
    """`count` contexts of the backbone's prompts from noise seed `seed` on, with their teacher."""
    prompts, seeds = heldout_contexts(backbone.prompts, count, seed)
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    return noise, cond, backbone.reference(noise, cond)


def contrast_sign(context):
    """1 where the noise is brighter in its top four rows than in its bottom four (digits-xor)."""
    rows = context[0].flatten(1)
    return (rows[:, :32].mean(1) > rows[:, 32:].mean(1)).long()


# the groups the oracles fit a schedule per: the prompt's class, the sign of the noise mean; on
# digits-xor also the digit's parity, the noise's top-bottom contrast and the two together
GROUPINGS = {
    "class": lambda context: context[1]["label"],
    "sub-population": lambda context: (context[0].flatten(1).mean(1) > 0).long(),
}
XOR_GROUPINGS = {
    "parity": lambda context: context[1]["label"] % 2,
    "noise contrast": contrast_sign,
    "(parity, noise contrast)": lambda context: (
        2 * (context[1]["label"] % 2) + contrast_sign(context)
    ),
}
# the grouping whose oracle "gap captured" measures against
GAP_GROUPING = {"digits-noise": "sub-population", "digits-xor": "(parity, noise contrast)"}


def groupings(name):
    return {**GROUPINGS, **(XOR_GROUPINGS if name == "digits-xor" else {})}


def oracles(backbone, steps):
    """Teacher error on the held-out contexts of the default, the best shift and the oracle
    schedules, with the oracles' schedules."""
    fit, heldout = (
        contexts(backbone, FIT_CONTEXTS, FIT_SEED),
        contexts(backbone, HELDOUT_CONTEXTS, HELDOUT_SEED),
    )
    default = backbone.default_times(steps)
    with torch.no_grad():
        shift_errors = {
            s: teacher_errors(backbone, fit, shifted(default, s).expand(FIT_CONTEXTS, -1))
            .mean()
            .item()
            for s in SHIFTS
        }
        best_shift = min(shift_errors, key=shift_errors.get)
    rows = {
        "default": default.expand(HELDOUT_CONTEXTS, -1),
        f"best time shift ({best_shift})": shifted(default, best_shift).expand(
            HELDOUT_CONTEXTS, -1
        ),
    }
    schedules = {
        "global": best_schedules(
            backbone, fit, torch.zeros(FIT_CONTEXTS, dtype=torch.long), steps, 300
        )
    }
    rows["oracle: best global schedule"] = schedules["global"].expand(HELDOUT_CONTEXTS, -1)
    for name, group in groupings(backbone.name).items():
        schedules[name] = best_schedules(backbone, fit, group(fit), steps, 300)
        rows[f"oracle: best schedule per {name}"] = schedules[name][group(heldout)]
    rows["oracle: best schedule per context (hindsight)"] = best_schedules(
        backbone, heldout, torch.arange(HELDOUT_CONTEXTS), steps, 600
    )
    with torch.no_grad():
        errors = {
            name: teacher_errors(backbone, heldout, times).mean().item()
            for name, times in rows.items()
        }
    return dict(
        errors=errors, schedules={name: times.tolist() for name, times in schedules.items()}
    )


@torch.no_grad()
def without_stop_margin(backbone, oracle, grouping):
    """The teacher error of the best per-group schedules with their stop margin t_L set to 0: how
    much the learnable margin is worth."""
    heldout = contexts(backbone, HELDOUT_CONTEXTS, HELDOUT_SEED)
    times = torch.tensor(oracle["schedules"][grouping])
    times[:, -1] = 0.0
    return (
        teacher_errors(backbone, heldout, times[groupings(backbone.name)[grouping](heldout)])
        .mean()
        .item()
    )


def seconds_per_iteration(out_dir):
    """The median wall time of one training iteration of a run (its metrics.jsonl's step_s)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as file:
        return statistics.median(json.loads(line)["step_s"] for line in file)


def run_dir(backbone, name, seed, args, steps=None):
    folder = os.path.join(args.out_dir, backbone, name.replace(", ", "-").replace(" ", "-"))
    return os.path.join(folder, f"seed{seed}" if steps is None else f"L{steps}-seed{seed}")


def train_run(backbone, name, seed, args, steps=None, trainings=TRAININGS):
    """One training (read when finished): its held-out mean reward at the learned schedule."""
    arguments = ["--backbone", backbone, "--seed", str(seed), "--steps", str(steps or args.steps)]
    out_dir = run_dir(backbone, name, seed, args, steps)
    report, _ = run_training(out_dir, arguments + trainings[name])
    return heldout_mean(report)


def plot(path, backbone, oracle, checkpoints):
    """The learned mean schedules per prompt class and per sub-population (instance-level, first
    seed) against the learned global schedule and the oracles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    instance = load_policy(checkpoints["instance, js"])[0]
    global_policy = load_policy(checkpoints["global, js"])[0]
    prompts, seeds = heldout_contexts(backbone.prompts, HELDOUT_CONTEXTS)
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    times = policy_schedule(instance, backbone)(noise, cond)
    global_times = policy_schedule(global_policy, backbone)(noise[:1], cond)[0]
    groups = {"class": cond["label"], "sub-population": (noise.flatten(1).mean(1) > 0).long()}
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    steps = range(times.shape[1])
    for ax, (name, group) in zip(axes, groups.items()):
        for index, value in enumerate(group.unique().tolist()):
            label = (
                f"digit {value}"
                if name == "class"
                else ("noise mean > 0" if value else "noise mean < 0")
            )
            ax.plot(
                steps,
                times[group == value].mean(0),
                "-o",
                markersize=3,
                color=f"C{index}",
                label=f"learned, {label}",
            )
            ax.plot(steps, torch.tensor(oracle["schedules"][name][value]), ":", color=f"C{index}")
        ax.plot(steps, global_times, "k-", linewidth=2, label="learned global")
        ax.plot(
            steps, torch.tensor(oracle["schedules"]["global"][0]), "k:", label="oracles (dotted)"
        )
        ax.set(
            title=f"{backbone.name}: mean learned schedule per {name}",
            xlabel="step index l",
            xticks=list(steps),
        )
        ax.legend(fontsize=6, ncol=2)
    axes[0].set_ylabel("time t_l (1 = noise, 0 = data)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -----------------------------------------------------------------------------
# the trained miniatures: a black-box pixel reward, no exact oracle

MINIATURES = ["mini-sd3", "mini-flux", "mini-sdxl"]
# default step counts to match a learned schedule
EQUIVALENT_STEPS = [*range(1, 13), 14, 16, 20, 25, 30, 40, 50]
# with each miniature's defaults (JS baseline)
MINI_TRAININGS = {
    "global": ["--policy", "global"],
    "instance": [],
    "stepwise": ["--policy", "stepwise"],
    "stepwise, ppo": ["--policy", "stepwise", "--optimizer", "ppo"],
}


def equivalent_steps(default_means, value):
    """The default step count whose mean score (higher is better) first reaches `value`, linearly
    interpolated between the counts of EQUIVALENT_STEPS; "> 50" when none does."""
    previous = None
    for steps, mean in default_means.items():
        if mean >= value:
            if previous is None:
                return f"{steps}"
            low, low_mean = previous
            return f"{low + (steps - low) * (value - low_mean) / (mean - low_mean):.1f}"
        previous = (steps, mean)
    return f"> {max(default_means)}"


TRAINING_STEPS = 3  # the miniatures' default L (train.py's MINIATURE)
# the learned instance policy's times averaged over training contexts: one schedule for all
AVERAGED = "learned instance, averaged into one schedule"
GAIN_FRECHET, GAIN_PRECISION = 1.05, 0.05  # a gain counts if realism stays within these


def default_flags(name, args):
    """What `python train.py --backbone NAME --seed S` (the default flags) reports on its own
    held-out contexts (eval.json): the paired gain over the default with its 95% interval, and
    whether its samples stay as realistic (Frechet distance at most 5% higher, precision at most
    0.05 lower)."""
    lines = []
    for seed in args.seeds:
        with open(
            os.path.join(run_dir(name, "instance", seed, args, TRAINING_STEPS), "eval.json")
        ) as file:
            report = json.load(file)
        learned = {row["method"]: row for row in report["rows"]}["learned (mean)"]
        before, after = report["realism"]["default"], report["realism"]["learned (mean)"]
        kept = (
            after["frechet"] <= GAIN_FRECHET * before["frechet"]
            and after["precision"] >= before["precision"] - GAIN_PRECISION
        )
        lines.append(
            f"- `python train.py --backbone {name} --seed {seed}` (default flags, L = "
            f"{report['steps']}): gain {learned['diff_mean']:+.3f} ± {learned['diff_ci95']:.3f} "
            f"(paired 95%); Frechet {before['frechet']:.3f} -> {after['frechet']:.3f}, precision "
            f"{before['precision']:.3f} -> {after['precision']:.3f}, recall {before['recall']:.3f}"
            f" -> {after['recall']:.3f}: realism {'kept' if kept else 'LOST'}"
        )
    return lines


def miniature_evidence(args):
    """For each miniature and L in --mini-steps, on the same held-out contexts: the default, the
    best time shift (chosen on other contexts), the learned global and instance-level schedules
    of each seed, and each instance policy's times averaged over training contexts into one
    schedule (what of its gain a single schedule keeps); scored by the preference reward, the
    classifier's accuracy, the realism measures (miniatures/realism.py) and the teacher error (minus
    the 50-step default solution's squared distance); the default step count that matches each row's
    reward, and the one that matches its realism. Writes the table to out_dir/results.md and to
    docs/RESULTS.md (section "miniatures")."""

    started = commit()
    selected = args.mini_trainings or ["global", "instance"]
    if not set(selected) <= set(MINI_TRAININGS) or "instance" not in selected:
        sys.exit(
            f"ablation.py: --mini-trainings takes names of {list(MINI_TRAININGS)}, with "
            f"'instance' among them; got {selected}"
        )
    this_commit_only(args.out_dir)
    runs = [
        (name, training, seed, steps)
        for name in args.backbones
        for steps in args.mini_steps
        for training in selected
        for seed in args.seeds
    ]

    def train(run):
        return train_run(*run[:3], args, steps=run[3], trainings=MINI_TRAININGS)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(train, runs))
    train_prompts, heldout_prompts = prompt_lists()
    prompts, seeds = heldout_contexts(heldout_prompts, HELDOUT_CONTEXTS)
    fit_prompts, fit_seeds = heldout_contexts(train_prompts, HELDOUT_CONTEXTS, FIT_SEED)
    measure = realism_measure()
    floor = measure.floor(HELDOUT_CONTEXTS)
    fair = []  # per miniature and L: the global row against the instance policy's single schedule
    lines, figure_policies = (
        [
            f"{HELDOUT_CONTEXTS} held-out contexts (held-out paraphrases, fresh noise) per row; "
            f"learned rows: mean over training seeds {args.seeds} (min to max in brackets), each "
            "trained with the miniature's defaults (JS baseline, preference reward). Real digits "
            f"against the reference at the same N: Frechet {floor['frechet']:.3f}, precision "
            f"{floor['precision']:.3f}, recall {floor['recall']:.3f}."
        ],
        {},
    )
    for name in args.backbones:
        backbone = backbones.load_backbone(name)
        fit_noise = context_noise(backbone, fit_seeds)
        fit_cond = backbone.encode_prompts(fit_prompts)
        rewards = {
            "preference": load_reward("preference", backbone),
            "teacher": load_reward("teacher", backbone),
        }
        preference_only = {"preference": rewards["preference"]}
        defaults = {n: default_schedule(backbone, n) for n in EQUIVALENT_STEPS}
        default_reward = {
            n: score["preference"].mean().item()
            for n, score in score_table(
                backbone, preference_only, prompts, seeds, defaults, batch_size=128
            )[0].items()
        }
        default_realism = realism_table(backbone, defaults, prompts, seeds, measure)
        minus_frechet = {n: -row["frechet"] for n, row in default_realism.items()}
        lines += [
            f"\n{name} (guidance {backbone.guidance})",
            "",
            "| L | schedule | preference reward | accuracy | Frechet distance | precision "
            "| recall | teacher error | default steps, same reward | default steps, same "
            "Frechet | s / iteration |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for steps in args.mini_steps:
            default = backbone.default_times(steps)
            shifts = {s: fixed_schedule(shifted(default, s)) for s in SHIFTS}
            fit = score_table(
                backbone, preference_only, fit_prompts, fit_seeds, shifts, batch_size=128
            )[0]
            best = max(SHIFTS, key=lambda s: fit[s]["preference"].mean().item())
            shift_row = f"best time shift (x{best})"
            methods = {"default": fixed_schedule(default), shift_row: shifts[best]}
            for training in selected:
                for seed in args.seeds:
                    policy = load_policy(
                        os.path.join(run_dir(name, training, seed, args, steps), "ckpt.pt")
                    )[0]
                    methods[f"learned {training}, seed {seed}"] = policy_schedule(policy, backbone)
                    figure_policies[name, training, seed, steps] = policy
                    if training == "instance":  # what of it one schedule for all contexts keeps
                        times = policy_schedule(policy, backbone)(fit_noise, fit_cond)
                        methods[f"{AVERAGED}, seed {seed}"] = fixed_schedule(times.mean(0))
            scores = score_table(backbone, rewards, prompts, seeds, methods, batch_size=128)[0]
            realism = realism_table(backbone, methods, prompts, seeds, measure)
            rows = {"default": ["default"], shift_row: [shift_row]}
            rows.update(
                {f"learned {t}": [f"learned {t}, seed {s}" for s in args.seeds] for t in selected}
            )
            rows[AVERAGED] = [f"{AVERAGED}, seed {s}" for s in args.seeds]
            paired = []  # learned global - instance averaged, per seed: is the global row fair?
            for row, members in rows.items():
                per_seed = {
                    column: [scores[m][column].mean().item() for m in members]
                    for column in ("preference", "digit accuracy", "teacher")
                }
                per_seed.update(
                    {key: [realism[m][key] for m in members] for key in realism[members[0]]}
                )

                def cell(column, digits=3, sign=1):
                    values = [sign * v for v in per_seed[column]]
                    spread = f" ({min(values):.{digits}f} to {max(values):.{digits}f})"
                    mean = f"{statistics.mean(values):.{digits}f}"
                    return mean + (spread if len(values) > 1 else "")

                seconds = "-"
                if row[len("learned ") :] in selected:  # a trained row: its runs' timing
                    folders = [run_dir(name, row[8:], s, args, steps) for s in args.seeds]
                    seconds = f"{statistics.mean(map(seconds_per_iteration, folders)):.2f}"
                reward = statistics.mean(per_seed["preference"])
                frechet = statistics.mean(per_seed["frechet"])
                lines.append(
                    f"| {steps} | {row} | {cell('preference')} | {cell('digit accuracy')} | "
                    f"{cell('frechet')} | {cell('precision')} | {cell('recall')} | "
                    f"{cell('teacher', 4, -1)} | {equivalent_steps(default_reward, reward)} | "
                    f"{equivalent_steps(minus_frechet, -frechet)} | {seconds} |"
                )
                if row in ("learned global", AVERAGED):
                    paired.append((per_seed["preference"], per_seed["frechet"]))
            if len(paired) == 2 and len(args.seeds) > 1:
                (reward_g, frechet_g), (reward_a, frechet_a) = paired
                fair.append(
                    f"- {name}, L = {steps}: learned global - instance averaged into one schedule, "
                    f"paired by seed: preference "
                    f"{interval([g - a for g, a in zip(reward_g, reward_a)])}, Frechet "
                    f"{interval([g - a for g, a in zip(frechet_g, frechet_a)])}"
                )
        lines += ["", *default_flags(name, args)] if TRAINING_STEPS in args.mini_steps else []
        lines += [
            "",
            "default schedule by step count, preference reward: "
            + ", ".join(f"{n}: {m:.3f}" for n, m in default_reward.items()),
            "",
            "default schedule by step count, Frechet distance: "
            + ", ".join(f"{n}: {-m:.3f}" for n, m in minus_frechet.items()),
        ]
    if fair:
        lines += [
            "",
            "Is the global row fair (at least the instance policy's single schedule)?",
            "",
        ]
        lines += fair
    if {2, 3} <= set(args.mini_steps):
        figure = os.path.join(REPOSITORY, "docs", "miniatures.png")
        plot_miniatures(figure, args.backbones, figure_policies, args.seeds[0])
    print("\n".join(lines))
    with open(os.path.join(args.out_dir, "results.md"), "w") as file:
        file.write("\n".join(lines) + "\n")
    command = " ".join(["python -m evidence.ablation", *sys.argv[1:]])
    record("miniatures", command, lines, at=started)


@torch.no_grad()
def plot_miniatures(path, names, policies, seed, digits=(0, 2, 3, 5, 7, 8)):
    """The same noises sampled with the default and the learned instance-level schedule at L = 2 and
    3, and with 50 default steps, for each miniature (a held-out paraphrase per digit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = ["default, L=2", "learned, L=2", "default, L=3", "learned, L=3", "default, 50 steps"]
    figure, axes = plt.subplots(
        len(digits),
        len(names) * len(columns),
        figsize=(1.1 * len(names) * len(columns), 1.2 * len(digits) + 0.6),
    )
    for panel, name in enumerate(names):
        backbone = backbones.load_backbone(name)
        prompts = [f"a hand-drawn {d}" for d in digits]
        noise = context_noise(backbone, [HELDOUT_SEED + 7 * d for d in digits])
        cond = backbone.encode_prompts(prompts)
        times = {}
        for steps in (2, 3):
            times[f"default, L={steps}"] = backbone.default_times(steps).expand(len(digits), -1)
            times[f"learned, L={steps}"] = policy_schedule(
                policies[name, "instance", seed, steps], backbone
            )(noise, cond)
        times["default, 50 steps"] = backbone.default_times(50).expand(len(digits), -1)
        for column, label in enumerate(columns):
            images = backbone.decode(backbone.sample(noise, cond, times[label]))
            for row in range(len(digits)):
                ax = axes[row, panel * len(columns) + column]
                ax.imshow(images[row].permute(1, 2, 0).numpy(), interpolation="nearest")
                ax.set_xticks([]), ax.set_yticks([])
                if row == 0:
                    ax.set_title(f"{name}\n{label}" if column == 0 else label, fontsize=6)
                if panel == 0 and column == 0:
                    ax.set_ylabel(prompts[row], fontsize=5)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)


# -----------------------------------------------------------------------------
# the paper's "Flux-Dev with a learned schedule against Flux-Schnell", in miniature

# the step budgets L of the learned JS schedules: mini-flux as the paper's Flux-Dev, and, beyond the
# paper, mini-flux-schnell itself (does a learned schedule help a few-step model too?)
DISTILLED_STEPS = {"mini-flux": [2, 3, 4, 5], "mini-flux-schnell": [2, 3, 4]}
REFERENCE_STEPS = 50  # mini-flux's converged samples, the distillation's teacher


def headline(member, column):
    """A method's preference reward (the mean over contexts) or its realism measure `column`."""
    return member[column].mean().item() if column == "preference" else member[column]


def distilled_comparison(args):
    """mini-flux with its default schedule and with the learned JS schedule (train.py's defaults
    with --steps L, each seed), against mini-flux-schnell at its default, at each L of
    DISTILLED_STEPS, and mini-flux-schnell with its own learned JS schedule; all on the same
    held-out contexts and noises (the two models draw the same initial latents). Scored by the
    preference reward, the classifier's accuracy and the realism measures
    (miniatures/realism.py); the share of the gap between mini-flux's default and
    mini-flux-schnell that the learned schedule closes, and the paired difference to
    mini-flux-schnell per context. Writes docs/RESULTS.md (section "distilled") and
    docs/distilled.png."""

    started = commit()
    this_commit_only(args.out_dir)
    runs = [
        (name, "instance", seed, steps)
        for name, budgets in DISTILLED_STEPS.items()
        for steps in budgets
        for seed in args.seeds
    ]
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda run: train_run(*run[:3], args, run[3], MINI_TRAININGS), runs))
    prompts, seeds = heldout_contexts(prompt_lists()[1], HELDOUT_CONTEXTS)
    measure = realism_measure()
    models = {name: backbones.load_backbone(name) for name in DISTILLED_STEPS}
    policies = {
        run: load_policy(os.path.join(run_dir(*run[:3], args, run[3]), "ckpt.pt"))[0]
        for run in runs
    }

    def measured(name, methods):  # row -> per-context scores and realism of each method
        backbone = models[name]
        reward = {"preference": load_reward("preference", backbone)}
        scores = score_table(backbone, reward, prompts, seeds, methods, batch_size=128)[0]
        realism = realism_table(backbone, methods, prompts, seeds, measure)
        return {row: dict(scores[row], **realism[row]) for row in methods}

    def cells(members):  # one method, or the same method over seeds: mean ± interval per column
        per_context = ("preference", "digit accuracy")
        if len(members) == 1:  # a fixed schedule: the interval over contexts
            only = members[0]
            return [interval(only[column]) for column in per_context] + [
                f"{only[key]:.3f}" for key in ("frechet", "precision", "recall")
            ]
        columns = [[m[column].mean().item() for m in members] for column in per_context]
        columns += [[m[key] for m in members] for key in ("frechet", "precision", "recall")]
        return [interval(values) for values in columns]

    floor = measure.floor(HELDOUT_CONTEXTS)
    flux, schnell = "mini-flux", "mini-flux-schnell"
    lines = [
        f"{HELDOUT_CONTEXTS} held-out contexts (held-out paraphrases, fresh noise), the same "
        "noises for every row. Fixed schedules: mean ± 95% interval over the contexts; learned "
        "rows (`python train.py --backbone B --steps L --seed S`, the miniature's defaults: JS "
        "baseline, preference reward, 200 iterations): mean ± 95% Student-t interval over seeds "
        f"{args.seeds}. Real digits against the reference at the same N: Frechet "
        f"{floor['frechet']:.3f}, precision {floor['precision']:.3f}, recall "
        f"{floor['recall']:.3f}.",
        "",
        "| L | model, schedule | preference reward | accuracy | Frechet distance | precision "
        "| recall |",
        "|---|---|---|---|---|---|---|",
    ]
    reference = measured(flux, {"reference": default_schedule(models[flux], REFERENCE_STEPS)})
    lines.append(
        f"| {REFERENCE_STEPS} | {flux}, default | "
        + " | ".join(cells([reference["reference"]]))
        + " |"
    )
    summary, figure_policies = [], {}
    for steps in sorted({L for budgets in DISTILLED_STEPS.values() for L in budgets}):
        rows = {}
        for name in DISTILLED_STEPS:
            methods = {"default": default_schedule(models[name], steps)}
            trained = [run for run in runs if run[0] == name and run[3] == steps]
            for run in trained:
                methods[f"learned, seed {run[2]}"] = policy_schedule(policies[run], models[name])
                figure_policies[name, steps, run[2]] = policies[run]
            scored = measured(name, methods)
            rows[f"{name}, default"] = [scored["default"]]
            if trained:
                rows[f"{name}, learned JS"] = [scored[f"learned, seed {run[2]}"] for run in trained]
        for row, members in rows.items():
            lines.append(f"| {steps} | {row} | " + " | ".join(cells(members)) + " |")
        # the gap between mini-flux's default and the distilled model, the share of it the
        # learned schedule closes (per seed), and the paired differences per context
        default, distilled = rows[f"{flux}, default"][0], rows[f"{schnell}, default"][0]
        learned = rows[f"{flux}, learned JS"]
        for column, better in (("preference", 1), ("frechet", -1)):  # higher, lower is better
            ahead = better * (headline(distilled, column) - headline(default, column))
            shares = [
                100 * better * (headline(m, column) - headline(default, column)) / ahead
                for m in learned
            ]
            closes = (
                f"the learned schedule closes {statistics.mean(shares):.0f}% of the gap (seeds: "
                + ", ".join(f"{share:.0f}%" for share in shares)
                + ")"
                if ahead > 0
                else f"{schnell} is not ahead of {flux}'s default"
            )
            summary.append(
                f"- L = {steps}, {column}: {flux} default {headline(default, column):.3f}, "
                f"learned {statistics.mean(headline(m, column) for m in learned):.3f}, {schnell} "
                f"{headline(distilled, column):.3f}: {closes}"
            )
        paired = torch.stack([m["preference"] for m in learned]).mean(0) - distilled["preference"]
        summary.append(
            f"- L = {steps}, preference reward per context, paired (seeds averaged): learned "
            f"{flux} - {schnell} default {interval(paired)}"
        )
        if f"{schnell}, learned JS" in rows:  # does a learned schedule help the distilled model?
            own = rows[f"{schnell}, learned JS"]
            paired = torch.stack([m["preference"] for m in own]).mean(0) - distilled["preference"]
            summary.append(
                f"- L = {steps}, preference reward per context, paired (seeds averaged): learned "
                f"{schnell} - {schnell} default {interval(paired)}"
            )
        for name in DISTILLED_STEPS:  # where the learned schedules put their steps
            backbone = models[name]
            learned_runs = [run for run in runs if run[0] == name and run[3] == steps]
            if learned_runs:
                noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
                times = [policy_schedule(policies[r], backbone)(noise, cond) for r in learned_runs]
                summary.append(
                    f"- L = {steps}, {name}: learned times (mean over contexts and seeds) "
                    + ", ".join(f"{t:.3f}" for t in torch.cat(times).mean(0).tolist())
                    + "; default "
                    + ", ".join(f"{t:.3f}" for t in backbone.default_times(steps).tolist())
                )
    plot_distilled(
        os.path.join(REPOSITORY, "docs", "distilled.png"),
        models,
        figure_policies,
        args.seeds[0],
    )
    lines += ["", *summary]
    print("\n".join(lines))
    record("distilled", " ".join(["python -m evidence.ablation", *sys.argv[1:]]), lines, at=started)


@torch.no_grad()
def plot_distilled(path, models, policies, seed, digits=(0, 2, 3, 5, 7, 8)):
    """The same noises under mini-flux's default and learned schedule and mini-flux-schnell's
    default (and learned) schedule at L = 2, 3 and 4, beside mini-flux's 50 default steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = [f"a hand-drawn {d}" for d in digits]
    seeds = [HELDOUT_SEED + 7 * d for d in digits]
    columns = [("mini-flux", REFERENCE_STEPS, None)]
    for steps in (2, 3, 4):
        columns += [("mini-flux", steps, None), ("mini-flux", steps, "learned")]
        columns += [("mini-flux-schnell", steps, None), ("mini-flux-schnell", steps, "learned")]
    figure, axes = plt.subplots(
        len(digits), len(columns), figsize=(0.9 * len(columns), 1.0 * len(digits) + 0.8)
    )
    for column, (name, steps, learned) in enumerate(columns):
        backbone = models[name]
        noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
        times = backbone.default_times(steps).expand(len(digits), -1)
        if learned:
            times = policy_schedule(policies[name, steps, seed], backbone)(noise, cond)
        images = backbone.decode(backbone.sample(noise, cond, times))
        label = f"{name}\n{learned or 'default'}, L={steps}"
        for row in range(len(digits)):
            ax = axes[row, column]
            ax.imshow(images[row].permute(1, 2, 0).numpy(), interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            if row == 0:
                ax.set_title(label, fontsize=5)
            if column == 0:
                ax.set_ylabel(prompts[row], fontsize=5)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)


def main(args):

    started = commit()

    torch.set_num_threads(1)  # the embedded backbones' tensors are tiny
    selected = args.trainings or [name for name in TRAININGS if not name.startswith("stepwise")]
    unknown = [name for name in selected if name not in TRAININGS]
    if unknown or not {"global, js", "instance, js"} <= set(selected):
        sys.exit(
            f"ablation.py: --trainings takes names of {list(TRAININGS)}, with 'global, js' "
            f"and 'instance, js' among them; got {selected}"
        )
    this_commit_only(args.out_dir)
    runs = [
        (name, training, seed)
        for name in args.backbones
        for training in selected
        for seed in args.seeds
    ]
    # each training is its own process; the oracles are fitted meanwhile
    with ThreadPoolExecutor(args.jobs) as pool:
        trainings = pool.map(lambda run: -train_run(*run, args), runs)
        oracle = {}
        for name in args.backbones:
            path = os.path.join(args.out_dir, name, "oracles.json")
            if not os.path.isfile(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_json_atomic(path, oracles(backbones.load_backbone(name), args.steps))
            with open(path) as file:
                oracle[name] = json.load(file)
        errors = dict(zip(runs, trainings))
    lines = []
    for name in args.backbones:
        learned = {
            training: [errors[name, training, seed] for seed in args.seeds] for training in selected
        }
        default, best_global = (
            oracle[name]["errors"]["default"],
            oracle[name]["errors"]["oracle: best global schedule"],
        )
        grouping = GAP_GROUPING.get(name, "class")
        group = oracle[name]["errors"][f"oracle: best schedule per {grouping}"]
        lines += [
            f"\n{name}, L = {args.steps}, teacher error on {HELDOUT_CONTEXTS} held-out contexts, "
            f"seeds {args.seeds}",
            "| schedule | error (mean over seeds) | spread (min-max) | vs default "
            "| gap captured (spread) | s / iteration |",
            "|---|---|---|---|---|---|",
        ]
        backbone = backbones.load_backbone(name)
        margin_free = without_stop_margin(backbone, oracle[name], grouping)
        oracle[name]["errors"][f"oracle: best schedule per {grouping}, with t_L = 0"] = margin_free
        for row, values in [
            *((row, [error]) for row, error in oracle[name]["errors"].items()),
            *((f"learned {t}", v) for t, v in learned.items()),
        ]:
            mean = statistics.mean(values)
            spread = f"{min(values):.5f}-{max(values):.5f}" if len(values) > 1 else "-"
            shares = [100 * (best_global - value) / (best_global - group) for value in values]
            captured = (
                f"{statistics.mean(shares):.0f}% ({min(shares):.0f}-{max(shares):.0f}%)"
                if row.startswith("learned")
                else "-"
            )
            vs_default = 100 * (mean / default - 1)
            seconds = "-"
            if row.startswith("learned "):
                folders = [run_dir(name, row[8:], seed, args) for seed in args.seeds]
                seconds = f"{statistics.mean(map(seconds_per_iteration, folders)):.2f}"
            lines.append(
                f"| {row} | {mean:.5f} | {spread} | {vs_default:+.1f}% | {captured} | {seconds} |"
            )
        lines.append(
            f"gap captured = (best global - learned) / (best global - best per {grouping}) "
            "on the same contexts"
        )
        for seed, instance, glob in zip(args.seeds, learned["instance, js"], learned["global, js"]):
            below = 100 * (1 - instance / glob)
            lines.append(
                f"seed {seed}: learned instance-level (js) {below:.1f}% below learned global"
            )
        plot(
            os.path.join(args.out_dir, name, "schedules.png"),
            backbone,
            oracle[name],
            {
                t: os.path.join(run_dir(name, t, args.seeds[0], args), "ckpt.pt")
                for t in ("instance, js", "global, js")
            },
        )
    print("\n".join(lines))
    with open(os.path.join(args.out_dir, "results.md"), "w") as file:
        file.write("\n".join(lines) + "\n")
    section = "embedded"
    if args.backbones != DEFAULT_BACKBONES:  # another selection keeps the default table
        section += " " + " ".join(args.backbones)
    record(section, " ".join(["python -m evidence.ablation", *sys.argv[1:]]), lines, at=started)


if __name__ == "__main__":
    arguments = parser.parse_args()
    if arguments.distilled or arguments.miniatures:
        if arguments.out_dir == parser.get_default("out_dir"):  # the miniatures' runs are shared
            arguments.out_dir = "out/ablation-miniatures"
    with one_line_errors():
        if arguments.distilled:
            distilled_comparison(arguments)
        elif arguments.miniatures:
            arguments.backbones = [
                name for name in arguments.backbones if name.startswith("mini-")
            ] or MINIATURES
            miniature_evidence(arguments)
        else:
            main(arguments)
