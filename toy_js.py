"""
Why James-Stein shrinkage helps REINFORCE, on problems small enough to know the right answer.

    python toy_js.py                    # about a minute on 2 CPU cores
    python toy_js.py --quick            # a few seconds (the tests run this)

Part A, estimation. Rewards from the paper's random-effects model, r[c, i] = mu_c + eps (Var sigma^2
= 1), mu_c = mu_0 + xi (Var delta^2), over a grid of delta^2/sigma^2, K and B. Each baseline b[c, i]
(baselines.py, as training uses them) estimates mu_c without r[c, i]; the table gives its mean
squared error next to the oracle, the posterior mean of mu_c for someone who knows sigma^2 and
delta^2 but must learn mu_0 from the batch too, and the z-score of JS - RLOO over the same batches.

Part B, gradients. A contextual bandit with a Dirichlet action, like the scheduler: alpha =
softplus(W x + b) + 1e-3, tau ~ Dirichlet(alpha), r = offset_c + scale_c * (-|tau - target(x)|^2),
with hidden per-context offsets (like prompt difficulty) in units of the rollout noise. The expected
reward has a closed form, so autograd gives the exact gradient; the table gives the mean squared
error of the REINFORCE estimate (B = 16, K = 2) against it: the noise a baseline leaves in an update.

Writes OUT_DIR/toy_js.json (every number) and OUT_DIR/toy_js.png.
"""

import argparse
import json
import math
import os
import time

parser = argparse.ArgumentParser(description="James-Stein baselines on toy problems")
parser.add_argument("--out-dir", default="out/toy_js", help="the JSON and PNG go here")
parser.add_argument(
    "--quick", action="store_true", help="a few seconds: far fewer simulations, same tables"
)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument(
    "--threads",
    type=int,
    default=1,
    help="torch CPU threads (the simulated batches are small: one is fastest)",
)

if __name__ == "__main__":
    parser.parse_args()  # --help and bad flags answer here, before torch and the models load

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributions import Dirichlet  # noqa: E402

from baselines import cross_context, james_stein, james_stein_unbiased, rloo, shrinkage  # noqa: E402

RATIOS = (0.0, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0)  # delta^2 / sigma^2
ROLLOUTS, CONTEXTS = (2, 4, 8), (4, 16, 32)  # the K and B of part A
REWARDS_PER_CELL = (
    2**19,
    2**23,
)  # first look, and the most a cell doubles to while JS - RLOO is unresolved
SIGNIFICANT = 3.5  # |z| above this: two-sided p < 4.7e-4 per look
OFFSET_SPREADS = (
    0.0,
    1.0,
    10.0,
)  # part B: std of the hidden per-context offsets, in units of the rollout noise
BANDIT = dict(actions=5, features=4, contexts=16, rollouts=2, batches=4000)
QUICK = dict(rewards=(2**14, 2**14), batches=256)
ESTIMATORS = {
    "rloo": rloo,
    "xctx": cross_context,
    "js": james_stein,
    "js-unbiased": james_stein_unbiased,
}

# -----------------------------------------------------------------------------
# part A: estimating mu_c under the random-effects model


def oracle_baseline(rewards, sigma2, delta2):
    """(..., B, K) -> (..., B, K): E[mu_c | every reward but r[c, i]] with sigma^2, delta^2 known and a
    flat prior on mu_0. Given mu_0 it is (1 - a) * rloo + a * mu_0 with the true weight a; averaging over
    mu_0's posterior replaces mu_0 by its generalised-least-squares estimate from the other contexts'
    means (variance delta^2 + sigma^2/K) and this context's rloo (variance delta^2 + sigma^2/(K-1))."""
    contexts, rollouts = rewards.shape[-2:]
    weight = (sigma2 / (rollouts - 1)) / (sigma2 / (rollouts - 1) + delta2)
    own, means = rloo(rewards), rewards.mean(-1)
    others = (means.sum(-1, keepdim=True) - means)[
        ..., None
    ]  # (..., B, 1) sum of the other contexts' means
    own_precision, other_precision = (
        1 / (delta2 + sigma2 / (rollouts - 1)),
        1 / (delta2 + sigma2 / rollouts),
    )
    grand_mean = (own_precision * own + other_precision * others) / (
        own_precision + (contexts - 1) * other_precision
    )
    return (1 - weight) * own + weight * grand_mean


def squared_errors(ratio, contexts, rollouts, batches, generator):
    """Per simulated batch, the squared error of each estimator averaged over its B*K baselines: name -> (batches,)."""
    results = []
    for size in [
        min(2**20 // (contexts * rollouts), batches - start)
        for start in range(0, batches, 2**20 // (contexts * rollouts))
    ]:
        means = 3.0 + math.sqrt(ratio) * torch.randn(
            (size, contexts, 1), generator=generator, dtype=torch.float64
        )  # mu_c
        rewards = means + torch.randn(
            (size, contexts, rollouts), generator=generator, dtype=torch.float64
        )
        estimates = {name: estimate(rewards) for name, estimate in ESTIMATORS.items()}
        estimates["oracle"] = oracle_baseline(rewards, 1.0, ratio)
        results.append(
            {name: (value - means).square().mean((-2, -1)) for name, value in estimates.items()}
        )
        results[-1]["weight"] = shrinkage(rewards)
    return {name: torch.cat([result[name] for result in results]) for name in results[0]}


def z_score(differences):  # of the mean of paired differences
    return differences.mean().item() / max(
        differences.std().item() / math.sqrt(differences.numel()), 1e-300
    )


def estimation_cell(ratio, contexts, rollouts, rewards_per_cell, generator):
    """Simulate, doubling the batches while JS - RLOO is unresolved (|z| <= SIGNIFICANT): most cells
    settle at the first look and the near-ties get the simulations."""
    batches = max(rewards_per_cell[0] // (contexts * rollouts), 16)
    errors = squared_errors(ratio, contexts, rollouts, batches, generator)
    while (
        abs(z_score(errors["js"] - errors["rloo"])) <= SIGNIFICANT
        and 2 * batches * contexts * rollouts <= rewards_per_cell[1]
    ):
        more = squared_errors(ratio, contexts, rollouts, batches, generator)
        errors, batches = (
            {name: torch.cat([errors[name], more[name]]) for name in errors},
            2 * batches,
        )
    return dict(
        ratio=ratio,
        K=rollouts,
        B=contexts,
        batches=batches,
        mean_weight=errors.pop("weight").mean().item(),
        true_weight=(1 / (rollouts - 1)) / (1 / (rollouts - 1) + ratio),
        mse={name: error.mean().item() for name, error in errors.items()},
        js_minus_rloo_z=z_score(errors["js"] - errors["rloo"]),
        unbiased_minus_rloo_z=z_score(errors["js-unbiased"] - errors["rloo"]),
    )


def estimation_summary(cells):
    """The conclusions of part A, one line each."""
    below = [c for c in cells if c["js_minus_rloo_z"] < -SIGNIFICANT]
    lines = [
        f"JS below RLOO in {sum(c['mse']['js'] < c['mse']['rloo'] for c in cells)} of {len(cells)} cells, "
        f"significantly (z < -{SIGNIFICANT}) in {len(below)}."
    ]
    for c in cells:
        if c["js_minus_rloo_z"] >= -SIGNIFICANT:
            verdict = (
                "JS significantly ABOVE RLOO"
                if c["js_minus_rloo_z"] > SIGNIFICANT
                else "unresolved tie"
            )
            lines.append(
                f"  {verdict}: K={c['K']} B={c['B']} d2/s2={c['ratio']:g}: JS - RLOO = "
                f"{100 * (c['mse']['js'] / c['mse']['rloo'] - 1):+.3f}% of RLOO's MSE (z = {c['js_minus_rloo_z']:+.1f})"
            )
    worst = max(cells, key=lambda c: c["mse"]["js"] / c["mse"]["oracle"])
    lines.append(
        f"JS MSE is at most {worst['mse']['js'] / worst['mse']['oracle']:.2f}x the oracle's (K={worst['K']} "
        f"B={worst['B']} d2/s2={worst['ratio']:g}, where JS's a averages {worst['mean_weight']:.2f} against the true "
        f"{worst['true_weight']:.2f}) and exceeds it by at most "
        f"{100 * max((c['mse']['js'] - c['mse']['oracle']) / c['mse']['rloo'] for c in cells):.1f}% of RLOO's MSE."
    )
    worse = [c for c in cells if c["unbiased_minus_rloo_z"] > SIGNIFICANT]
    lines.append(
        f"JS-unbiased significantly above RLOO in {len(worse)} cells, by B: "
        f"{ {b: sum(c['B'] == b for c in worse) for b in CONTEXTS} }"
        + (
            f"; worst {100 * max(c['mse']['js-unbiased'] / c['mse']['rloo'] - 1 for c in worse):+.0f}% of RLOO's MSE."
            if worse
            else "."
        )
    )
    return lines


# -----------------------------------------------------------------------------
# part B: a Dirichlet contextual bandit


def expected_quality(alpha, target):
    """E[-|tau - target|^2] for tau ~ Dirichlet(alpha), (..., M) -> (...), in closed form: Dirichlet
    mean m = alpha / alpha_0 and variance m (1 - m) / (alpha_0 + 1) per coordinate."""
    total = alpha.sum(-1, keepdim=True)
    mean = alpha / total
    return -(mean * (1 - mean) / (total + 1) + (mean - target).square()).sum(-1)


class Bandit:
    """Contexts x with a best action target(x) = softmax(A x), hidden reward offsets and scales; rewards
    in units of the rollout noise at the initial policy (every alpha near 2)."""

    def __init__(self, generator, actions, features):
        self.mixing = torch.randn(
            (actions, features), generator=generator, dtype=torch.float64
        )  # A
        self.shape = (actions, features)
        self.noise_unit = 1.0
        weight, bias = self.initial_policy()
        features_, targets, offsets, scales = self.draw((2048,), 0.0, generator)
        tau = (
            Dirichlet(self.alpha(weight, bias, features_)).sample((64,)).movedim(0, -2)
        )  # (B, K, M)
        self.noise_unit = self.rewards(tau, targets, offsets, scales).var(-1).mean().sqrt().item()

    def initial_policy(self, leading=()):
        bias = torch.full(
            leading + self.shape[:1], math.log(math.expm1(2.0)), dtype=torch.float64
        )  # softplus^-1(2)
        return torch.zeros(leading + self.shape, dtype=torch.float64), bias

    def alpha(self, weight, bias, features):
        """weight (..., M, D), bias (..., M), features (..., B, D) -> alpha (..., B, M), as policy.py does it."""
        return F.softplus(features @ weight.transpose(-1, -2) + bias[..., None, :]) + 1e-3

    def draw(self, shape, offset_spread, generator):
        """-> features (*shape, D), targets (*shape, M), offsets (*shape,), scales (*shape,)."""
        features = torch.randn(shape + self.shape[1:], generator=generator, dtype=torch.float64)
        offsets = offset_spread * torch.randn(shape, generator=generator, dtype=torch.float64)
        scales = torch.exp(
            0.5 * torch.randn(shape, generator=generator, dtype=torch.float64)
        )  # log-normal, x1.6
        return features, torch.softmax(features @ self.mixing.T, -1), offsets, scales

    def rewards(self, tau, targets, offsets, scales):
        """tau (..., B, K, M) -> (..., B, K)."""
        quality = -(tau - targets[..., None, :]).square().sum(-1)
        return offsets[..., None] + scales[..., None] * quality / self.noise_unit


BASELINES = {"none": torch.zeros_like, **ESTIMATORS}


def gradient_errors(bandit, offset_spread, batches, generator):
    """MSE of the REINFORCE gradient at the initial policy against the exact gradient of the batch
    objective (1/B) sum_c E[r_c], relative to E|exact|^2, per baseline (mean, standard error)."""
    weight, bias = (
        p.requires_grad_(True) for p in bandit.initial_policy((batches,))
    )  # one copy per batch
    features, targets, offsets, scales = bandit.draw(
        (batches, BANDIT["contexts"]), offset_spread, generator
    )
    alpha = bandit.alpha(weight, bias, features)  # (R, B, M)
    gradient = lambda objective: torch.cat(
        [g.flatten(1) for g in torch.autograd.grad(objective, (weight, bias), retain_graph=True)], 1
    )
    exact = gradient(
        (offsets + scales * expected_quality(alpha, targets) / bandit.noise_unit).mean(-1).sum()
    )  # (R, P)
    tau = Dirichlet(alpha.detach()).sample((BANDIT["rollouts"],)).movedim(0, -2)  # (R, B, K, M)
    rewards = bandit.rewards(tau, targets, offsets, scales)  # (R, B, K)
    log_prob = Dirichlet(alpha[..., None, :]).log_prob(
        tau
    )  # (R, B, K): the joint density of the whole action
    errors = {
        name: (gradient(((rewards - baseline(rewards)) * log_prob).mean((-2, -1)).sum()) - exact)
        .square()
        .sum(1)
        / exact.square().sum(1).mean()
        for name, baseline in BASELINES.items()
    }
    return {
        name: (error.mean().item(), error.std().item() / math.sqrt(batches))
        for name, error in errors.items()
    }


# -----------------------------------------------------------------------------


def plot(cells, path):
    """MSE of each baseline relative to RLOO's against delta^2/sigma^2, at the paper's K = 2, B = 16."""
    figure, ax = plt.subplots(figsize=(6, 4))
    row = [c for c in cells if c["K"] == 2 and c["B"] == 16]
    for name in ("xctx", "js", "js-unbiased", "oracle"):
        ax.plot(
            [c["ratio"] for c in row],
            [c["mse"][name] / c["mse"]["rloo"] for c in row],
            "-o",
            markersize=3,
            label=name,
        )
    ax.axhline(1.0, color="black", linestyle="--", label="rloo")
    ax.set(
        xscale="symlog",
        yscale="log",
        xlabel="delta^2 / sigma^2 (symlog)",
        ylabel="MSE / RLOO's MSE",
        xlim=(0, 150),
        title="estimating a context's mean reward, K=2, B=16",
    )
    ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    settings = {
        "rewards": REWARDS_PER_CELL,
        "batches": BANDIT["batches"],
        **(QUICK if args.quick else {}),
    }
    started = time.time()

    # ---- part A: estimation
    generator = torch.Generator().manual_seed(args.seed)
    cells = [
        estimation_cell(ratio, contexts, rollouts, settings["rewards"], generator)
        for rollouts in ROLLOUTS
        for contexts in CONTEXTS
        for ratio in RATIOS
    ]
    print("=== Part A: MSE of b[c, i] as an estimate of mu_c (sigma^2 = 1) ===")
    print(
        f"{'K':>2} {'B':>3} {'d2/s2':>6} | {'rloo':>7} {'xctx':>8} {'js':>7} {'js-unb':>7} {'oracle':>7} | {'a_true':>6} {'a_mean':>6} | {'js-rloo z':>9}"
    )
    for c in cells:
        print(
            f"{c['K']:>2} {c['B']:>3} {c['ratio']:>6g} | "
            + " ".join(
                f"{c['mse'][n]:>7.4f}" for n in ("rloo", "xctx", "js", "js-unbiased", "oracle")
            )
            + f" | {c['true_weight']:>6.3f} {c['mean_weight']:>6.3f} | {c['js_minus_rloo_z']:>+9.1f}"
        )
    conclusions = estimation_summary(cells)

    # ---- part B: gradients
    torch.manual_seed(args.seed)  # Dirichlet sampling draws from the global generator
    bandit = Bandit(generator, BANDIT["actions"], BANDIT["features"])
    gradients = [
        gradient_errors(bandit, spread, settings["batches"], generator) for spread in OFFSET_SPREADS
    ]
    print(
        f"\n=== Part B: Dirichlet bandit, B={BANDIT['contexts']}, K={BANDIT['rollouts']}, {BANDIT['actions']} actions: "
        f"gradient MSE / E|grad|^2 at the initial policy (+- se) ==="
    )
    for spread, gradient in zip(OFFSET_SPREADS, gradients):
        print(
            f"offset spread {spread:>4g} | "
            + " ".join(f"{name} {m:.3f}+-{s:.3f}" for name, (m, s) in gradient.items())
        )
        conclusions.append(
            f"offset spread {spread:g}: gradient MSE js/rloo = {gradient['js'][0] / gradient['rloo'][0]:.2f}, "
            f"xctx/rloo = {gradient['xctx'][0] / gradient['rloo'][0]:.2f}, none/rloo = {gradient['none'][0] / gradient['rloo'][0]:.2f}"
        )
    print("\nConclusions:\n  " + "\n  ".join(conclusions))

    plot(cells, os.path.join(args.out_dir, "toy_js.png"))
    with open(os.path.join(args.out_dir, "toy_js.json"), "w") as file:
        json.dump(
            dict(
                settings=settings,
                estimation=cells,
                gradient=dict(zip(map(str, OFFSET_SPREADS), gradients)),
                conclusions=conclusions,
                seconds=time.time() - started,
            ),
            file,
            indent=1,
        )
    print(f"\nwrote {args.out_dir}/toy_js.json and toy_js.png in {time.time() - started:.1f} s")
