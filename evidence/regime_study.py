"""
James-Stein where theory says it can pay: the noise-limited regime, with power to see it.

    python -m evidence.regime_study --jobs 2   # about 30 min on 2 cores
    python -m evidence.regime_study --cells mini-sd3 --seeds 0 1 2 --jobs 2   # a part of it

At K = 2 no baseline can be worth more than doubling RLOO's batch, and James-Stein at most about
1.3x the better of RLOO and cross-context (docs/BOUND.md, this project's analysis). A gain that
small shows only where the gradient is noise-limited for a good part of the run. This study builds
that regime on purpose, with settings chosen on training contexts, and measures with power:
- the policy stays broad: a flat Dirichlet start (--init uniform --concentration L+1), a low
  learning rate;
- gradients are noisy: B = 4 contexts, K = 2 rollouts, L = 2;
- contexts are alike: the prompts of one digit (its training paraphrases; the held-out table on
  its held-out ones), so that a context's rollouts differ more than contexts do and cross-context
  is at least RLOO (measured at the start: sigma^2 within, delta^2 between, and the effective
  batch the closed forms of docs/BOUND.md predict);
- rows: JS, RLOO, cross-context, js-unbiased and RLOO at 2B (the ceiling), SEEDS seeds each,
  paired by seed (the same initial policy and training contexts);
- measures: the area under the held-out learning curve (the gain over the default on the first
  32 held-out contexts, logged every CURVE iterations: the mean over the run) and the endpoint
  (the held-out table's gain on 256 contexts); the JS weight's trajectory (logged every iteration).
The learning rate: from RATES, the one at which doubling RLOO's batch gains most on tuning contexts
(the digit's training paraphrases with noise seeds of their own, prompts.TUNING_SEED), over the
TUNING_SEEDS training seeds: where the study has most power, chosen without the held-out contexts.
Runs already finished are read, not repeated. The report goes to docs/RESULTS.md (section
"regime"), the curves to docs/regime.png.
"""

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

import backbones
from baselines import shrinkage
from evidence import bound
from evidence.results import commit, interval, record, run_training
from policy import sample_increments, times_from_increments
from prompts import TUNING_SEED, context_noise, heldout_contexts, load_prompt_file
from rewards import digit_of, load_reward
from scoring.paired import mean_ci, policy_schedule, score_methods
from store.checkpoint import load_checkpoint, make_policy
from store.files import REPOSITORY, write_lines_atomic

CELLS = {"mini-sd3": 2, "mini-sdxl": 2}  # miniature: the digit whose prompts make its contexts
STEPS, CONTEXTS, ROLLOUTS, ITERATIONS, CURVE = 2, 4, 2, 30, 2
DOUBLED = "rloo at 2B"
ROWS = ["js", "rloo", "xctx", "js-unbiased", DOUBLED]
RATES = (3e-4, 1e-3, 3e-3)
TUNING_SEEDS, TUNING_CONTEXTS = (100, 101, 102, 103), 128
START_CONTEXTS, START_ROLLOUTS = 64, 8  # the variances at the start: contexts x rollouts drawn
WEIGHT_AT = (1, 2, 3, 5, 10, 20, 30)  # iterations at which the JS weight's trajectory is shown

parser = argparse.ArgumentParser(description="James-Stein in the noise-limited regime")
add = parser.add_argument
add("--out-dir", default="out/regime-study", help="one folder per cell and training")
add("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
add("--seeds", type=int, nargs="+", default=list(range(15)), help="training seeds per row")
add("--jobs", type=int, default=1, help="trainings run at the same time, one CPU thread each")


def prompt_files(args, name):
    """The cell's training and held-out prompt files (the paraphrases of its one digit): their
    paths, written once (main) before any training reads them."""
    folder = os.path.join(args.out_dir, name)
    return [os.path.join(folder, f"prompts-{which}.txt") for which in ("train", "heldout")]


def write_prompt_files(args, name):
    os.makedirs(os.path.join(args.out_dir, name), exist_ok=True)
    for path, shipped in zip(prompt_files(args, name), backbones.BACKBONES[name]["prompts"]):
        prompts = [p for p in load_prompt_file(shipped) if digit_of(p) == CELLS[name]]
        write_lines_atomic(path, [prompt + "\n" for prompt in prompts])


def run_folder(args, name, row, seed, rate):
    return os.path.join(args.out_dir, name, f"{row.replace(' ', '-')}-lr{rate:g}-s{seed}")


def train(args, name, row, seed, rate):
    """One training run (read when finished): its eval.json and metrics rows."""
    train_file, heldout_file = prompt_files(args, name)
    contexts = CONTEXTS * (2 if row == DOUBLED else 1)
    arguments = ["--backbone", name, "--steps", str(STEPS), "--rollouts", str(ROLLOUTS)]
    arguments += ["--contexts", str(contexts), "--baseline", row.split()[0], "--lr", f"{rate:g}"]
    arguments += ["--seed", str(seed), "--iterations", str(ITERATIONS)]
    arguments += ["--ckpt-interval", str(CURVE), "--init", "uniform"]
    arguments += ["--concentration", str(STEPS + 1), "--prompts", train_file]
    arguments += ["--eval-prompts", heldout_file]
    return run_training(run_folder(args, name, row, seed, rate), arguments)


@torch.no_grad()
def tuning_scores(args, name, runs):
    """The mean preference reward of each tuning run's schedule on the tuning contexts (the
    backbone, reward and contexts loaded once): {(row, seed, rate): score}."""
    backbone = backbones.load_backbone(name)
    reward = load_reward("preference", backbone)
    prompts = load_prompt_file(prompt_files(args, name)[0])
    contexts = heldout_contexts(prompts, TUNING_CONTEXTS, TUNING_SEED)
    scores = {}
    for run in runs:
        _, policy = load_checkpoint(os.path.join(run_folder(args, name, *run), "ckpt.pt"))
        method = {"learned": policy_schedule(policy, backbone)}
        scores[run] = score_methods(backbone, reward, *contexts, method)["learned"].mean().item()
    return scores


def tune(args, pool, name):
    """The rate at which doubling RLOO's batch gains most on the tuning contexts: {rate: mean
    paired gain} and that rate (kept in tuning.json)."""
    path = os.path.join(args.out_dir, name, "tuning.json")
    if os.path.isfile(path):
        with open(path) as file:
            gains = {float(rate): gain for rate, gain in json.load(file).items()}
        return gains, max(gains, key=gains.get)
    runs = [
        (row, seed, rate) for rate in RATES for row in ("rloo", DOUBLED) for seed in TUNING_SEEDS
    ]
    list(pool.map(lambda run: train(args, name, *run), runs))
    score = tuning_scores(args, name, runs)
    gains = {
        rate: statistics.mean(
            score[(DOUBLED, seed, rate)] - score[("rloo", seed, rate)] for seed in TUNING_SEEDS
        )
        for rate in RATES
    }
    with open(path, "w") as file:
        json.dump({f"{rate:g}": gain for rate, gain in gains.items()}, file)
    return gains, max(gains, key=gains.get)


@torch.no_grad()
def start_variances(args, name):
    """sigma^2 within and delta^2 between contexts of the preference reward at the flat start (one
    initial policy, START_CONTEXTS training contexts of the digit, START_ROLLOUTS schedules each),
    and the effective batch of JS (its weight a*) over RLOO and over the better of RLOO and
    cross-context at B = CONTEXTS, K = ROLLOUTS that docs/BOUND.md's closed forms give there."""
    backbone = backbones.load_backbone(name)
    reward = load_reward("preference", backbone)
    torch.manual_seed(0)
    policy = make_policy(
        "instance", backbone.policy_dims, STEPS, init="uniform", concentration=STEPS + 1.0
    )
    prompts = load_prompt_file(prompt_files(args, name)[0])
    prompts, seeds = heldout_contexts(prompts, START_CONTEXTS, TUNING_SEED + 10**5)
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    alpha = policy(**backbone.policy_inputs(noise, cond))
    generator = torch.Generator().manual_seed(0)
    tau = sample_increments(alpha, START_ROLLOUTS, generator)  # (B, K, L+1)
    times = times_from_increments(tau).flatten(0, 1)
    noise_k = noise.repeat_interleave(START_ROLLOUTS, 0)
    cond_k = {key: value.repeat_interleave(START_ROLLOUTS, 0) for key, value in cond.items()}
    prompts_k = [p for p in prompts for _ in range(START_ROLLOUTS)]
    rewards = reward(backbone.sample(noise_k, cond_k, times), prompts_k, noise_k, cond_k)
    rewards = rewards.double().view(START_CONTEXTS, START_ROLLOUTS)
    sigma2 = rewards.var(1).mean().item()
    delta2 = max(0.0, rewards.mean(1).var().item() - sigma2 / START_ROLLOUTS)
    factors = bound.effective_batch(delta2 / sigma2, ROLLOUTS, CONTEXTS)
    weight = shrinkage(rewards[:, :ROLLOUTS][None]).item()
    return sigma2, delta2, factors, weight


# -----------------------------------------------------------------------------
# the report


def gains(report_rows):
    """(endpoint, area): the held-out table's gain of the learned schedule over the default, and
    the mean of the logged held-out gains over the run (the area under the learning curve)."""
    report, rows = report_rows
    endpoint = {row["method"]: row for row in report["rows"]}["learned (mean)"]["diff_mean"]
    curve = [row["heldout_gain"] for row in rows if "heldout_gain" in row]
    return endpoint, statistics.mean(curve)


def paired(first, second, which):
    """first - second, paired by seed: mean ± 95% interval of the endpoint (0) or the area (1)."""
    return interval([gains(a)[which] - gains(b)[which] for a, b in zip(first, second)], 3)


def weight_trajectory(runs):
    """The JS weight logged at the iterations WEIGHT_AT, median over the runs."""
    return ", ".join(
        f"{at}: {statistics.median(rows[at - 1]['shrinkage'] for _, rows in runs):.2f}"
        for at in WEIGHT_AT
    )


def cell_lines(name, rate, tuning, start, runs):
    sigma2, delta2, factors, weight = start
    rloo = runs["rloo"]
    doubled = [gains(a)[1] - gains(b)[1] for a, b in zip(runs[DOUBLED], rloo)]
    mean, half = mean_ci(torch.tensor(doubled, dtype=torch.float64))
    power = (
        "doubling RLOO's batch gains: a better baseline could show"
        if mean - half > 0
        else "doubling RLOO's batch gains nothing measurable: no baseline could show"
    )
    lines = [
        f"\n{name}, the digit {CELLS[name]}'s prompts; lr {rate:g} (tuning, doubling RLOO's "
        "batch, mean paired gain on tuning contexts: "
        + ", ".join(f"{r:g}: {g:+.3f}" for r, g in tuning.items())
        + ")",
        "",
        f"At the start: sigma^2 {sigma2:.3g} within, delta^2 {delta2:.3g} between contexts "
        f"(rho {delta2 / sigma2:.2f}); the closed forms give JS an effective batch of "
        f"{factors['rloo']:.2f}x RLOO's and {factors['best']:.2f}x the better of RLOO and "
        f"cross-context at B = {CONTEXTS}, K = {ROLLOUTS}; the plug-in weight of one batch "
        f"{weight:.2f}.",
        "",
        "| row | endpoint gain | area under the curve | - RLOO, endpoint (paired) "
        "| - RLOO, area (paired) |",
        "|---|---|---|---|---|",
    ]
    for row, members in runs.items():
        endpoint = interval([gains(r)[0] for r in members], 3)
        area = interval([gains(r)[1] for r in members], 3)
        versus = (
            ("-", "-") if row == "rloo" else (paired(members, rloo, 0), paired(members, rloo, 1))
        )
        lines.append(f"| {row} | {endpoint} | {area} | {versus[0]} | {versus[1]} |")
    lines += [
        "",
        f"- could a baseline show here? {power} (area {mean:+.3f} ± {half:.3f})",
        f"- JS - cross-context (paired): endpoint {paired(runs['js'], runs['xctx'], 0)}, area "
        f"{paired(runs['js'], runs['xctx'], 1)}",
        f"- JS weight a logged at iteration (median over seeds): {weight_trajectory(runs['js'])}",
    ]
    return lines


def plot(path, results):
    """Per cell: the held-out gain at each checkpoint (mean over seeds) of every row, and the JS
    weight per iteration (median over seeds)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5 * len(results), 7), layout="tight")
    axes = figure.subplots(2, len(results), squeeze=False)
    for column, (name, runs) in enumerate(results.items()):
        top, bottom = axes[0][column], axes[1][column]
        for row, members in runs.items():
            curves = [
                [(r["iteration"], r["heldout_gain"]) for r in rows if "heldout_gain" in r]
                for _, rows in members
            ]
            iterations = [i for i, _ in curves[0]]
            means = [statistics.mean(c[k][1] for c in curves) for k in range(len(iterations))]
            top.plot(iterations, means, "-o", markersize=3, label=row)
        top.set(title=name, xlabel="iteration", ylabel="held-out gain over the default")
        top.legend(fontsize=7)
        weights = [
            statistics.median(rows[i]["shrinkage"] for _, rows in runs["js"])
            for i in range(ITERATIONS)
        ]
        bottom.plot(range(1, ITERATIONS + 1), weights, "-o", markersize=3)
        bottom.set(xlabel="iteration", ylabel="JS weight a (median over seeds)", ylim=(0, 1))
    figure.savefig(path, dpi=110)


def main(args):
    started = commit()
    summary = (
        f"K = {ROLLOUTS}, B = {CONTEXTS} contexts (RLOO at 2B: {2 * CONTEXTS}), L = {STEPS}, flat "
        f"start, {ITERATIONS} iterations, seeds {args.seeds[0]}-{args.seeds[-1]} "
        f"({len(args.seeds)}); held-out gain over the default on 256 contexts (endpoint) and its "
        f"mean over the {ITERATIONS // CURVE} checkpoints on the first 32 (area); mean ± 95% "
        "Student-t interval; differences paired by seed."
    )
    lines, results = [summary], {}
    with ThreadPoolExecutor(args.jobs) as pool:
        for name in args.cells:
            write_prompt_files(args, name)
            tuning, rate = tune(args, pool, name)
            runs = [(row, seed) for row in ROWS for seed in args.seeds]
            finished = list(pool.map(lambda run: train(args, name, *run, rate), runs))
            results[name] = {row: [] for row in ROWS}
            for (row, _), run in zip(runs, finished):
                results[name][row].append(run)
            start = start_variances(args, name)
            lines += cell_lines(name, rate, tuning, start, results[name])
    path = os.path.join(REPOSITORY, "docs", "regime.png")
    plot(path, results)
    lines.append("\nLearning curves and the JS weight: [docs/regime.png](regime.png)")
    print("\n".join(lines))
    record(
        "regime", " ".join(["python -m evidence.regime_study", *sys.argv[1:]]), lines, at=started
    )


if __name__ == "__main__":
    main(parser.parse_args())
