"""
James-Stein against RLOO and cross-context at once, where theory says it leads: at the tie.

    python -m evidence.tie_study --jobs 2   # about 1,000 trainings of about 4 s on an idle core

With the plug-in weight that trains, JS's lead over the better of RLOO and cross-context is
largest where the two tie, rho = delta^2 / sigma^2 near 1 - 1/(BK) (evidence/bound.py: about 1.15x
their batch at B = 4, K = 2), and below 1 far from it. This study places the test there, states
its prediction before it runs, and sizes it by a power calculation:
1. the contexts: mini-sd3, the prompts of two digits, the pair (from PAIRS) whose rho at the flat
   start, measured on tuning contexts, is nearest the tie;
2. the rates, in two arms, from one grid (RATES) scored on tuning contexts (the pair's training
   prompts with noise seeds of their own, prompts.TUNING_SEED) over TUNING_SEEDS; a best rate at
   the grid's edge widens the grid on that side until it is inside (at most WIDENINGS times).
   Arm A gives each row its own best rate. Arm B gives all rows one rate, by a rule that compares
   no baselines: the largest rate at which the JS tuning run stays at the tie (at_the_tie);
3. per arm, the prediction: rho along the JS tuning run at its rate (its snapshots), the plug-in
   JS's effective batch over RLOO and over cross-context at each (bound.bound_cell, simulated),
   turned into reward by the doubling gain measured in tuning (reward linear in log2 of the
   batch; none where doubling gains nothing), written to prediction-ARM.json before its pilot;
4. per arm, a pilot (PILOT_SEEDS) measures the paired spread of JS - the better of RLOO and
   cross-context; the seed count follows (95%, two-sided, 80% power at the predicted lead;
   between the pilot's count and --max-seeds, the most where no lead is predicted);
5. per arm, the main run: rows JS, RLOO, cross-context and RLOO at 2B, paired by seed; the
   measure chosen before the run is PRIMARY (the area under the held-out curve), the endpoint
   reported beside it; JS - RLOO and JS - cross-context with Holm-adjusted p-values, and the
   headline JS - the better of the two (by mean over the seeds).
Setting: B = 4, K = 2, L = 2, a flat start, 30 iterations. Runs already finished are read, not
repeated (the time recorded is the writing run's own). The report goes to docs/RESULTS.md
(section "tie").
"""

import argparse
import json
import math
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
from scipy import stats

import backbones
from evaluate import load_policy, policy_schedule, score_methods
from evidence import bound
from evidence.regime_study import gains, variances
from evidence.results import (
    commit,
    interval,
    one_line_errors,
    record,
    run_training,
    this_commit_only,
    write_json_atomic,
    write_lines_atomic,
)
from policy import SchedulePolicy, make_policy
from prompts import TUNING_SEED, heldout_contexts, load_prompt_file
from rewards import load_reward
from rewards.digits import digit_of

NAME = "mini-sd3"
PAIRS = ((2, 8), (2, 3), (3, 8), (1, 7), (4, 9), (0, 6))  # candidate digit pairs, {2, 8} first
STEPS, CONTEXTS, ROLLOUTS, ITERATIONS, CURVE = 2, 4, 2, 30, 2
DOUBLED = "rloo at 2B"
ROWS = ["js", "rloo", "xctx", DOUBLED]
RATES = (3e-4, 1e-3, 3e-3)  # widened by a factor 3 on the side a best rate sits at
WIDENINGS = 3  # at most this many rates added on each side
TUNING_SEEDS, TUNING_CONTEXTS = (100, 101, 102, 103), 128
VARIANCE = (64, 8)  # contexts x rollouts drawn to measure rho
TRAJECTORY = (0, 10, 20, 30)  # iterations of the JS tuning run at which rho is measured
BAND = 2.0  # arm B's rate keeps rho within this factor of the tie at every TRAJECTORY point
PILOT_SEEDS = tuple(range(1000, 1020))
MAX_SEEDS = 100
PRIMARY = "area"  # the measure of the headline, chosen before the run
TIE_REWARDS = 2**20  # simulated rewards per plug-in factor (bound.bound_cell)

parser = argparse.ArgumentParser(
    description="James-Stein against RLOO and cross-context at the tie"
)
add = parser.add_argument
add("--out-dir", default="out/tie-study", help="one folder per training, and the study's files")
add("--jobs", type=int, default=1, help="trainings run at the same time, one CPU thread each")
add("--max-seeds", type=int, default=MAX_SEEDS, help="the most seeds the power calculation asks")


# -----------------------------------------------------------------------------
# the measurements


def prompt_files(out_dir):
    return [os.path.join(out_dir, f"prompts-{which}.txt") for which in ("train", "heldout")]


def pair_prompts(pair):
    """The shipped training and held-out prompts of the pair's two digits."""
    shipped = backbones.BACKBONES[NAME]["prompts"]
    return [[p for p in load_prompt_file(path) if digit_of(p) in pair] for path in shipped]


def flat_policy(backbone):
    torch.manual_seed(0)
    return make_policy(
        SchedulePolicy, backbone.policy_dims, STEPS, init="uniform", concentration=STEPS + 1.0
    )


def choose_pair(out_dir, backbone, reward):
    """rho at the flat start of each candidate pair on tuning contexts, and the pair nearest the
    tie (in log rho); kept in pairs.json."""
    path = os.path.join(out_dir, "pairs.json")
    if not os.path.isfile(path):
        policy, measured = flat_policy(backbone), {}
        for pair in PAIRS:
            sigma2, delta2 = variances(
                backbone, reward, policy, pair_prompts(pair)[0], TUNING_SEED, *VARIANCE
            )[1:]
            measured["".join(map(str, pair))] = delta2 / sigma2
        write_json_atomic(path, measured)
    with open(path) as file:
        measured = json.load(file)
    tie = bound.largest_factor_over_best(ROLLOUTS, CONTEXTS)[0]
    best = min(measured, key=lambda pair: abs(math.log(max(measured[pair], 1e-9) / tie)))
    return measured, tuple(int(digit) for digit in best)


def run_folder(out_dir, row, seed, rate):
    return os.path.join(out_dir, "runs", f"{row.replace(' ', '-')}-lr{rate:g}-s{seed}")


def train(out_dir, row, seed, rate, snapshots=False):
    """One training run (read when finished): its eval.json and metrics rows."""
    train_file, heldout_file = prompt_files(out_dir)
    contexts = CONTEXTS * (2 if row == DOUBLED else 1)
    arguments = ["--backbone", NAME, "--steps", str(STEPS), "--rollouts", str(ROLLOUTS)]
    arguments += ["--contexts", str(contexts), "--baseline", row.split()[0], "--lr", f"{rate:g}"]
    arguments += ["--seed", str(seed), "--iterations", str(ITERATIONS)]
    arguments += ["--ckpt-interval", str(CURVE), "--init", "uniform"]
    arguments += ["--concentration", str(STEPS + 1), "--prompts", train_file]
    arguments += ["--eval-prompts", heldout_file, "--without-realism"]
    arguments += ["--snapshots"] if snapshots else []
    return run_training(run_folder(out_dir, row, seed, rate), arguments)


def best_rates(scores, rates):
    """Each row's rate of highest mean tuning score, {row: rate}, and the means, from
    {(row, seed, rate): score}."""
    mean = {
        (row, rate): statistics.mean(scores[(row, seed, rate)] for seed in TUNING_SEEDS)
        for row in ROWS
        for rate in rates
    }
    return {row: max(rates, key=lambda rate: mean[(row, rate)]) for row in ROWS}, mean


@torch.no_grad()
def tune(out_dir, pool, backbone, reward):
    """Every row on the rate grid over TUNING_SEEDS, scored on the tuning contexts; a best rate at
    an edge widens the grid on that side, until every best rate is inside it (at most WIDENINGS
    times per side). Returns {row: rate}, {(row, rate): mean score}, the
    grid; kept in tuning.json."""
    path, scores = os.path.join(out_dir, "tuning.json"), {}
    if os.path.isfile(path):
        with open(path) as file:
            scores = {(row, seed, rate): score for row, seed, rate, score in json.load(file)}
    contexts = heldout_contexts(
        load_prompt_file(prompt_files(out_dir)[0]), TUNING_CONTEXTS, TUNING_SEED
    )
    rates, widened = list(RATES), {"low": 0, "high": 0}
    while True:
        runs = [(row, seed, rate) for rate in rates for row in ROWS for seed in TUNING_SEEDS]
        missing = [run for run in runs if run not in scores]

        def trained(run):
            row, seed, rate = run
            return train(
                out_dir, row, seed, rate, snapshots=(row == "js" and seed == TUNING_SEEDS[0])
            )

        list(pool.map(trained, missing))
        for run in missing:
            policy, _ = load_policy(os.path.join(run_folder(out_dir, *run), "ckpt.pt"))
            method = {"learned": policy_schedule(policy, backbone)}
            scores[run] = (
                score_methods(backbone, reward, *contexts, method)["learned"].mean().item()
            )
        write_json_atomic(path, [[*run, score] for run, score in scores.items()])
        chosen, mean = best_rates(scores, rates)
        edges = {rates[0]: ("low", rates[0] / 3), rates[-1]: ("high", rates[-1] * 3)}
        wider = [
            edges[rate]
            for rate in chosen.values()
            if rate in edges and widened[edges[rate][0]] < WIDENINGS
        ]
        if not wider:
            return chosen, mean, rates
        for side, rate in dict(wider).items():
            widened[side] += 1
            rates = sorted(set(rates) | {float(f"{rate:.3g}")})


@torch.no_grad()
def trajectory(out_dir, backbone, reward, rate):
    """rho along the JS tuning run (seed TUNING_SEEDS[0]), at TRAJECTORY, on tuning contexts."""
    folder = run_folder(out_dir, "js", TUNING_SEEDS[0], rate) + "-snapshots"
    prompts, points = load_prompt_file(prompt_files(out_dir)[0]), {}
    for iteration in TRAJECTORY:
        policy, _ = load_policy(os.path.join(folder, f"policy-{iteration}.pt"))
        sigma2, delta2 = variances(
            backbone, reward, policy, prompts, TUNING_SEED + 10**5, *VARIANCE
        )[1:]
        points[iteration] = delta2 / sigma2
    return points


def at_the_tie(out_dir, backbone, reward, rates):
    """Arm B's one rate for all, by a rule that compares no baselines: the largest rate of the grid
    whose JS tuning run stays at the tie, rho within a factor BAND of it at every TRAJECTORY point
    (where the bound says JS leads; a faster rate concentrates the policy and rho runs off).
    Returns that rate (the smallest rate if none stays) and {rate: trajectory}; kept in
    trajectories.json."""
    path, paths = os.path.join(out_dir, "trajectories.json"), {}
    if os.path.isfile(path):
        with open(path) as file:
            paths = {float(rate): points for rate, points in json.load(file).items()}
    for rate in rates:
        if rate not in paths:
            paths[rate] = trajectory(out_dir, backbone, reward, rate)
    write_json_atomic(path, {f"{rate:g}": points for rate, points in sorted(paths.items())})
    tie = bound.largest_factor_over_best(ROLLOUTS, CONTEXTS)[0]
    stays = [
        rate
        for rate in rates
        if all(tie / BAND <= rho <= tie * BAND for rho in paths[rate].values())
    ]
    return max(stays, default=min(rates)), {rate: paths[rate] for rate in rates}


def plug_in_factors(ratio, generator):
    """The plug-in JS's effective batch per unit of signal over RLOO and over cross-context, and
    JS with a*'s, at B = CONTEXTS, K = ROLLOUTS (evidence/bound.py)."""
    c = bound.bound_cell(ratio, CONTEXTS, ROLLOUTS, TIE_REWARDS, generator)
    ideal = bound.effective_batch(ratio, ROLLOUTS, CONTEXTS)
    per_signal = c["js_per_signal"]
    return dict(
        rloo=c["form"]["rloo"] / per_signal,
        xctx=c["form"]["xctx"] / per_signal,
        ideal_rloo=ideal["rloo"],
        ideal_best=ideal["best"],
    )


def predict(rhos, doubling_gain, generator):
    """The prediction: per rho point its factors; the leads of JS over RLOO, over cross-context and
    over the better of the two, doubling_gain (0 if negative) x the mean log2 factor along the
    trajectory."""
    points = {iteration: plug_in_factors(rho, generator) for iteration, rho in rhos.items()}
    slope, lead = max(doubling_gain, 0.0), {}  # a gain from a larger batch only where it has one
    for name in ("rloo", "xctx"):
        lead[name] = slope * statistics.mean(math.log2(p[name]) for p in points.values())
    lead["best"] = min(lead["rloo"], lead["xctx"])
    return dict(rho=rhos, factors=points, doubling_gain=doubling_gain, lead=lead)


def seed_count(spread, lead, smallest, largest, power=0.8):
    """Seeds for a two-sided 95% paired test to find `lead` with `power`, given the per-seed
    spread: ((z_0.975 + z_power) spread / lead)^2, rounded up, kept within [smallest, largest]."""
    if lead <= 0:
        return largest
    need = ((stats.norm.ppf(0.975) + stats.norm.ppf(power)) * spread / lead) ** 2
    return max(smallest, min(largest, math.ceil(need)))


def holm(p_values):
    """Holm's step-down adjustment of {name: p}: {name: adjusted p}."""
    order = sorted(p_values, key=p_values.get)
    adjusted, running = {}, 0.0
    for rank, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p_values[name]))
        adjusted[name] = running
    return adjusted


def differences(first, second, which):
    """first - second per seed, on the endpoint (0) or the area (1)."""
    return [gains(a)[which] - gains(b)[which] for a, b in zip(first, second)]


def p_value(values):
    """Two-sided paired t-test of mean 0."""
    return float(stats.ttest_1samp(values, 0.0).pvalue)


# -----------------------------------------------------------------------------
# the report


def setting_lines(measured, pair, tuning):
    """The section's head: the setting, the pair, the tuning table and each arm's rates."""
    chosen, mean, rates, shared, paths = tuning
    tie = bound.largest_factor_over_best(ROLLOUTS, CONTEXTS)[0]
    lines = [
        f"{NAME}, B = {CONTEXTS}, K = {ROLLOUTS}, L = {STEPS}, flat start, {ITERATIONS} "
        "iterations; held-out gain over the default (endpoint: 256 contexts; area: its mean "
        f"over the {ITERATIONS // CURVE} checkpoints on the first 32); mean ± 95% Student-t "
        f"interval; paired by seed. The headline measure, chosen before the run: {PRIMARY}.",
        "",
        f"1. The pair: rho = delta^2 / sigma^2 at the flat start on tuning contexts (the tie at "
        f"{tie:.3f}): "
        + ", ".join(f"{{{','.join(p)}}} {r:.2f}" for p, r in measured.items())
        + f"; chosen {{{pair[0]}, {pair[1]}}}.",
        "",
        "2. The rates: mean preference reward on tuning contexts over seeds "
        f"{', '.join(map(str, TUNING_SEEDS))}. Arm A gives each row its best rate; arm B one "
        f"rate for all, {shared:g}, the largest at which the JS tuning run stays at the tie (rho "
        f"within a factor {BAND:g} of it at iterations {', '.join(map(str, TRAJECTORY))}), a "
        "rule that compares no baselines (fixed after the study's first run, whose rate it "
        "gives). rho along the JS tuning run per rate: "
        + "; ".join(
            f"{rate:g}: " + ", ".join(f"{rho:.2f}" for rho in points.values())
            for rate, points in paths.items()
        )
        + ".",
        "",
        "| row | " + " | ".join(f"lr {rate:g}" for rate in rates) + " | arm A |",
        "|---|" + "---|" * (len(rates) + 1),
    ]
    for row in ROWS:
        cells = " | ".join(f"{mean[(row, rate)]:.3f}" for rate in rates)
        edge = " (grid's edge)" if chosen[row] in (rates[0], rates[-1]) else ""
        lines.append(f"| {row} | {cells} | {chosen[row]:g}{edge} |")
    return lines


def arm_lines(title, chosen, prediction, pilot, seeds, runs):
    """One arm: its prediction, pilot and seed count, and the result."""
    lead, doubling = prediction["lead"], prediction["doubling_gain"]
    lines = [
        "",
        f"### {title}",
        "",
        "The prediction, written before the pilot (plug-in JS per unit of signal, evidence.bound, "
        f"at B = {CONTEXTS}, K = {ROLLOUTS}, along the JS tuning run at lr {chosen['js']:g}; "
        f"doubling RLOO's batch gains {doubling:+.3f} on tuning contexts, at the endpoint: the "
        f"headline measure is the {PRIMARY}):",
        "",
        "| iteration | rho | plug-in JS / RLOO | plug-in JS / cross-context | JS a* / RLOO "
        "| JS a* / better |",
        "|---|---|---|---|---|---|",
    ]
    for iteration, rho in prediction["rho"].items():
        f = prediction["factors"][iteration]
        lines.append(
            f"| {iteration} | {rho:.2f} | {f['rloo']:.3f} | {f['xctx']:.3f} | "
            f"{f['ideal_rloo']:.3f} | {f['ideal_best']:.3f} |"
        )
    basis = (
        "reward linear in log2 of the batch"
        if doubling > 0
        else "doubling the batch gains nothing here, so a less noisy baseline gains nothing"
    )
    lines += [
        "",
        f"Predicted lead of JS: over RLOO {lead['rloo']:+.3f}, over cross-context "
        f"{lead['xctx']:+.3f}, over the better of the two {lead['best']:+.3f} ({basis}).",
        "",
        f"The pilot (seeds {PILOT_SEEDS[0]}-{PILOT_SEEDS[-1]}): the per-seed spreads ({PRIMARY}) "
        f"of JS - RLOO {pilot['spreads']['rloo']:.3f} and of JS - cross-context "
        f"{pilot['spreads']['xctx']:.3f}, JS - {pilot['better']} (the better) "
        f"{pilot['difference']}; 80% power at the predicted lead with the larger spread asks "
        f"{pilot['asked']} seeds "
        f"(the most when no lead is predicted), run: {len(seeds)} (seeds {seeds[0]}-{seeds[-1]}; "
        f"at most {pilot['largest']}).",
        "",
        "| row | lr | endpoint gain | area under the curve |",
        "|---|---|---|---|",
    ]
    for row in ROWS:
        endpoint = interval([gains(r)[0] for r in runs[row]], 3)
        area = interval([gains(r)[1] for r in runs[row]], 3)
        lines.append(f"| {row} | {chosen[row]:g} | {endpoint} | {area} |")
    lines.append("")
    for measure, index in {"endpoint": 0, "area": 1}.items():
        p = {n: p_value(differences(runs["js"], runs[n], index)) for n in ("rloo", "xctx")}
        adjusted = holm(p)
        better = max(("rloo", "xctx"), key=lambda n: mean_gain(runs[n], index))
        head = interval(differences(runs["js"], runs[better], index), 3)
        versus = ", ".join(
            f"JS - {n} {interval(differences(runs['js'], runs[n], index), 3)} "
            f"(Holm p {adjusted[n]:.3g})"
            for n in ("rloo", "xctx")
        )
        doubled = interval(differences(runs[DOUBLED], runs["rloo"], index), 3)
        mark = " (headline)" if measure == PRIMARY else ""
        lines.append(
            f"- {measure}{mark}: JS - {better}, the better of the two, {head}; {versus}; "
            f"RLOO at 2B - RLOO {doubled}"
        )
    return lines


def mean_gain(runs, index):
    return statistics.mean(gains(r)[index] for r in runs)


def run_arm(args, pool, backbone, reward, arm, chosen, mean):
    """One arm: the prediction (written once, before its pilot), the pilot, the seed count and
    the main runs. Returns (prediction, pilot, seeds, runs)."""
    path = os.path.join(args.out_dir, f"prediction-{arm}.json")
    rates = {row: f"{rate:g}" for row, rate in chosen.items()}
    prediction = None
    if os.path.isfile(path):
        with open(path) as file:
            prediction = json.load(file)
    if prediction is None or prediction.get("rates") != rates:  # none yet, or for other rates
        rhos = trajectory(args.out_dir, backbone, reward, chosen["js"])
        doubling = mean[(DOUBLED, chosen[DOUBLED])] - mean[("rloo", chosen["rloo"])]
        made = dict(predict(rhos, doubling, torch.Generator().manual_seed(0)), rates=rates)
        write_json_atomic(path, made)
        prediction = json.loads(json.dumps(made))  # as read back: keys are strings
    for key in ("rho", "factors"):
        prediction[key] = {int(k): v for k, v in prediction[key].items()}

    def rows_over(seeds):
        runs = [(row, seed) for row in ROWS for seed in seeds]
        done = list(pool.map(lambda run: train(args.out_dir, *run, chosen[run[0]]), runs))
        found = {row: [] for row in ROWS}
        for (row, _), result in zip(runs, done):
            found[row].append(result)
        return found

    index = 1 if PRIMARY == "area" else 0
    trial = rows_over(PILOT_SEEDS)
    better = max(("rloo", "xctx"), key=lambda n: mean_gain(trial[n], index))
    values = differences(trial["js"], trial[better], index)
    # "JS beats both" needs both comparisons: sized by the larger of their spreads
    spreads = {n: statistics.stdev(differences(trial["js"], trial[n], index)) for n in trial}
    spread = max(spreads["rloo"], spreads["xctx"])
    asked = seed_count(spread, prediction["lead"]["best"], len(PILOT_SEEDS), args.max_seeds)
    pilot = dict(better=better, spread=spread, difference=interval(values, 3), asked=asked)
    pilot["spreads"] = {n: spreads[n] for n in ("rloo", "xctx")}
    pilot["largest"] = args.max_seeds
    seeds = list(range(asked))
    return prediction, pilot, seeds, rows_over(seeds)


def main(args):
    started = commit()
    this_commit_only(args.out_dir)  # no cache of other code is read
    torch.set_num_threads(1)
    backbone = backbones.load_backbone(NAME)
    reward = load_reward("preference", backbone)
    measured, pair = choose_pair(args.out_dir, backbone, reward)
    for path, prompts in zip(prompt_files(args.out_dir), pair_prompts(pair)):
        write_lines_atomic(path, [prompt + "\n" for prompt in prompts])
    with ThreadPoolExecutor(args.jobs) as pool:
        chosen, mean, rates = tune(args.out_dir, pool, backbone, reward)
        shared, paths = at_the_tie(args.out_dir, backbone, reward, rates)
        lines = setting_lines(measured, pair, (chosen, mean, rates, shared, paths))
        arms = {
            "A": ("Arm A: each row its own best rate", chosen),
            "B": (f"Arm B: one rate for all, {shared:g}", dict.fromkeys(ROWS, shared)),
        }
        for arm, (title, rates_of) in arms.items():
            found = run_arm(args, pool, backbone, reward, arm, rates_of, mean)
            lines += arm_lines(title, rates_of, *found)
    print("\n".join(lines))
    record("tie", " ".join(["python -m evidence.tie_study", *sys.argv[1:]]), lines, at=started)


if __name__ == "__main__":
    with one_line_errors():
        main(parser.parse_args())
