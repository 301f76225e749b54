"""
docs/BOUND.md checked: the variance of the advantage r - b of each baseline (RLOO, cross-context,
JS with the ideal weight a*, the variance-optimal mix, JS with the plug-in weight) in the
random-effects model r[c, i] = mu_c + eps (Var sigma^2 = 1), mu_c = mu_0 + xi (Var delta^2), in
closed form beside simulated batches; JS's effective-batch factors; and the plug-in JS against the
better of RLOO and cross-context where the two tie. Writes docs/RESULTS.md (section "bound") and
out/bound/bound.png.

    python -m evidence.bound            # a few minutes on one core
    python -m evidence.bound --quick    # far fewer simulations, docs/RESULTS.md left as it is
"""

import argparse
import itertools
import math
import os
import time

import torch

import baselines
from evidence.results import commit, one_line_errors, record, this_commit_only
from toy_js import oracle_weight, simulate

parser = argparse.ArgumentParser("python -m evidence.bound", description=__doc__.split("\n")[1])
parser.add_argument("--out-dir", default="out/bound", help="bound.png goes here")
parser.add_argument("--quick", action="store_true", help="far fewer simulations, nothing recorded")

RATIOS = (0.0, 0.1, 0.3, 1.0, 3.0, 10.0)  # delta^2 / sigma^2, docs/BOUND.md's table
ROLLOUTS, CONTEXTS = (2, 4), (4, 16)  # K and B
TIE_CONTEXTS, TIE_OFF = (3, 4, 8, 16, 32), (0.0, 0.3, 3.0)  # K = 2: at, off the tie (B = 4)
QUANTILES = 400  # per variable of the plug-in weight's quadrature (plug_in_variance)
REWARDS, QUICK_REWARDS = 2**21, 2**13  # simulated rewards per cell


# -----------------------------------------------------------------------------
# the closed forms
# Functions of ratio = rho = delta^2 / sigma^2, K and B (B = math.inf gives the limit), N = B*K.
FORMS = ("rloo", "xctx", "js a*", "oracle")  # printed; "ideal" (b = mu_c, 1) is checked too


def rloo_variance(rollouts):
    """K / (K-1), whatever B and rho (docs/BOUND.md, eq. 1)."""
    return rollouts / (rollouts - 1)


def cross_context_variance(ratio, rollouts, contexts=math.inf):
    """N/(N-1) + rho K^2 B(B-1) / (N-1)^2 (docs/BOUND.md, eq. 2), written in 1/N and 1/B."""
    inverse = 1 / (contexts * rollouts)  # 1/N
    return 1 / (1 - inverse) + ratio * (1 - 1 / contexts) / (1 - inverse) ** 2


def mix_variance(weight, ratio, rollouts, contexts=math.inf):
    """b = (1 - a) b_rloo + a b_xctx, a fixed: 1 + (1-a)^2 / (K-1) + a^2 M_x + 2 a (1-a) / (N-1),
    M_x = eq. 2 - 1 (docs/BOUND.md, eq. 3)."""
    inverse = 1 / (contexts * rollouts)
    shared = inverse / (1 - inverse)  # 1/(N-1), the covariance of the two baselines' errors
    cross_error = cross_context_variance(ratio, rollouts, contexts) - 1  # M_x
    rloo_error, keep = 1 / (rollouts - 1), 1 - weight
    return 1 + keep**2 * rloo_error + weight**2 * cross_error + 2 * weight * keep * shared


def variance_optimal_weight(ratio, rollouts, contexts=math.inf):
    """a_var, the fixed weight that minimises eq. 3 (docs/BOUND.md, eq. 5); its mix is
    oracle_baseline."""
    return (1 / (rollouts - 1)) / (1 / (rollouts - 1) + ratio / (1 - 1 / (contexts * rollouts)))


def effective_batch(ratio, rollouts, contexts=math.inf, weight=None):
    """{"rloo": V_rloo / V, "best": min(V_rloo, V_xctx) / V}, V the variance of the mix with weight
    a (a* unless given): the batch RLOO or the better of the two needs (docs/BOUND.md, eq. 8)."""
    weight = oracle_weight(ratio, rollouts) if weight is None else weight
    variance = mix_variance(weight, ratio, rollouts, contexts)
    better = min(rloo_variance(rollouts), cross_context_variance(ratio, rollouts, contexts))
    return {"rloo": rloo_variance(rollouts) / variance, "best": better / variance}


def largest_factor_over_best(rollouts, contexts=math.inf):
    """(rho, factor): the largest factor over the better of RLOO and XCTX any baseline of the other
    rewards reaches, where the two tie (docs/BOUND.md, eq. 9)."""
    inverse = 1 / (contexts * rollouts)
    ratio = (1 - inverse) / (rollouts - 1)
    return ratio, 2 * rollouts / (2 * rollouts - 1 + (rollouts - 1) * inverse / (1 - inverse))


def plug_in_variance(ratio, rollouts, contexts):
    """Var(r - b) / sigma^2 of JS with the plug-in weight, in the independent-weight approximation
    (docs/BOUND.md, eq. 10): eq. 3 averaged over the weight's sampling distribution. For Gaussian
    rewards s2 ~ chi^2_{B(K-1)} / (B(K-1)) and the spread of the context means (as d2 reads it)
    ~ (rho + 1/K) (N/(N-1))^2 chi^2_{B-1} / (B-1) are independent; a(s2, spread) as baselines.py
    computes it, averaged over a grid of QUANTILES quantiles of each. It leaves out that the weight
    moves with the reward it shrinks, which the simulated variance per unit of signal contains."""
    from scipy.stats import chi2

    levels = (torch.arange(QUANTILES, dtype=torch.float64) + 0.5) / QUANTILES
    pooled, between = contexts * (rollouts - 1), contexts - 1  # degrees of freedom
    s2 = torch.as_tensor(chi2.ppf(levels, pooled) / pooled)[None, :]
    inflation = (contexts * rollouts / (contexts * rollouts - 1)) ** 2
    spread = torch.as_tensor(chi2.ppf(levels, between) / between)[:, None]
    spread = spread * (ratio + 1 / rollouts) * inflation
    weight = baselines.js_weight(s2, spread, rollouts)  # (QUANTILES, QUANTILES)
    return mix_variance(weight, ratio, rollouts, contexts).mean().item()


def factor_table(ratios=RATIOS, rollouts=(2, 4), contexts=(16, math.inf)):
    """The lines of docs/BOUND.md's table: effective_batch per rho, K and B."""
    columns = list(itertools.product(rollouts, contexts))
    head = " | ".join(f"K={k} B={b:<4g}  " for k, b in columns)
    lines = [f"d2/s2 | {head}".rstrip(), "      | " + " | ".join("/rloo  /best" for _ in columns)]
    for ratio in ratios:
        factors = [effective_batch(ratio, k, b) for k, b in columns]
        row = " | ".join(f"{f['rloo']:5.3f}  {f['best']:5.3f}" for f in factors)
        lines.append(f"{ratio:>5g} | {row}")
    return lines


# -----------------------------------------------------------------------------
# simulated batches of the random-effects model


def bound_cell(ratio, contexts, rollouts, rewards, generator):
    """Closed forms and simulated means (with standard errors) of Var(r - b) / sigma^2. "kept" is
    1 - mean of (b_js - mu_c) eps, by Stein's lemma 1 - E[d b_js / d r]: the share of the gradient's
    signal the plug-in JS keeps (docs/BOUND.md)."""
    weights = {
        "js a*": oracle_weight(ratio, rollouts),
        "oracle": variance_optimal_weight(ratio, rollouts, contexts),
    }

    def advantage_squares(rewards, means, noise):  # per batch, the mean of (r - b)^2
        own, cross = baselines.rloo(rewards), baselines.cross_context(rewards)
        estimates = {"rloo": own, "xctx": cross, "ideal": means}
        estimates.update({name: (1 - a) * own + a * cross for name, a in weights.items()})
        estimates["js"] = baselines.james_stein(rewards)
        if contexts >= baselines.MIN_CONTEXTS["js-unbiased"]:
            estimates["js-unbiased"] = baselines.james_stein_unbiased(rewards)
        squares = {name: (rewards - b).square().mean((-2, -1)) for name, b in estimates.items()}
        return dict(squares, kept=1 - ((estimates["js"] - means) * noise).mean((-2, -1)))

    batches = max(rewards // (contexts * rollouts), 16)
    squares = simulate(advantage_squares, ratio, contexts, rollouts, batches, generator)
    form = {
        "rloo": rloo_variance(rollouts),
        "xctx": cross_context_variance(ratio, rollouts, contexts),
        **{name: mix_variance(a, ratio, rollouts, contexts) for name, a in weights.items()},
        "ideal": 1.0,
    }
    simulated = {name: value.mean().item() for name, value in squares.items()}
    error = {name: value.std().item() / math.sqrt(batches) for name, value in squares.items()}
    z = {name: (simulated[name] - form[name]) / error[name] for name in form}
    per_signal = simulated["js"] / simulated["kept"] ** 2  # the plug-in's variance per unit signal
    cell = dict(ratio=ratio, K=rollouts, B=contexts, batches=batches, form=form, z=z)
    return dict(cell, simulated=simulated, standard_error=error, js_per_signal=per_signal)


def bound_lines(cells):
    """The tables: closed form against simulation, then the factors."""
    lines = ["Var(r - b) / sigma^2, closed form (docs/BOUND.md) and simulated", "", "```"]
    lines.append(
        " K   B  d2/s2 |  rloo (sim)   |  xctx (sim)   | js a* (sim)   | oracle (sim)  | max|z|"
        " |  js    kept js/kept^2 js-unb"
    )
    for c in cells:
        pairs = [f"{c['form'][n]:6.3f} {c['simulated'][n]:6.3f}" for n in FORMS]
        largest = max(abs(z) for z in c["z"].values())
        plug_in = f"{c['simulated']['js']:6.3f} {c['simulated']['kept']:5.3f}"
        tail = f"{plug_in} {c['js_per_signal']:9.3f} {c['simulated']['js-unbiased']:6.3f}"
        head = f"{c['K']:>2} {c['B']:>3} {c['ratio']:>6g}"
        lines.append(f"{head} | {' | '.join(pairs)} | {largest:6.1f} | {tail}")
    lines += ["```", "", "Effective batch of JS (weight a*), closed forms (BOUND.md, eq. 8):", ""]
    return lines + ["```", *factor_table(), "```"]


def bound_summary(cells):
    """The conclusions, one line each."""
    largest = max(abs(z) for c in cells for z in c["z"].values())
    lines = [
        f"closed forms against {len(cells)} simulated cells: largest |z| = {largest:.1f} "
        f"(each a mean of (r - b)^2 over the cell's batches, in standard errors)"
    ]
    for rollouts in ROLLOUTS:
        ceilings = []
        for contexts in (16, math.inf):
            ratio, factor = largest_factor_over_best(rollouts, contexts)
            js = effective_batch(ratio, rollouts, contexts)["best"]
            ceilings.append(
                f"B={contexts:g}: {factor:.3f} at d2/s2 = {ratio:.3f} (JS a*: {js:.3f})"
            )
        lines.append(
            f"K={rollouts}: largest factor over the better of RLOO and XCTX, {', '.join(ceilings)}"
            f"; b = mu_c itself is worth {rloo_variance(rollouts):.3f}x RLOO's batch"
        )
    c = next(c for c in cells if (c["K"], c["B"], c["ratio"]) == (2, 16, 1.0))
    better = min(c["form"]["rloo"], c["form"]["xctx"])
    plug_in, kept = c["simulated"]["js"] / better, c["simulated"]["kept"]
    oracle, per_signal = c["form"]["oracle"] / better, c["js_per_signal"] / better
    return lines + [
        f"K=2 B=16 d2/s2=1: plug-in JS's Var(r - b) is {plug_in:.3f}x the better of RLOO "
        f"and XCTX, below the oracle's {oracle:.3f}x: it keeps {kept:.3f} of the signal, "
        f"so per unit of signal {per_signal:.3f}x"
    ]


def tie_cells(rewards, generator):
    """The plug-in JS against the better of RLOO and XCTX at K = 2: at the tie (where eq. 9's
    factor is largest) for each B of TIE_CONTEXTS, and off it at B = 4 (rho of TIE_OFF)."""
    points = [(largest_factor_over_best(2, b)[0], b) for b in TIE_CONTEXTS]
    points += [(ratio, 4) for ratio in TIE_OFF]
    return [bound_cell(ratio, contexts, 2, rewards, generator) for ratio, contexts in points]


def tie_lines(cells):
    """Per cell: the effective batch over the better of RLOO and XCTX of JS with a* (closed form,
    eq. 8), of the plug-in JS in the independent-weight approximation (eq. 10) and of the plug-in
    JS per unit of signal (simulated, ± its standard error)."""
    lines = ["", "Plug-in JS against the better of RLOO and XCTX, K = 2 (effective batch):", ""]
    lines += [
        "```",
        "  B  d2/s2 | JS a* (eq. 8) | plug-in (eq. 10) | plug-in per unit of signal (sim ± se)",
    ]
    for c in cells:
        better = min(c["form"]["rloo"], c["form"]["xctx"])
        factor = better / c["js_per_signal"]
        spread = factor * c["standard_error"]["js"] / c["simulated"]["js"]
        ideal = effective_batch(c["ratio"], 2, c["B"])["best"]
        approximation = better / plug_in_variance(c["ratio"], 2, c["B"])
        head = f"{c['B']:>3} {c['ratio']:>6.3f} | {ideal:13.3f} | {approximation:16.3f}"
        lines.append(f"{head} | {factor:.3f} ± {spread:.3f}")
    return lines + ["```"]


def plot_bound(cells, path):
    """The effective batch over the better of RLOO and XCTX at K = 2, B = 16: closed forms as
    lines, simulated batches as markers."""
    from matplotlib.figure import Figure

    axes = Figure(figsize=(6, 4), layout="tight").subplots()
    ratios = [10 ** (k / 40) for k in range(-60, 61)]  # 0.03 .. 30
    for contexts, style in ((16, "-"), (math.inf, ":")):
        factors = [effective_batch(ratio, 2, contexts)["best"] for ratio in ratios]
        axes.plot(ratios, factors, style, color="C1", label=f"js a*, closed form, B={contexts:g}")
    ideal = [min(2.0, cross_context_variance(ratio, 2, 16)) for ratio in ratios]
    axes.plot(ratios, ideal, "--", color="gray", label="b = mu_c, closed form, B=16")
    row = [c for c in cells if c["K"] == 2 and c["B"] == 16 and c["ratio"] > 0]
    better = [min(c["form"]["rloo"], c["form"]["xctx"]) for c in row]
    simulated = {
        "js a*": [c["simulated"]["js a*"] for c in row],
        "js (plug-in), raw": [c["simulated"]["js"] for c in row],
        "js (plug-in), per unit of signal": [c["js_per_signal"] for c in row],
        "js-unbiased": [c["simulated"]["js-unbiased"] for c in row],
    }
    for (name, variances), marker in zip(simulated.items(), "o^sD"):
        factors = [b / v for b, v in zip(better, variances)]
        axes.plot([c["ratio"] for c in row], factors, marker, fillstyle="none", label=name)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set(xscale="log", xlabel="delta^2 / sigma^2", ylim=(0.8, 2.1))
    axes.set(ylabel="min(V_rloo, V_xctx) / V", title="effective batch over the better, K=2, B=16")
    axes.legend(fontsize=8)
    axes.figure.savefig(path, dpi=110)


def main(out_dir, quick=False):
    """The tables, printed, with the figure; returns the printed lines."""
    torch.set_num_threads(1)  # small batches: one thread is fastest
    this_commit_only(out_dir)
    generator, rewards = torch.Generator().manual_seed(0), QUICK_REWARDS if quick else REWARDS
    grid = itertools.product(ROLLOUTS, CONTEXTS, RATIOS)  # K, B, delta^2/sigma^2
    cells = [bound_cell(ratio, B, K, rewards, generator) for K, B, ratio in grid]
    lines = [*bound_lines(cells), *tie_lines(tie_cells(rewards, generator))]
    lines += ["", "Conclusions:", "", *(f"- {line}" for line in bound_summary(cells))]
    print("\n".join(lines))
    plot_bound(cells, os.path.join(out_dir, "bound.png"))
    return lines


if __name__ == "__main__":
    args = parser.parse_args()
    started, code = time.time(), commit()
    with one_line_errors():
        lines = main(args.out_dir, args.quick)
        if not args.quick:
            record("bound", "python -m evidence.bound", lines, at=code)
    written = f"{args.out_dir}/bound.png" + ("" if args.quick else " and docs/RESULTS.md (bound)")
    print(f"\nwrote {written} in {time.time() - started:.1f} s")
