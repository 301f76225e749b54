"""
Why James-Stein shrinkage helps REINFORCE, on problems small enough to know the right answer;
writes OUT_DIR/toy_js.json (every number) and OUT_DIR/toy_js.png, and prints its tables.

    python toy_js.py            # the full simulations
    python toy_js.py --quick    # far fewer simulations, the same tables (the tests run this)
    python -m evidence.toy_js   # the full run, its tables also into docs/RESULTS.md

Part A, estimation: rewards r[c, i] = mu_c + eps (Var sigma^2 = 1), mu_c = mu_0 + xi (Var delta^2),
the paper's random-effects model: the MSE of each baseline (baselines.py) as an estimate of mu_c.
Part B, gradients: a Dirichlet contextual bandit whose expected reward has a closed form, so the
MSE of the REINFORCE estimate against the exact gradient is the noise a baseline leaves.
What a baseline's variance is worth in batch size, in closed form: docs/BOUND.md, checked by
`python -m evidence.bound`.
"""

import argparse
import itertools
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch.distributions import Dirichlet

import baselines

parser = argparse.ArgumentParser(description="James-Stein baselines on toy problems")
parser.add_argument("--out-dir", default="out/toy_js", help="the JSON and PNG go here")
parser.add_argument("--quick", action="store_true", help="far fewer simulations, same tables")

RATIOS = (0.0, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0)  # part A: delta^2 / sigma^2
ROLLOUTS, CONTEXTS = (2, 4, 8), (4, 16, 32)  # part A: K and B
SIGNIFICANT = 3.5  # |z| above this: two-sided p < 4.7e-4 per look
OFFSET_SPREADS = (0.0, 1.0, 10.0)  # part B: std of the hidden per-context offsets, in rollout noise
BANDIT = dict(actions=5, features=4, contexts=16, rollouts=2)
# rewards per part A cell (first look, most while JS - RLOO is unresolved); batches: part B's
FULL = dict(rewards=(2**19, 2**23), batches=4000)
QUICK = dict(rewards=(2**14, 2**14), batches=256)
ESTIMATORS = {name: baselines.BASELINES[name] for name in ("rloo", "xctx", "js", "js-unbiased")}
BASELINES = {"none": torch.zeros_like, **ESTIMATORS}  # part B also tries no baseline


def normal(shape, generator):  # float64 draws, as every simulation here uses
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def simulate(measure, ratio, contexts, rollouts, batches, generator):
    """name -> (batches,): measure(rewards, means, noise) over simulated batches of the
    random-effects model (sigma^2 = 1, delta^2 = ratio), 2^20 rewards at a time."""
    chunk = 2**20 // (contexts * rollouts)
    results = []
    for start in range(0, batches, chunk):
        size = min(chunk, batches - start)
        means = 3.0 + math.sqrt(ratio) * normal((size, contexts, 1), generator)  # mu_c
        noise = normal((size, contexts, rollouts), generator)  # eps
        results.append(measure(means + noise, means, noise))
    return {name: torch.cat([result[name] for result in results]) for name in results[0]}


def z_score(differences):  # of the mean of paired differences
    standard_error = differences.std().item() / math.sqrt(differences.numel())
    return differences.mean().item() / max(standard_error, 1e-300)


# ---- part A: estimating mu_c under the random-effects model
def oracle_weight(ratio, rollouts):
    """a* = (1/(K-1)) / (1/(K-1) + rho), JS's weight with sigma^2 and delta^2 known (the paper's
    weight; docs/BOUND.md, eq. 4)."""
    return (1 / (rollouts - 1)) / (1 / (rollouts - 1) + ratio)


def oracle_baseline(rewards, sigma2, delta2):
    """(..., B, K) -> (..., B, K): E[mu_c | every reward but r[c, i]], sigma^2 and delta^2 known, a
    flat prior on mu_0: rloo shrunk by a* towards mu_0's generalised-least-squares estimate from the
    other contexts' means (variance delta^2 + sigma^2/K) and this context's rloo."""
    contexts, rollouts = rewards.shape[-2:]
    own, means = baselines.rloo(rewards), rewards.mean(-1)
    others = (means.sum(-1, keepdim=True) - means)[..., None]  # (..., B, 1) others' sum
    own_precision = 1 / (delta2 + sigma2 / (rollouts - 1))
    other_precision = 1 / (delta2 + sigma2 / rollouts)
    total_precision = own_precision + (contexts - 1) * other_precision
    grand_mean = (own_precision * own + other_precision * others) / total_precision
    weight = oracle_weight(delta2 / sigma2, rollouts)
    return (1 - weight) * own + weight * grand_mean


def estimation_cell(ratio, contexts, rollouts, rewards_per_cell, generator):
    """Each baseline's MSE, doubling the batches while JS - RLOO is unresolved (|z| <= SIGNIFICANT):
    most cells settle at the first look and the near-ties get the simulations."""

    def squared_errors(rewards, means, noise):  # per batch, over its B*K baselines
        estimates = {name: estimate(rewards) for name, estimate in ESTIMATORS.items()}
        estimates["oracle"] = oracle_baseline(rewards, 1.0, ratio)
        errors = {name: (b - means).square().mean((-2, -1)) for name, b in estimates.items()}
        return dict(errors, weight=baselines.shrinkage(rewards))

    first, most = (rewards // (contexts * rollouts) for rewards in rewards_per_cell)  # in batches
    batches = max(first, 16)
    errors = simulate(squared_errors, ratio, contexts, rollouts, batches, generator)
    while abs(z_score(errors["js"] - errors["rloo"])) <= SIGNIFICANT and 2 * batches <= most:
        more = simulate(squared_errors, ratio, contexts, rollouts, batches, generator)
        errors = {name: torch.cat([errors[name], more[name]]) for name in errors}
        batches *= 2
    cell = dict(ratio=ratio, K=rollouts, B=contexts, batches=batches)
    cell["mean_weight"] = errors.pop("weight").mean().item()
    cell["true_weight"] = oracle_weight(ratio, rollouts)
    cell["mse"] = {name: error.mean().item() for name, error in errors.items()}
    cell["js_minus_rloo_z"] = z_score(errors["js"] - errors["rloo"])
    cell["unbiased_minus_rloo_z"] = z_score(errors["js-unbiased"] - errors["rloo"])
    return cell


def estimation_summary(cells):
    """The conclusions of part A, one line each."""
    below = [c for c in cells if c["js_minus_rloo_z"] < -SIGNIFICANT]
    lower = sum(c["mse"]["js"] < c["mse"]["rloo"] for c in cells)
    significantly = f"significantly (z < -{SIGNIFICANT}) in {len(below)}."
    lines = [f"JS below RLOO in {lower} of {len(cells)} cells, {significantly}"]
    for c in [c for c in cells if c["js_minus_rloo_z"] >= -SIGNIFICANT]:
        z, change = c["js_minus_rloo_z"], 100 * (c["mse"]["js"] / c["mse"]["rloo"] - 1)
        verdict = "JS significantly ABOVE RLOO" if z > SIGNIFICANT else "unresolved tie"
        where = f"K={c['K']} B={c['B']} d2/s2={c['ratio']:g}: JS - RLOO = {change:+.3f}%"
        lines.append(f"  {verdict}: {where} of RLOO's MSE (z = {z:+.1f})")
    worst = max(cells, key=lambda c: c["mse"]["js"] / c["mse"]["oracle"])
    excess = max((c["mse"]["js"] - c["mse"]["oracle"]) / c["mse"]["rloo"] for c in cells)
    lines.append(
        f"JS MSE is at most {worst['mse']['js'] / worst['mse']['oracle']:.2f}x the oracle's "
        f"(K={worst['K']} B={worst['B']} d2/s2={worst['ratio']:g}, where JS's a averages "
        f"{worst['mean_weight']:.2f} against the true {worst['true_weight']:.2f}) and exceeds it "
        f"by at most {100 * excess:.1f}% of RLOO's MSE."
    )
    worse = [c for c in cells if c["unbiased_minus_rloo_z"] > SIGNIFICANT]
    by_contexts = {b: sum(c["B"] == b for c in worse) for b in CONTEXTS}
    line = f"JS-unbiased significantly above RLOO in {len(worse)} cells, by B: {by_contexts}"
    if worse:
        most = max(c["mse"]["js-unbiased"] / c["mse"]["rloo"] - 1 for c in worse)
        line += f"; worst {100 * most:+.0f}% of RLOO's MSE"
    return lines + [line + "."]


# ---- part B: a Dirichlet contextual bandit
def expected_quality(alpha, target):
    """E[-|tau - target|^2] for tau ~ Dirichlet(alpha), (..., M) -> (...), in closed form: Dirichlet
    mean m = alpha / alpha_0 and variance m (1 - m) / (alpha_0 + 1) per coordinate."""
    total = alpha.sum(-1, keepdim=True)
    mean = alpha / total
    return -(mean * (1 - mean) / (total + 1) + (mean - target).square()).sum(-1)


class Bandit:
    """Contexts x, alpha = softplus(W x + b) + 1e-3, tau ~ Dirichlet(alpha) and rewards
    r = offset_c + scale_c * (-|tau - target(x)|^2), the best action target(x) = softmax(A x), in
    units of the rollout noise at the initial policy (every alpha near 2)."""

    def __init__(self, generator, actions, features):
        self.shape, self.noise_unit = (actions, features), 1.0  # noise_unit: calibrated below
        self.mixing = normal(self.shape, generator)  # A
        weight, bias = self.initial_policy()
        inputs, targets, offsets, scales = self.draw((2048,), 0.0, generator)
        tau = Dirichlet(self.alpha(weight, bias, inputs)).sample((64,)).movedim(0, -2)  # (B, K, M)
        self.noise_unit = self.rewards(tau, targets, offsets, scales).var(-1).mean().sqrt().item()

    def initial_policy(self, leading=()):  # W = 0, b = softplus^-1(2): every alpha near 2
        bias = torch.full(leading + self.shape[:1], math.log(math.expm1(2.0)), dtype=torch.float64)
        return torch.zeros(leading + self.shape, dtype=torch.float64), bias

    def alpha(self, weight, bias, features):
        """weight (..., M, D), bias (..., M), features (..., B, D) -> (..., B, M), as policy.py."""
        return F.softplus(features @ weight.transpose(-1, -2) + bias[..., None, :]) + 1e-3

    def draw(self, shape, offset_spread, generator):
        """-> features (*shape, D), targets (*shape, M), offsets (*shape,), scales (*shape,)."""
        features = normal(shape + self.shape[1:], generator)
        offsets = offset_spread * normal(shape, generator)
        scales = torch.exp(0.5 * normal(shape, generator))  # log-normal, x1.6
        return features, torch.softmax(features @ self.mixing.T, -1), offsets, scales

    def rewards(self, tau, targets, offsets, scales):
        """tau (..., B, K, M) -> (..., B, K)."""
        quality = -(tau - targets[..., None, :]).square().sum(-1)
        return offsets[..., None] + scales[..., None] * quality / self.noise_unit


def gradient_errors(bandit, offset_spread, batches, generator):
    """Per baseline, (mean, standard error) over batches of |REINFORCE - exact gradient|^2 /
    E|exact|^2 at the initial policy, the objective (1/B) sum_c E[r_c]."""
    weight, bias = (p.requires_grad_(True) for p in bandit.initial_policy((batches,)))
    shape = (batches, BANDIT["contexts"])
    features, targets, offsets, scales = bandit.draw(shape, offset_spread, generator)
    alpha = bandit.alpha(weight, bias, features)  # (R, B, M)

    def gradient(objective):  # (R, P)
        parts = torch.autograd.grad(objective, (weight, bias), retain_graph=True)
        return torch.cat([part.flatten(1) for part in parts], 1)

    expected = offsets + scales * expected_quality(alpha, targets) / bandit.noise_unit  # (R, B)
    exact = gradient(expected.mean(-1).sum())  # (R, P)
    tau = Dirichlet(alpha.detach()).sample((BANDIT["rollouts"],)).movedim(0, -2)  # (R, B, K, M)
    rewards = bandit.rewards(tau, targets, offsets, scales)  # (R, B, K)
    log_prob = Dirichlet(alpha[..., None, :]).log_prob(tau)  # (R, B, K): the whole action's density
    results = {}
    for name, baseline in BASELINES.items():
        estimate = gradient(((rewards - baseline(rewards)) * log_prob).mean((-2, -1)).sum())
        error = (estimate - exact).square().sum(1) / exact.square().sum(1).mean()  # (R,)
        results[name] = (error.mean().item(), error.std().item() / math.sqrt(batches))
    return results


def plot_toy_js(cells, path):
    """Each baseline's MSE over RLOO's against delta^2/sigma^2 at K = 2, B = 16 (part A)."""
    from matplotlib.figure import Figure

    axes = Figure(figsize=(6, 4), layout="tight").subplots()
    row = [c for c in cells if c["K"] == 2 and c["B"] == 16]
    for name in ("xctx", "js", "js-unbiased", "oracle"):
        relative = [c["mse"][name] / c["mse"]["rloo"] for c in row]
        axes.plot([c["ratio"] for c in row], relative, "-o", markersize=3, label=name)
    axes.axhline(1.0, color="black", linestyle="--", label="rloo")
    axes.set(xscale="symlog", yscale="log", xlabel="delta^2 / sigma^2 (symlog)", xlim=(0, 150))
    axes.set(ylabel="MSE / RLOO's MSE", title="estimating a context's mean reward, K=2, B=16")
    axes.legend(fontsize=8)
    axes.figure.savefig(path, dpi=110)


def main(out_dir, quick=False):
    """Parts A and B: prints their tables, writes out_dir/toy_js.json and toy_js.png, and returns
    the printed lines (evidence/toy_js.py records them)."""
    torch.set_num_threads(1)  # small batches: one thread is fastest
    os.makedirs(out_dir, exist_ok=True)
    started, settings = time.time(), QUICK if quick else FULL

    # ---- part A: estimation
    generator = torch.Generator().manual_seed(0)
    grid = itertools.product(ROLLOUTS, CONTEXTS, RATIOS)  # K, B, delta^2/sigma^2
    cells = [estimation_cell(ratio, B, K, settings["rewards"], generator) for K, B, ratio in grid]
    columns = " K   B  d2/s2 |    rloo     xctx      js  js-unb  oracle | a_true a_mean | js-rloo z"
    lines = ["Part A: MSE of b[c, i] as an estimate of mu_c (sigma^2 = 1)", "", "```", columns]
    for c in cells:
        mse = " ".join(f"{value:>7.4f}" for value in c["mse"].values())  # rloo, ..., oracle
        tail = f"{c['true_weight']:>6.3f} {c['mean_weight']:>6.3f} | {c['js_minus_rloo_z']:>+9.1f}"
        lines.append(f"{c['K']:>2} {c['B']:>3} {c['ratio']:>6g} | {mse} | {tail}")
    lines.append("```")
    conclusions = estimation_summary(cells)

    # ---- part B: gradients
    torch.manual_seed(0)  # Dirichlet sampling draws from the global generator
    bandit = Bandit(generator, BANDIT["actions"], BANDIT["features"])
    batches = settings["batches"]
    gradients = [gradient_errors(bandit, spread, batches, generator) for spread in OFFSET_SPREADS]
    setup = "Dirichlet bandit, B={contexts}, K={rollouts}, {actions} actions".format(**BANDIT)
    lines += ["", f"Part B: {setup}: gradient MSE / E|grad|^2 at the initial policy (+- se)", ""]
    lines.append("```")
    for spread, gradient in zip(OFFSET_SPREADS, gradients):
        row = " ".join(f"{name} {m:.3f}+-{s:.3f}" for name, (m, s) in gradient.items())
        lines.append(f"offset spread {spread:>4g} | {row}")
        rloo_mse = gradient["rloo"][0]
        relative = [f"{n}/rloo = {gradient[n][0] / rloo_mse:.2f}" for n in ("js", "xctx", "none")]
        conclusions.append(f"offset spread {spread:g}: gradient MSE " + ", ".join(relative))
    lines.append("```")

    lines += ["", "Conclusions:", "", *(f"- {line}" for line in conclusions)]
    print("\n".join(lines))
    plot_toy_js(cells, os.path.join(out_dir, "toy_js.png"))
    gradient = dict(zip(map(str, OFFSET_SPREADS), gradients))
    summary = dict(settings=settings, estimation=cells, gradient=gradient)
    summary.update(conclusions=conclusions, seconds=time.time() - started)
    with open(os.path.join(out_dir, "toy_js.json"), "w") as file:
        json.dump(summary, file, indent=1)
    return lines


if __name__ == "__main__":
    args = parser.parse_args()
    started = time.time()
    try:  # a user's error (a file as --out-dir) or Ctrl-C: one line, not a traceback
        main(args.out_dir, args.quick)
    except (OSError, KeyboardInterrupt) as error:
        raise SystemExit(f"error: {str(error) or 'interrupted'}") from None
    print(f"\nwrote {args.out_dir}/toy_js.json and toy_js.png in {time.time() - started:.1f} s")
