"""
James-Stein where theory says it can pay: the noise-limited regime, with power to see it.

    python -m evidence.regime_study --jobs 2   # 198 trainings; 25 min on 2 shared cores
    python -m evidence.regime_study --cells mini-sd3 --seeds 0 1 2 --jobs 2   # a part of it

At K = 2 no baseline can be worth more than doubling RLOO's batch, and James-Stein at B = 4 at
most about 1.27x the better of RLOO and cross-context with its ideal weight, 1.15x with the
plug-in weight that trains (docs/BOUND.md, this project's analysis). A gain that small shows only
where the gradient is noise-limited for a good part of the run. This study builds that regime on
purpose, with settings chosen on training contexts, and measures with power:
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
The grid stays low on purpose (the regime needs a broad policy): a rate at its top edge is said so,
not widened, as doubling gains most where a rate starts to diverge.
Why RLOO and cross-context did as they did (explain): the measured gradient noise of each along
their seed-0 runs, against the variance model's prediction, and the shape of the rewards.
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
from evaluate import load_policy, mean_ci, policy_schedule, score_methods
from evidence import bound
from evidence.baseline_study import gradient_statistics, sampled_gradients
from evidence.results import (
    REPOSITORY,
    commit,
    interval,
    one_line_errors,
    record,
    run_training,
    this_commit_only,
    write_json_atomic,
    write_lines_atomic,
)
from policy import SchedulePolicy, make_policy, sample_increments, times_from_increments
from prompts import TUNING_SEED, context_noise, heldout_contexts, load_prompt_file
from rewards import load_reward
from rewards.digits import digit_of

CELLS = {"mini-sd3": 2, "mini-sdxl": 2}  # miniature: the digit whose prompts make its contexts
STEPS, CONTEXTS, ROLLOUTS, ITERATIONS, CURVE = 2, 4, 2, 30, 2
DOUBLED = "rloo at 2B"
ROWS = ["js", "rloo", "xctx", "js-unbiased", DOUBLED]
RATES = (3e-4, 1e-3, 3e-3)
TUNING_SEEDS, TUNING_CONTEXTS = (100, 101, 102, 103), 128
START_CONTEXTS, START_ROLLOUTS = 64, 8  # the variances at the start: contexts x rollouts drawn
WEIGHT_AT = (1, 2, 3, 5, 10, 20, 30)  # iterations at which the JS weight's trajectory is shown
# why RLOO and cross-context did as they did: snapshots of their seed-0 runs, measured on tuning
# contexts (EXPLAIN_BATCHES batches of B contexts for the gradient, EXPLAIN_POOL rollouts each of
# EXPLAIN_CONTEXTS contexts for rho and the reward's shape)
EXPLAIN_AT, EXPLAIN_ROWS = (0, 10, 20, 30), ("rloo", "xctx")
EXPLAIN_BATCHES, EXPLAIN_CONTEXTS, EXPLAIN_POOL = 100, 64, 8

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
    arguments += ["--eval-prompts", heldout_file, "--without-realism"]
    if row in EXPLAIN_ROWS and seed == 0:  # the policy at each checkpoint, for explain()
        arguments.append("--snapshots")
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
        policy, _ = load_policy(os.path.join(run_folder(args, name, *run), "ckpt.pt"))
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
    else:
        runs = [(row, seed, r) for r in RATES for row in ("rloo", DOUBLED) for seed in TUNING_SEEDS]
        list(pool.map(lambda run: train(args, name, *run), runs))
        score = tuning_scores(args, name, runs)
        gains = {
            rate: statistics.mean(
                score[(DOUBLED, seed, rate)] - score[("rloo", seed, rate)] for seed in TUNING_SEEDS
            )
            for rate in RATES
        }
        write_json_atomic(path, {f"{rate:g}": gain for rate, gain in gains.items()})
    return gains, max(gains, key=gains.get)


@torch.no_grad()
def variances(backbone, reward, policy, prompts, seed, contexts, rollouts):
    """The rewards (contexts, rollouts) of `policy` on `contexts` contexts of `prompts` (noise
    seeds from `seed`), `rollouts` schedules each, with sigma^2 within and delta^2 between them."""
    prompts, seeds = heldout_contexts(prompts, contexts, seed)
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    alpha = policy(**backbone.policy_inputs(noise, cond))
    tau = sample_increments(alpha, rollouts, torch.Generator().manual_seed(0))  # (B, K, L+1)
    times = times_from_increments(tau).flatten(0, 1)
    noise_k = noise.repeat_interleave(rollouts, 0)
    cond_k = {key: value.repeat_interleave(rollouts, 0) for key, value in cond.items()}
    prompts_k = [p for p in prompts for _ in range(rollouts)]
    rewards = reward(backbone.sample(noise_k, cond_k, times), prompts_k, noise_k, cond_k)
    rewards = rewards.double().view(contexts, rollouts)
    sigma2 = rewards.var(1).mean().item()
    return rewards, sigma2, max(0.0, rewards.mean(1).var().item() - sigma2 / rollouts)


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
        SchedulePolicy, backbone.policy_dims, STEPS, init="uniform", concentration=STEPS + 1.0
    )
    prompts = load_prompt_file(prompt_files(args, name)[0])
    rewards, sigma2, delta2 = variances(
        backbone, reward, policy, prompts, TUNING_SEED + 10**5, START_CONTEXTS, START_ROLLOUTS
    )
    ratio = delta2 / sigma2
    factors = bound.effective_batch(ratio, ROLLOUTS, CONTEXTS)
    plug_in = bound.plug_in_variance(ratio, ROLLOUTS, CONTEXTS)
    rloo, xctx = (
        bound.rloo_variance(ROLLOUTS),
        bound.cross_context_variance(ratio, ROLLOUTS, CONTEXTS),
    )
    factors.update(plug_in_rloo=rloo / plug_in, plug_in_best=min(rloo, xctx) / plug_in)
    batches = rewards[:, :ROLLOUTS].reshape(
        -1, CONTEXTS, ROLLOUTS
    )  # disjoint batches of the study's B
    weight = shrinkage(batches).median().item()
    return sigma2, delta2, factors, weight


def explain(args, name, rate):
    """At the snapshots EXPLAIN_AT of the seed-0 RLOO and cross-context runs, on tuning contexts:
    rho, the variance model's V_xctx / V_rloo at B = CONTEXTS, K = ROLLOUTS (docs/BOUND.md, eqs. 1
    and 2) against the measured trace of the gradient's covariance, Var g_xctx / Var g_rloo, over
    EXPLAIN_BATCHES batches (the same rollouts for both), each one's cosine to the large-batch
    gradient, and the skew and excess kurtosis of the rewards around their context's mean (the
    model's are 0). Returns the lines of the cell's table."""
    torch.set_num_threads(1)
    backbone = backbones.load_backbone(name)
    reward = load_reward("preference", backbone)
    prompts = load_prompt_file(prompt_files(args, name)[0])
    generator, seeds = torch.Generator().manual_seed(0), iter(range(TUNING_SEED + 2 * 10**5, 2**62))

    def contexts(count):
        texts = [prompts[i] for i in torch.randint(len(prompts), (count,), generator=generator)]
        noise = context_noise(backbone, [next(seeds) for _ in range(count)])
        return texts, noise, backbone.encode_prompts(texts)

    def rewards_of(texts, noise, cond, tau):  # tau (C, K, L+1) -> rewards (C, K)
        count, rollouts = tau.shape[:2]
        index = torch.arange(count).repeat_interleave(rollouts)
        cond_k = {key: value[index] for key, value in cond.items()}
        times = times_from_increments(tau.flatten(0, 1))
        latents = backbone.sample(noise[index], cond_k, times)
        prompts_k = [texts[i] for i in index]
        return reward(latents, prompts_k, noise[index], cond_k).float().view(count, rollouts)

    lines = [
        f"\n{name}: why RLOO and cross-context did as they did (seed 0, tuning contexts)",
        "",
        "| run | iteration | rho | model V_xctx / V_rloo | measured Var g_xctx / Var g_rloo | "
        "cosine rloo / xctx | skew | excess kurtosis |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in EXPLAIN_ROWS:
        folder = run_folder(args, name, row, 0, rate) + "-snapshots"
        for iteration in EXPLAIN_AT:
            policy = load_policy(os.path.join(folder, f"policy-{iteration}.pt"))[0]
            texts, noise, cond = contexts(EXPLAIN_CONTEXTS)
            with torch.no_grad():
                alpha = policy(**backbone.policy_inputs(noise, cond))
                tau = sample_increments(alpha, EXPLAIN_POOL, generator)
                pool = rewards_of(texts, noise, cond, tau).double()  # (C, POOL)
            sigma2 = pool.var(1).mean().item()
            ratio = max(0.0, pool.mean(1).var().item() - sigma2 / EXPLAIN_POOL) / sigma2
            residuals = (pool - pool.mean(1, keepdim=True)).flatten() / sigma2**0.5
            skew, kurtosis = residuals.pow(3).mean().item(), residuals.pow(4).mean().item() - 3
            gradients = sampled_gradients(
                policy,
                backbone,
                contexts,
                rewards_of,
                CONTEXTS,
                ROLLOUTS,
                EXPLAIN_BATCHES,
                generator,
            )[0]
            measured = gradient_statistics({key: gradients[key] for key in ("rloo", "xctx", "js")})
            model = bound.cross_context_variance(ratio, ROLLOUTS, CONTEXTS) / bound.rloo_variance(
                ROLLOUTS
            )
            variance = measured["xctx"][0] / measured["rloo"][0]
            cosines = f"{measured['rloo'][1]:.3f} / {measured['xctx'][1]:.3f}"
            lines.append(
                f"| {row} | {iteration} | {ratio:.2f} | {model:.2f} | {variance:.2f} | {cosines} "
                f"| {skew:+.2f} | {kurtosis:+.2f} |"
            )
    return lines


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
    power = []  # could a baseline show here? by each measure: does doubling RLOO's batch gain?
    for which, measure in enumerate(("endpoint", "area")):
        doubled = [gains(a)[which] - gains(b)[which] for a, b in zip(runs[DOUBLED], rloo)]
        mean, half = mean_ci(torch.tensor(doubled, dtype=torch.float64))
        verdict = "gains" if mean - half > 0 else "gains nothing measurable"
        power.append(f"{measure}: doubling RLOO's batch {verdict} ({mean:+.3f} ± {half:.3f})")
    lines = [
        f"\n{name}, the digit {CELLS[name]}'s prompts; lr {rate:g}"
        + (" (the grid's top edge)" if rate == max(RATES) else "")
        + " (tuning, doubling RLOO's "
        "batch, mean paired gain on tuning contexts: "
        + ", ".join(f"{r:g}: {g:+.3f}" for r, g in tuning.items())
        + ")",
        "",
        f"At the start: sigma^2 {sigma2:.3g} within, delta^2 {delta2:.3g} between contexts "
        f"(rho {delta2 / sigma2:.2f}); docs/BOUND.md gives JS an effective batch of "
        f"{factors['rloo']:.2f}x RLOO's and {factors['best']:.2f}x the better of RLOO and "
        f"cross-context with its ideal weight a* (eq. 8), {factors['plug_in_rloo']:.2f}x and "
        f"{factors['plug_in_best']:.2f}x with the plug-in weight (eq. 10), at B = {CONTEXTS}, "
        f"K = {ROLLOUTS}; the plug-in weight, median over batches of {CONTEXTS} contexts, "
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
        f"- could a baseline show here (where doubling RLOO's batch gains)? {'; '.join(power)}",
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
    this_commit_only(args.out_dir)  # no cache of other code is read
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
            lines += explain(args, name, rate)
    path = os.path.join(REPOSITORY, "docs", "regime.png")
    plot(path, results)
    lines.append("\nLearning curves and the JS weight: [docs/regime.png](regime.png)")
    print("\n".join(lines))
    record(
        "regime", " ".join(["python -m evidence.regime_study", *sys.argv[1:]]), lines, at=started
    )


if __name__ == "__main__":
    with one_line_errors():
        main(parser.parse_args())
