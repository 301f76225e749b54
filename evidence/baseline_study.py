"""
The paper's comparison of baselines at K = 2, on the trained miniatures (mini-sd3, mini-flux,
mini-sdxl) with the preference reward: schedules learned with cross-context RLOO, RLOO, James-Stein
(the paper's) and James-Stein leave-one-context-out (this project's), against the default schedule;
their learning curves; and Theorem 3.2 measured on the training distribution.

    python -m evidence.baseline_study --jobs 2   # everything below; about an hour on 2 idle cores
    python -m evidence.baseline_study --miniatures mini-sd3 --seeds 0 1 --jobs 2   # a part of it

Protocol: the paper's where the paper states it, else this project's choice (said so).
- K = 2 rollouts per context (the paper's). B = 32 contexts per update on mini-sd3 and mini-sdxl,
  16 on mini-flux: the paper's "batch size" for SD3.5-M / SD-XL and Flux-Dev, read as contexts
  (the paper does not say whether it counts contexts or samples; this is the project's reading).
- L = 2 and 3, where the default schedule is far from what 50 steps reach (python -m
  evidence.miniatures --agreement).
- A fixed budget of 40 iterations, the project's defaults otherwise (lr 3e-3, cosine; not tuned).
- Two starts. "flat": a flat Dirichlet over schedules (--init uniform --concentration L+1), the
  project's reading of the paper's "trained from scratch", at every L. "default": the project's own
  start, the default schedule with concentration 100, whose K rollouts differ little, at the
  smallest L (the budget of one command).
- Each run is `python train.py --backbone NAME --steps L --rollouts 2 --contexts B --baseline X
  --seed S ...`; the row "rloo at 2B" is RLOO with 2B contexts. At K = 2 no baseline can be worth
  more than doubling RLOO's batch (docs/BOUND.md), so a cell where that gains nothing measurable
  (its paired interval reaches 0) cannot tell baselines apart, and says so. Each run is scored on
  its 256 held-out contexts (held-out paraphrases, fresh noise: eval.json, the same for every
  run): the preference reward and the Frechet distance to real digits, mean and
  95% Student-t interval over the seeds; the paired difference between two baselines pairs their
  runs of one seed (same initial policy, same training contexts).
- Learning curves: the held-out gain over the default on the first 32 held-out contexts, which
  train.py logs at each checkpoint (every 5 iterations here).
- Theorem 3.2 on the training distribution: at the start, middle and end of each seed-0 JS run at
  L = 2 (run_training keeps them), on training prompts with noise seeds of their own (MEASURE_SEED):
  - each baseline's error as an estimate of a context's mean reward mu_c: sets of contexts get
    POOL rollouts each; a batch takes K of them per context, the truth is the mean of the other
    POOL - K (its own noise, s2_c / (POOL - K), is subtracted);
  - the policy gradient of one batch (B contexts x K rollouts) with each baseline on the same
    rollouts, over GRADIENT_BATCHES independent batches: the variance (trace of the covariance)
    and the cosine to the large-batch gradient (the inverse-variance mix of the three exactly
    unbiased baselines over the other batches);
  - the plug-in James-Stein weight of those batches, and the training runs' logged weight.
  Where the paper expects the gain to be largest (few contexts to pool, few rollouts): each at
  (B, K) = (B as trained, 2) and (4, 2), the errors also at (B, 4).
Runs already finished are read, not repeated, so an interrupted study resumes. The report goes to
docs/RESULTS.md (section "baselines"), the curves to docs/baselines-<miniature>.png.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

import backbones
from baselines import BASELINES, MIN_CONTEXTS, shrinkage
from evaluate import load_policy, mean_ci
from evidence.results import (
    REPOSITORY,
    commit,
    heldout_mean,
    interval,
    one_line_errors,
    record,
    run_training,
    this_commit_only,
)
from policy import log_prob, sample_increments, times_from_increments
from prompts import context_noise, load_prompt_file
from rewards import load_reward

MINIATURES = {"mini-sd3": 32, "mini-flux": 16, "mini-sdxl": 32}  # name: B
BASELINE_ROWS = ["xctx", "rloo", "js", "js-unbiased"]
# RLOO with twice the contexts, paired by seed: what any baseline can at most be worth at K = 2
DOUBLED = "rloo at 2B"
STARTS = ("flat", "default")
ROLLOUTS = 2
ITERATIONS = 40
CURVE_INTERVAL = 5
SMALL_B = 4
MEASURE_SEED = 3 * 10**6  # noise seeds of the measurements: apart from held-out and tuning seeds
POOL = 34  # rollouts per context for the estimation errors
POOL_SETS = 4  # sets of B contexts for them
RESAMPLES = 400  # batches drawn from each set
GRADIENT_BATCHES = 200

parser = argparse.ArgumentParser(description="the paper's baselines at K = 2 on the miniatures")
add = parser.add_argument
add("--out-dir", default="out/baseline-study", help="one folder per training and measurement")
add("--miniatures", nargs="+", default=list(MINIATURES), choices=list(MINIATURES))
add("--steps", type=int, nargs="+", default=[2, 3], help="the step budgets L")
add("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="training seeds")
add("--jobs", type=int, default=1, help="trainings run at the same time, one CPU thread each")
add("--measure", nargs=2, metavar=("NAME", "START"), help=argparse.SUPPRESS)  # one measurement

# -----------------------------------------------------------------------------
# Theorem 3.2's quantities, as functions of rewards and gradients (tests/test_baseline_study.py
# checks each against a case with a known answer)


def baseline_errors(pool, contexts, rollouts, resamples, generator):
    """Mean squared error of each baseline b[c, i] as an estimate of mu_c, the mean reward of
    context c under the policy. pool (S, C, M): M rollouts of each of C contexts in S sets. Each of
    `resamples` batches per set takes `contexts` of the C contexts and `rollouts` of their M
    rollouts; the truth is the mean of the other M - K rollouts of the context, whose own variance
    (the unbiased s2_c / (M - K)) is subtracted, so the result is unbiased for E (b - mu_c)^2."""
    pool = pool.double()
    sets, count, size = pool.shape
    errors = {name: [] for name in BASELINES}
    for index in range(sets):
        for _ in range(resamples):
            chosen = torch.randperm(count, generator=generator)[:contexts]
            order = torch.argsort(torch.rand(contexts, size, generator=generator), dim=1)
            rewards = pool[index, chosen].gather(1, order)  # (B, M) shuffled within each context
            batch, rest = rewards[:, :rollouts], rewards[:, rollouts:]
            truth_noise = rest.var(dim=1) / rest.shape[1]  # (B,) Var of the truth's own mean
            for name, baseline in BASELINES.items():
                if contexts < MIN_CONTEXTS[name]:
                    continue
                error = (baseline(batch) - rest.mean(1, keepdim=True)).square().mean(1)
                errors[name].append((error - truth_noise).mean())
    return {name: torch.stack(values).mean().item() for name, values in errors.items() if values}


def batch_gradients(alpha_of, rewards_of, parameters, rollouts, generator):
    """One batch's policy gradient with every baseline, on the same rollouts: alpha_of() gives the
    concentrations (B, L+1) with their graph, rewards_of(tau (B, K, L+1)) the rewards (B, K).
    Returns {baseline: the gradient of -mean((r - b) log pi), flattened (P,)}, and the rewards."""
    alpha = alpha_of()
    tau = sample_increments(alpha.detach(), rollouts, generator).to(alpha.device)
    with torch.no_grad():
        rewards = rewards_of(tau).double()
    logp = log_prob(alpha, tau)  # (B, K)
    gradients = {}
    for name, baseline in BASELINES.items():
        advantages = (rewards - baseline(rewards)).float()
        loss = -(advantages * logp).mean()
        parts = torch.autograd.grad(loss, parameters, retain_graph=True, allow_unused=True)
        flat = [torch.zeros_like(p) if g is None else g for g, p in zip(parts, parameters)]
        gradients[name] = torch.cat([g.flatten() for g in flat])
    return gradients, rewards


def sampled_gradients(policy, backbone, draw, rewards_of, contexts, rollouts, batches, generator):
    """batch_gradients on `batches` batches of `contexts` fresh contexts each (draw(contexts) ->
    texts, noise, cond): {baseline: (batches, P)}, and each batch's plug-in JS weight."""
    parameters = [p for p in policy.parameters() if p.requires_grad]
    gradients, weights = {key: [] for key in BASELINES}, []
    for _ in range(batches):
        texts, noise, cond = draw(contexts)
        inputs = backbone.policy_inputs(noise, cond)
        batch, rewards = batch_gradients(
            lambda: policy(**inputs),
            lambda tau: rewards_of(texts, noise, cond, tau),
            parameters,
            rollouts,
            generator,
        )
        for key, value in batch.items():
            gradients[key].append(value)
        weights.append(shrinkage(rewards).item())
    return {key: torch.stack(value) for key, value in gradients.items()}, weights


UNBIASED = ("xctx", "rloo", "js-unbiased")  # exactly unbiased: their mix is the reference


def gradient_statistics(gradients):
    """gradients {baseline: (N, P)} over N independent batches -> {baseline: (variance, cosine)}:
    the trace of the covariance of one batch's gradient (unbiased over the N), and the mean cosine
    of a batch's gradient to the large-batch gradient. That reference is the UNBIASED baselines'
    gradients, weighted by the inverse of their variance (the least-variance unbiased mix), over
    the N - 1 other batches, so that a batch is not compared with itself."""
    count = next(iter(gradients.values())).shape[0]
    variances = {}
    for name, values in gradients.items():
        values = values.double()
        variances[name] = ((values - values.mean(0)).square().sum(1).sum() / (count - 1)).item()
    weights = {name: 1 / variances[name] for name in UNBIASED if name in gradients}
    pooled = sum(w * gradients[name].double() for name, w in weights.items()) / sum(
        weights.values()
    )
    others = (pooled.sum(0, keepdim=True) - pooled) / (count - 1)  # (N, P) leave one batch out
    return {
        name: (
            variances[name],
            torch.nn.functional.cosine_similarity(values.double(), others, dim=1).mean().item(),
        )
        for name, values in gradients.items()
    }


# -----------------------------------------------------------------------------
# the measurements on a miniature


def measure(name, start, args):
    """Theorem 3.2's quantities at each snapshot of the seed-0 JS run (L = the first --steps) of
    `start`: written to out_dir/measure-NAME-START.json."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    steps, contexts = args.steps[0], MINIATURES[name]
    folder = run_dir(args, name, start, steps, "js", args.seeds[0]) + "-snapshots"
    backbone = backbones.load_backbone(name, device="cpu")
    reward = load_reward("preference", backbone, device="cpu")
    prompts = load_prompt_file(backbones.BACKBONES[name]["prompts"][0])
    snapshots = sorted(int(file[len("policy-") : -3]) for file in os.listdir(folder))
    chosen = sorted({snapshots[0], snapshots[len(snapshots) // 2], snapshots[-1]})
    generator = torch.Generator().manual_seed(MEASURE_SEED)
    seeds = iter(range(MEASURE_SEED, MEASURE_SEED + 10**6))

    def draw_contexts(count):
        texts = [prompts[i] for i in torch.randint(len(prompts), (count,), generator=generator)]
        noise = context_noise(backbone, [next(seeds) for _ in range(count)])
        return texts, noise, backbone.encode_prompts(texts)

    def rewards_of(texts, noise, cond, tau):  # tau (C, K, L+1) -> rewards (C, K)
        count, rollouts = tau.shape[:2]
        scores = []
        for part in torch.arange(count * rollouts).split(256):
            index = part // rollouts
            part_cond = {key: value[index] for key, value in cond.items()}
            times = times_from_increments(tau.flatten(0, 1)[part])
            latents = backbone.sample(noise[index], part_cond, times)
            scores.append(reward(latents, [texts[i] for i in index], noise[index], part_cond))
        return torch.cat(scores).float().view(count, rollouts)

    report = []
    for iteration in chosen:
        policy, _ = load_policy(os.path.join(folder, f"policy-{iteration}.pt"))
        pool = []
        for _ in range(POOL_SETS):
            texts, noise, cond = draw_contexts(contexts)
            with torch.no_grad():
                alpha = policy(**backbone.policy_inputs(noise, cond))
                tau = sample_increments(alpha, POOL, generator)
                pool.append(rewards_of(texts, noise, cond, tau))
        pool = torch.stack(pool)  # (S, B, POOL)
        within = pool.var(-1).mean().item()  # sigma^2, pooled
        between = pool.mean(-1).var(-1).mean().item() - within / POOL  # delta^2
        measured = dict(iteration=iteration, within=within, between=between, settings={})
        for size, rollouts in ((contexts, ROLLOUTS), (SMALL_B, ROLLOUTS), (contexts, 4)):
            setting = dict(errors=baseline_errors(pool, size, rollouts, RESAMPLES, generator))
            if rollouts == ROLLOUTS:  # the gradient at the paper's K, B as trained and small
                stacked, weights = sampled_gradients(
                    policy, backbone, draw_contexts, rewards_of, size, rollouts,
                    GRADIENT_BATCHES, generator,
                )  # fmt: skip
                setting.update(
                    gradients=gradient_statistics(stacked),
                    weights=[statistics.median(weights), *statistics.quantiles(weights, n=4)[::2]],
                )
            measured["settings"][f"B={size}, K={rollouts}"] = setting
        report.append(measured)
        print(f"{name} {start}: iteration {iteration} measured", flush=True)
    with open(os.path.join(args.out_dir, f"measure-{name}-{start}.json"), "w") as file:
        json.dump(report, file)


# -----------------------------------------------------------------------------
# the trainings


def budgets(args, start):
    """The step budgets a start trains at: the project's start at the smallest only."""
    return args.steps if start == "flat" else args.steps[:1]


def run_dir(args, name, start, steps, baseline, seed):
    row = baseline.replace(" ", "-")
    return os.path.join(args.out_dir, name, f"{start}-L{steps}-{row}-s{seed}")


def train(args, name, start, steps, baseline, seed):
    """One training run (read when finished): its eval.json and metrics rows."""
    contexts = MINIATURES[name] * (2 if baseline == DOUBLED else 1)
    arguments = ["--backbone", name, "--steps", str(steps), "--rollouts", str(ROLLOUTS)]
    arguments += ["--contexts", str(contexts), "--baseline", baseline.split()[0]]
    arguments += ["--seed", str(seed), "--iterations", str(ITERATIONS)]
    arguments += ["--ckpt-interval", str(CURVE_INTERVAL)]
    if start == "flat":
        arguments += ["--init", "uniform", "--concentration", str(steps + 1)]
    if seed == args.seeds[0] and baseline == "js":
        arguments.append("--snapshots")  # Theorem 3.2 is measured at this run's snapshots
    return run_training(run_dir(args, name, start, steps, baseline, seed), arguments)


# -----------------------------------------------------------------------------
# the report


def cell(runs):
    """'reward ± ci / Frechet ± ci' of one baseline's runs (one per seed)."""
    rewards = [heldout_mean(report) for report, _ in runs]
    frechet = [report["realism"]["learned (mean)"]["frechet"] for report, _ in runs]
    return f"{interval(rewards, 3)} / {interval(frechet, 3)}"


def default_cell(report):
    default = heldout_mean(report, "default")
    return f"{default:.3f} / {report['realism']['default']['frechet']:.3f}"


def paired(runs, first, second):
    """first - second, paired by seed: mean ± 95% interval of the held-out reward."""
    pairs = zip(runs[first], runs[second])
    differences = [heldout_mean(a) - heldout_mean(b) for (a, _), (b, _) in pairs]
    return interval(differences, 3)


def detects(runs):
    """Whether a cell can tell baselines apart: a better baseline is worth at most twice RLOO's
    batch at K = 2 (docs/BOUND.md), so where doubling RLOO's batch gains nothing measurable (its
    paired 95% interval reaches 0), no baseline's gain could show."""
    pairs = zip(runs[DOUBLED], runs["rloo"])
    differences = torch.tensor([heldout_mean(a) - heldout_mean(b) for (a, _), (b, _) in pairs])
    mean, half = mean_ci(differences)
    return "yes: doubling B gains" if mean - half > 0 else "no: doubling B gains nothing"


def shrinkage_summary(runs):
    """Median (quartiles) of the logged plug-in JS weight over every iteration of the runs, and
    over their first 5 iterations."""
    every = [row["shrinkage"] for _, rows in runs for row in rows]
    early = [row["shrinkage"] for _, rows in runs for row in rows if row["iteration"] <= 5]

    def summary(values):
        low, _, high = statistics.quantiles(values, n=4)
        return f"{statistics.median(values):.3f} ({low:.3f}-{high:.3f})"

    return f"{summary(early)}; {summary(every)}"


def table(args, results, start):
    """One start's table: a column per miniature and step budget, a row per baseline."""
    columns = [(name, steps) for name in args.miniatures for steps in budgets(args, start)]
    header = [f"{name} L={steps}" for name, steps in columns]
    lines = ["| baseline | " + " | ".join(header) + " |", "|---" * (len(columns) + 1) + "|"]
    first = results[(columns[0][0], start, columns[0][1])]
    row = [default_cell(results[(n, start, s)]["js"][0][0]) for n, s in columns]
    lines.append("| default schedule | " + " | ".join(row) + " |")
    for baseline in first:
        row = [cell(results[(n, start, s)][baseline]) for n, s in columns]
        lines.append(f"| {baseline} | " + " | ".join(row) + " |")
    for a, b in (("js", "rloo"), (DOUBLED, "rloo"), ("js", "xctx"), ("js-unbiased", "rloo")):
        if a in first and b in first:
            row = [paired(results[(n, start, s)], a, b) for n, s in columns]
            lines.append(f"| {a} - {b} (reward, paired) | " + " | ".join(row) + " |")
    if DOUBLED in first:  # JS can gain at most what doubling the batch gains (docs/BOUND.md)
        row = [detects(results[(n, start, s)]) for n, s in columns]
        lines.append("| could a baseline show here? | " + " | ".join(row) + " |")
    row = [shrinkage_summary(results[(n, start, s)]["js"]) for n, s in columns]
    lines.append(
        "| JS weight a, median (quartiles): first 5 iterations; all | " + " | ".join(row) + " |"
    )
    return lines


def measurement_lines(args, name, start):
    """One row per snapshot and (B, K): the JS weight of such batches, each baseline's MSE as an
    estimate of mu_c, the variance of the policy gradient and its cosine to the large-batch one
    (the ratios to RLOO's)."""
    with open(os.path.join(args.out_dir, f"measure-{name}-{start}.json")) as file:
        report = json.load(file)
    lines = [
        f"{name}, {start} start, L = {args.steps[0]}, at iterations "
        f"{', '.join(str(m['iteration']) for m in report)} of the seed-{args.seeds[0]} JS run:",
        "",
        "| iteration | sigma^2 within / delta^2 between | B, K | JS weight a, median (quartiles) | "
        "MSE of mu_c / RLOO's | gradient variance / RLOO's | gradient cosine to the large batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in report:
        for setting, values in m["settings"].items():
            errors = values["errors"]
            mse = ", ".join(f"{k} {errors[k] / errors['rloo']:.2f}" for k in BASELINE_ROWS)
            weight = variance = cosine = "-"
            if "gradients" in values:
                median, low, high = values["weights"]
                weight = f"{median:.3f} ({low:.3f}-{high:.3f})"
                gradient = values["gradients"]
                variance = ", ".join(
                    f"{k} {gradient[k][0] / gradient['rloo'][0]:.2f}" for k in BASELINE_ROWS
                )
                cosine = ", ".join(f"{k} {gradient[k][1]:.3f}" for k in BASELINE_ROWS)
            lines.append(
                f"| {m['iteration']} | {m['within']:.3g} / {m['between']:.3g} | {setting} | "
                f"{weight} | {mse} | {variance} | {cosine} |"
            )
    lines.append("")
    return lines


def plot_curves(args, results, name, path):
    """The held-out gain against iteration, mean and 95% band over seeds, for each baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        len(STARTS),
        len(args.steps),
        figsize=(4.5 * len(args.steps), 3.4 * len(STARTS)),
        squeeze=False,
    )
    for row, start in enumerate(STARTS):
        for column, steps in enumerate(args.steps):
            ax = axes[row][column]
            if steps not in budgets(args, start):
                ax.axis("off")
                continue
            for baseline, runs in results[(name, start, steps)].items():
                curves = [
                    [(r["iteration"], r["heldout_gain"]) for r in rows if "heldout_gain" in r]
                    for _, rows in runs
                ]
                iterations = [i for i, _ in curves[0]]
                values = torch.tensor(
                    [[g for _, g in curve] for curve in curves], dtype=torch.float64
                )
                stats = [mean_ci(values[:, k]) for k in range(values.shape[1])]
                means = [m for m, _ in stats]
                ax.plot(iterations, means, "-o", markersize=3, label=baseline)
                ax.fill_between(
                    iterations,
                    [m - h for m, h in stats],
                    [m + h for m, h in stats],
                    alpha=0.2,
                )
            ax.axhline(0.0, color="black", linestyle="--", linewidth=0.8)
            ax.set(
                title=f"{name}, L = {steps}, {start} start",
                xlabel="iteration",
                ylabel="held-out gain over the default",
            )
            ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(args):
    started = commit()
    this_commit_only(args.out_dir)
    jobs = [  # the paper's start first
        (name, start, steps, baseline, seed)
        for start in STARTS
        for name in args.miniatures
        for steps in budgets(args, start)
        for baseline in [*BASELINE_ROWS, DOUBLED]
        for seed in args.seeds
    ]
    with ThreadPoolExecutor(args.jobs) as pool:
        finished = list(pool.map(lambda job: train(args, *job), jobs))
    results = {}
    for (name, start, steps, baseline, seed), run in zip(jobs, finished):
        results.setdefault((name, start, steps), {}).setdefault(baseline, []).append(run)

    def measured(name, start):
        path = os.path.join(args.out_dir, f"measure-{name}-{start}.json")
        if not os.path.isfile(path):
            command = [sys.executable, "-m", "evidence.baseline_study", "--out-dir", args.out_dir]
            command += ["--measure", name, start]
            command += ["--steps", *map(str, args.steps), "--seeds", *map(str, args.seeds)]
            environment = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run(command, check=True, env=environment, cwd=REPOSITORY)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(
            pool.map(
                lambda pair: measured(*pair), [(n, s) for n in args.miniatures for s in STARTS]
            )
        )

    lines = []
    for start in STARTS:
        lines += [
            f"Held-out preference reward / Frechet distance, {start} start (mean ± 95% over seeds "
            f"{', '.join(map(str, args.seeds))}; K = {ROLLOUTS}, {ITERATIONS} iterations):",
            "",
            *table(args, results, start),
            "",
        ]
    lines += ["Theorem 3.2 measured on the training distribution:", ""]
    for name in args.miniatures:
        for start in STARTS:
            lines += measurement_lines(args, name, start)
    for name in args.miniatures:
        path = os.path.join("docs", f"baselines-{name}.png")
        plot_curves(args, results, name, path)
        lines.append(f"Learning curves: [{path}]({os.path.basename(path)})")
    print("\n".join(lines))
    command = " ".join(["python -m evidence.baseline_study", *sys.argv[1:]])
    record("baselines", command, lines, at=started)


if __name__ == "__main__":
    ARGS = parser.parse_args()
    with one_line_errors():
        if ARGS.measure:  # a process of main's: its folder passed the door
            measure(*ARGS.measure, ARGS)
        else:
            main(ARGS)
