"""
The tie study's confirmatory run (docs/RESULTS.md, section "tie-confirm"): JS against RLOO and
cross-context at the tie on fresh seeds, with its prediction, seed counts and analysis fixed in this
file before it ran (the commit that added it is earlier than the one its section names).

    python -m evidence.tie_confirm --jobs 2   # 828 trainings

The exploratory run is evidence.tie_study's (section "tie", commit 73b60683ad9f): mini-sd3, the
digits {2, 8}, B = 4, K = 2, L = 2, a flat start, 30 iterations. This plan uses its numbers, and no
run on the seeds below:
1. Arm B (one rate for all, 0.001): the prediction on the area, the headline measure.
   evidence.bound's plug-in JS factors along the JS tuning run (rho 0.66, 0.68, 0.88, 0.97 at
   iterations 0, 10, 20, 30) times the doubling gain measured on the area (RLOO at 2B - RLOO:
   +0.345), the reward taken as linear in log2 of the batch: JS leads RLOO by +0.075 and
   cross-context by +0.054.
2. Its seeds: 80% power for a one-sided 5% paired test at the lead over cross-context, with the
   larger of the two exploratory spreads of the area (JS - RLOO 0.185 in its pilot, JS -
   cross-context 0.266 over its 83 seeds): 148 seeds, 2000-2147.
3. The analysis: per comparison a one-sided paired t-test on the area (JS above the other); "JS
   beats both" by the intersection-union test, whose p-value is the larger of the two; the
   endpoint (256 held-out contexts) reported beside, not tested.
4. Arm A replicated (JS and RLOO each at its arm A rate, 0.009): the bound predicts no lead
   (eq. 10); the exploratory run measured +0.104 ± 0.051 on the area. Sized to find half of that
   (+0.052) with 80% power in a two-sided 5% paired test, with the exploratory spread 0.257: 192
   seeds, 3000-3191.
"""

import argparse
import math
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
from scipy import stats

from evidence import bound, tie_study
from evidence.regime_study import gains
from evidence.results import (
    commit,
    interval,
    one_line_errors,
    record,
    this_commit_only,
    write_lines_atomic,
)

# the exploratory run's numbers the plan uses (section "tie" at commit 73b60683ad9f)
RHO = {0: 0.66, 10: 0.68, 20: 0.88, 30: 0.97}  # along the JS tuning run at arm B's rate
DOUBLING_AREA = 0.345  # RLOO at 2B - RLOO, area, arm B
SPREADS = dict(rloo=0.185, xctx=0.266)  # per-seed spread of JS - row on the area, arm B
ARM_A_LEAD, ARM_A_SPREAD = 0.104, 0.257  # JS - RLOO on the area in arm A, and its spread
EXPLORATORY_XCTX = (0.028, 0.058, 83)  # JS - cross-context, area, arm B: mean, 95% half, seeds
RATES = dict(B=dict.fromkeys(("js", "rloo", "xctx"), 1e-3), A=dict(js=9e-3, rloo=9e-3))
POWER = 0.8


def plan():
    """The prediction and the seeds, computed from the numbers above alone."""
    prediction = tie_study.predict(RHO, DOUBLING_AREA, torch.Generator().manual_seed(0))
    lead = prediction["lead"]
    spread = max(SPREADS.values())  # "JS beats both": sized by the larger spread
    one_sided = stats.norm.ppf(0.95) + stats.norm.ppf(POWER)
    two_sided = stats.norm.ppf(0.975) + stats.norm.ppf(POWER)
    count_b = math.ceil((one_sided * spread / lead["xctx"]) ** 2)
    count_a = math.ceil((two_sided * ARM_A_SPREAD / (ARM_A_LEAD / 2)) ** 2)
    seeds = dict(B=list(range(2000, 2000 + count_b)), A=list(range(3000, 3000 + count_a)))
    return lead, seeds


def one_sided_p(values):
    """p of a paired t-test that the mean difference is above 0."""
    return float(stats.ttest_1samp(values, 0.0, alternative="greater").pvalue)


def beside_the_plan(b):
    """Written after the run, not part of its plan: arm B's lead over cross-context against the
    variance model's largest lead at the tie (eq. 10's factor at B = 4 times the doubling gain) and
    against the exploratory run's lead, and the two runs pooled with inverse-variance weights."""
    ratio = bound.largest_factor_over_best(2, 4)[0]
    better = min(bound.rloo_variance(2), bound.cross_context_variance(ratio, 2, 4))
    largest = math.log2(better / bound.plug_in_variance(ratio, 2, 4)) * DOUBLING_AREA
    values = tie_study.differences(b["js"], b["xctx"], 1)
    runs = [(statistics.mean(values), statistics.stdev(values) / math.sqrt(len(values)))]
    mean, half, count = EXPLORATORY_XCTX
    runs.append((mean, half / stats.t.ppf(0.975, count - 1)))
    weights = [1 / error**2 for _, error in runs]
    pooled = sum(w * m for w, (m, _) in zip(weights, runs)) / sum(weights)
    z = (runs[0][0] - mean) / math.hypot(runs[0][1], runs[1][1])

    def batch(lead):  # the batch factor a lead is worth, the reward linear in log2 of the batch
        return f"{2 ** (lead / DOUBLING_AREA):.2f}x"

    return [
        f"- Beside the plan (written after the run): JS - xctx on the area {runs[0][0]:+.3f}, "
        f"worth {batch(runs[0][0])} cross-context's batch at the doubling gain; the variance "
        f"model's largest lead at the tie {largest:+.3f} ({batch(largest)}; eq. 10 at B = 4); the "
        f"exploratory run's {mean:+.3f} ± {half:.3f} (z = {z:.1f} for the difference); both runs "
        f"pooled {pooled:+.3f} ± {1.96 / math.sqrt(sum(weights)):.3f} ({batch(pooled)})."
    ]


def arm_lines(arm, runs):
    lines = ["| row | lr | endpoint gain | area under the curve |", "|---|---|---|---|"]
    for row, rate in RATES[arm].items():
        endpoint = interval([gains(r)[0] for r in runs[row]], 3)
        area = interval([gains(r)[1] for r in runs[row]], 3)
        lines.append(f"| {row} | {rate:g} | {endpoint} | {area} |")
    return lines


def main(args):
    started = commit()
    this_commit_only(args.out_dir)
    lead, seeds = plan()
    for path, prompts in zip(tie_study.prompt_files(args.out_dir), tie_study.pair_prompts((2, 8))):
        write_lines_atomic(path, [prompt + "\n" for prompt in prompts])
    runs = {}
    with ThreadPoolExecutor(args.jobs) as pool:
        for arm, rates in RATES.items():
            work = [(row, seed) for row in rates for seed in seeds[arm]]
            found = list(pool.map(lambda r: tie_study.train(args.out_dir, *r, rates[r[0]]), work))
            runs[arm] = {row: [] for row in rates}
            for (row, _), result in zip(work, found):
                runs[arm][row].append(result)
    b, a = runs["B"], runs["A"]
    p = {row: one_sided_p(tie_study.differences(b["js"], b[row], 1)) for row in ("rloo", "xctx")}
    both = max(p.values())
    lines = [
        "The plan, fixed before the run (evidence/tie_confirm.py's docstring): arm B's predicted "
        f"area lead of JS over RLOO {lead['rloo']:+.3f} and over cross-context "
        f"{lead['xctx']:+.3f}; {len(seeds['B'])} seeds ({seeds['B'][0]}-{seeds['B'][-1]}) from "
        f"the larger exploratory spread ({SPREADS['xctx']}; JS - RLOO's {SPREADS['rloo']}) for "
        f"80% power, one-sided 5%; arm A: {len(seeds['A'])} seeds ({seeds['A'][0]}-"
        f"{seeds['A'][-1]}) for half the exploratory +{ARM_A_LEAD} at 80% power, two-sided 5%. "
        "mini-sd3 on the digits {2, 8}, B = 4, K = 2, L = 2, flat start, 30 iterations; mean ± "
        "95% Student-t interval, paired by seed.",
        "",
        f"### Arm B, confirmatory: one rate for all, {RATES['B']['js']:g}",
        "",
        *arm_lines("B", b),
        "",
    ]
    for row in ("rloo", "xctx"):
        area = interval(tie_study.differences(b["js"], b[row], 1), 3)
        endpoint = interval(tie_study.differences(b["js"], b[row], 0), 3)
        lines.append(
            f"- JS - {row}: area {area} (predicted {lead[row]:+.3f}; one-sided p {p[row]:.3g}), "
            f"endpoint {endpoint}"
        )
    verdict = "beats both" if both < 0.05 else "is not shown to beat both"
    lines += [
        f"- JS {verdict} at 5%: intersection-union p {both:.3g} (the larger one-sided p).",
        *beside_the_plan(b),
        "",
        f"### Arm A replicated: each row at its exploratory best rate, {RATES['A']['js']:g}",
        "",
        *arm_lines("A", a),
        "",
    ]
    for measure, index in (("area", 1), ("endpoint", 0)):
        values = tie_study.differences(a["js"], a["rloo"], index)
        p_two = float(stats.ttest_1samp(values, 0.0).pvalue)
        lines.append(f"- JS - RLOO, {measure}: {interval(values, 3)} (two-sided p {p_two:.3g})")
    lines += [
        f"- the bound predicts +0.000; the exploratory run measured +{ARM_A_LEAD} on the area; "
        f"the spread here {statistics.stdev(tie_study.differences(a['js'], a['rloo'], 1)):.3f}.",
    ]
    print("\n".join(lines))
    command = " ".join(["python -m evidence.tie_confirm", *sys.argv[1:]])
    record("tie-confirm", command, lines, at=started)


parser = argparse.ArgumentParser(description="The tie study's confirmatory run")
parser.add_argument("--out-dir", default=os.path.join("out", "tie-confirm"))
parser.add_argument(
    "--jobs", type=int, default=1, help="trainings at the same time, one thread each"
)

if __name__ == "__main__":
    with one_line_errors():
        main(parser.parse_args())
