"""
Why James-Stein shrinkage helps REINFORCE, on problems small enough to know the right answer.

    python toy_js.py                           # full run, about 10 s on 2 idle CPU cores
    python toy_js.py --quick                   # a few seconds (the test suite runs this)
    python toy_js.py --out-dir out/toy_js --seed 1
    python toy_js.py --contexts-grid 3 4 6 8 --ratios 1 3 10 30 100 1000 --rewards-per-cell 4194304 \
        --max-rewards-per-cell 33554432 --out-dir out/toy_js_small_b   # where JS and RLOO nearly tie (~1 min)

Part A, estimation. Rewards come from the random-effects model of the paper, r[c, i] = mu_c + eps
(Var sigma^2), mu_c = mu_0 + xi (Var delta^2), over a grid of delta^2/sigma^2, K and B. Each baseline
b[c, i] is an estimate of mu_c made without r[c, i]; the table gives its mean squared error next to
  oracle: the posterior mean of mu_c for someone who knows sigma^2 and delta^2 but, like every
          baseline, must learn mu_0 from the batch (flat prior on mu_0), from every reward but r[c, i].
          All baselines are translation-equivariant, their MSE does not depend on mu_0, and among
          such estimators this one has the least MSE: the fair floor, finite at every delta^2.
  floor:  the posterior variance when mu_0 is known too, sigma^2 delta^2 / (sigma^2 + (K-1) delta^2):
          nothing that leaves r[c, i] out can beat it (other contexts say nothing about mu_c then).
The plug-in JS does not quite leave r[c, i] out: its weight a sees it. Where one reward weighs much
in a (small B*K), that lets JS dip below the oracle; the same leak is what biases its gradient.
JS - RLOO is a paired difference (same simulated batches), so its standard error is small enough to
rank the two even where they nearly tie.

Part B, gradients. A contextual bandit with a Dirichlet action (like the scheduler): context features
x, policy alpha = softplus(W x + b) + 1e-3, tau ~ Dirichlet(alpha), reward
r = offset_c + scale_c * (-|tau - target(x)|^2) / noise_unit, where target(x) = softmax(A x), offset_c
and scale_c are hidden per-context levels (like prompt difficulty) and noise_unit makes the rollout
noise at the initial policy about 1. The expected reward has a closed form (Dirichlet mean and
variance), so the exact gradient of the batch objective comes from autograd; the table gives the
mean squared error of the REINFORCE estimate at K = 2 against it, then short learning curves.

Writes OUT_DIR/toy_js.json (every table and conclusion) and OUT_DIR/toy_js.png.
"""

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.distributions import Dirichlet

from baselines import _cross_context, _james_stein, _rloo, _shrinkage


@dataclass
class Config:
    # I/O
    out_dir: str = "out/toy_js"  # the JSON and PNG go here
    quick: bool = False  # a few seconds: far fewer simulations, same tables
    seed: int = 0
    threads: int = 2  # torch CPU threads
    # part A: estimation
    ratios: tuple = (0.0, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0)  # delta^2 / sigma^2
    rollouts_grid: tuple = (2, 4, 8)  # K
    contexts_grid: tuple = (4, 16, 32)  # B
    rewards_per_cell: int = 2**19  # simulated rewards per (ratio, K, B) at the first look; batches = this / (B*K)
    max_rewards_per_cell: int = 2**23  # more, by doubling, only while JS - RLOO is unresolved
    # part B: Dirichlet bandit
    actions: int = 5  # Dirichlet dimension, like L+1 for L = 4 steps
    features: int = 4  # context features the policy sees
    offset_spreads: tuple = (0.0, 1.0, 10.0)  # std of the hidden per-context offsets, in noise units
    contexts: int = 16  # B for part B (the paper's SD3.5-L / Flux-Dev batch)
    rollouts: int = 2  # K for part B (the paper's)
    gradient_batches: int = 4000  # independent batches for the gradient MSE
    iterations: int = 300  # policy updates per learning curve
    seeds: int = 8  # learning curves per baseline and offset spread (run side by side)
    lr: float = 0.05  # Adam
    eval_every: int = 25  # iterations between evaluations of the expected quality
    eval_contexts: int = 512  # held-out contexts for the evaluation


QUICK = dict(rewards_per_cell=2**14, max_rewards_per_cell=2**14, gradient_batches=256, iterations=40, seeds=2, eval_every=10, eval_contexts=128)
SIGNIFICANT = 3.5  # |z| above this: two-sided p < 4.7e-4 per look (72 cells x 4.7e-4 = 3.4% family-wise)
DTYPE = torch.float64
CHUNK_REWARDS = 2**20  # simulate in pieces of this many rewards: 8 MB tensors stay fast and small


def parse_config() -> Config:
    parser = argparse.ArgumentParser(description="James-Stein baselines on toy problems")
    for field in fields(Config):
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            parser.add_argument(flag, action="store_true")
        elif isinstance(field.default, tuple):
            parser.add_argument(flag, nargs="+", type=type(field.default[0]), default=field.default)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    config = Config(**{name: tuple(value) if isinstance(value, list) else value for name, value in vars(parser.parse_args()).items()})
    if config.quick:
        config = Config(**{**asdict(config), **QUICK})
    return config


def z_score(differences: torch.Tensor) -> tuple[float, float, float]:
    """Per-replicate differences (R,) -> mean, standard error, mean / standard error."""
    mean = differences.mean().item()
    error = differences.std().item() / math.sqrt(differences.numel())
    return mean, error, mean / error if error > 0 else 0.0


# -----------------------------------------------------------------------------
# part A: estimating mu_c under the random-effects model


def oracle_baseline(rewards: torch.Tensor, sigma2: float, delta2: float) -> torch.Tensor:
    """(..., B, K) -> (..., B, K): E[mu_c | every reward but r[c, i]] with sigma^2, delta^2 known and
    a flat prior on mu_0. Given mu_0 the posterior mean is (1 - a) * rloo + a * mu_0 with the true
    a = (sigma^2/(K-1)) / (sigma^2/(K-1) + delta^2); averaging over mu_0's posterior replaces mu_0 by
    its generalised-least-squares estimate from the other contexts' means (variance delta^2 + sigma^2/K)
    and this context's rloo (variance delta^2 + sigma^2/(K-1))."""
    contexts, rollouts = rewards.shape[-2:]
    weight = (sigma2 / (rollouts - 1)) / (sigma2 / (rollouts - 1) + delta2)
    loo = _rloo(rewards)
    context_means = rewards.mean(dim=-1)  # (..., B)
    others_sum = (context_means.sum(dim=-1, keepdim=True) - context_means)[..., None]  # (..., B, 1)
    own_precision = 1 / (delta2 + sigma2 / (rollouts - 1))
    other_precision = 1 / (delta2 + sigma2 / rollouts)
    grand_mean = (own_precision * loo + other_precision * others_sum) / (own_precision + (contexts - 1) * other_precision)
    return (1 - weight) * loo + weight * grand_mean


ESTIMATORS = {
    "rloo": _rloo,
    "xctx": _cross_context,
    "js": _james_stein,
    "js-unbiased": lambda rewards: _james_stein(rewards, unbiased=True),
}


def simulate_errors(ratio: float, contexts: int, rollouts: int, batches: int, generator: torch.Generator) -> dict:
    """Squared error of each estimator, averaged over the B*K baselines of a batch, for `batches`
    simulated batches: name -> (batches,); also "weight", JS's plug-in a per batch."""
    sigma2, delta2, grand_mean = 1.0, ratio, 3.0  # any mu_0 gives the same numbers (equivariance)
    chunk = max(1, CHUNK_REWARDS // (contexts * rollouts))
    results = []
    for start in range(0, batches, chunk):
        size = min(chunk, batches - start)
        means = grand_mean + math.sqrt(delta2) * torch.randn((size, contexts, 1), generator=generator, dtype=DTYPE)  # mu_c
        rewards = means + math.sqrt(sigma2) * torch.randn((size, contexts, rollouts), generator=generator, dtype=DTYPE)
        estimates = {name: estimator(rewards) for name, estimator in ESTIMATORS.items()}
        estimates["oracle"] = oracle_baseline(rewards, sigma2, delta2)
        errors = {name: (estimate - means).square().mean(dim=(-2, -1)) for name, estimate in estimates.items()}
        results.append({**errors, "weight": _shrinkage(rewards)})
    return {name: torch.cat([result[name] for result in results]) for name in results[0]}


def estimation_cell(ratio: float, contexts: int, rollouts: int, config: Config, generator: torch.Generator) -> dict:
    """Simulate until JS - RLOO is resolved (|z| > SIGNIFICANT), doubling the number of batches from
    rewards_per_cell up to max_rewards_per_cell rewards: most cells settle at the first look, and the
    near-ties get the simulations. With up to 5 looks, a true tie is called significant with
    probability at most 5 x 4.7e-4 < 0.25%."""
    batches = max(config.rewards_per_cell // (contexts * rollouts), 16)
    errors = simulate_errors(ratio, contexts, rollouts, batches, generator)
    while abs(z_score(errors["js"] - errors["rloo"])[2]) <= SIGNIFICANT and 2 * batches * contexts * rollouts <= config.max_rewards_per_cell:
        more = simulate_errors(ratio, contexts, rollouts, batches, generator)
        errors = {name: torch.cat([errors[name], more[name]]) for name in errors}
        batches *= 2
    sigma2, delta2 = 1.0, ratio
    js_gain = z_score(errors["js"] - errors["rloo"])
    unbiased_gain = z_score(errors["js-unbiased"] - errors["rloo"])
    oracle_gap = z_score(errors["js"] - errors["oracle"])
    return dict(
        ratio=ratio, K=rollouts, B=contexts, batches=batches,
        mse={name: error.mean().item() for name, error in errors.items() if name != "weight"},
        floor=sigma2 * delta2 / (sigma2 + (rollouts - 1) * delta2),
        true_weight=(sigma2 / (rollouts - 1)) / (sigma2 / (rollouts - 1) + delta2),
        mean_weight=errors["weight"].mean().item(),
        js_minus_rloo=js_gain[0], js_minus_rloo_se=js_gain[1], js_minus_rloo_z=js_gain[2],
        unbiased_minus_rloo=unbiased_gain[0], unbiased_minus_rloo_z=unbiased_gain[2],
        js_minus_oracle_z=oracle_gap[2],
    )


def run_estimation(config: Config) -> list[dict]:
    generator = torch.Generator().manual_seed(config.seed)
    cells = []
    for rollouts in config.rollouts_grid:
        for contexts in config.contexts_grid:
            for ratio in config.ratios:
                cells.append(estimation_cell(ratio, contexts, rollouts, config, generator))
    return cells


def summarize_estimation(cells: list[dict]) -> dict:
    for cell in cells:
        mse = cell["mse"]
        cell["pooled_wins"] = mse["xctx"] < mse["rloo"]
        cell["js_over_best"] = mse["js"] / min(mse["rloo"], mse["xctx"])
        cell["js_over_oracle"] = mse["js"] / mse["oracle"]
        cell["js_excess"] = (mse["js"] - mse["oracle"]) / mse["rloo"]  # JS's distance to the oracle, in units of RLOO's MSE
    below = [cell for cell in cells if cell["js_minus_rloo"] < 0]
    significant = [cell for cell in cells if cell["js_minus_rloo_z"] < -SIGNIFICANT]
    worst_oracle = max(cells, key=lambda cell: cell["js_over_oracle"])
    worst_best = max(cells, key=lambda cell: cell["js_over_best"])
    unbiased_worse = [cell for cell in cells if cell["unbiased_minus_rloo_z"] > SIGNIFICANT]
    return dict(
        cells=len(cells),
        js_below_rloo=len(below),
        js_significantly_below_rloo=len(significant),
        js_not_significantly_below_rloo=[
            dict(ratio=c["ratio"], K=c["K"], B=c["B"], batches=c["batches"], relative=c["js_minus_rloo"] / c["mse"]["rloo"], z=c["js_minus_rloo_z"])
            for c in cells if c["js_minus_rloo_z"] >= -SIGNIFICANT
        ],
        js_significantly_above_rloo=sum(1 for c in cells if c["js_minus_rloo_z"] > SIGNIFICANT),
        max_js_over_oracle=worst_oracle["js_over_oracle"],
        max_js_over_oracle_cell={key: worst_oracle[key] for key in ("ratio", "K", "B", "mean_weight", "true_weight")},
        max_js_excess=max(cell["js_excess"] for cell in cells),
        max_js_over_best=worst_best["js_over_best"],
        max_js_over_best_cell=dict(ratio=worst_best["ratio"], K=worst_best["K"], B=worst_best["B"]),
        js_significantly_below_oracle=[dict(ratio=c["ratio"], K=c["K"], B=c["B"]) for c in cells if c["js_minus_oracle_z"] < -SIGNIFICANT],
        js_unbiased_significantly_above_rloo=[
            dict(ratio=c["ratio"], K=c["K"], B=c["B"], relative=c["unbiased_minus_rloo"] / c["mse"]["rloo"]) for c in unbiased_worse
        ],
    )


def print_estimation(cells: list[dict], summary: dict) -> list[str]:
    print("\n=== Part A: MSE of b[c, i] as an estimate of mu_c (sigma^2 = 1) ===")
    print(f"{'K':>2} {'B':>3} {'d2/s2':>6} {'batches':>7} | {'rloo':>7} {'xctx':>8} {'js':>7} {'js-unb':>7} {'oracle':>7} {'floor':>7} | "
          f"{'a_true':>6} {'a_mean':>6} | {'js/orc':>6} {'js-rloo':>9} {'z':>6} | better of rloo/xctx")
    for cell in cells:
        mse = cell["mse"]
        print(f"{cell['K']:>2} {cell['B']:>3} {cell['ratio']:>6g} {cell['batches']:>7} | {mse['rloo']:>7.4f} {mse['xctx']:>8.4f} "
              f"{mse['js']:>7.4f} {mse['js-unbiased']:>7.4f} {mse['oracle']:>7.4f} {cell['floor']:>7.4f} | "
              f"{cell['true_weight']:>6.3f} {cell['mean_weight']:>6.3f} | {cell['js_over_oracle']:>6.2f} "
              f"{cell['js_minus_rloo']:>+9.5f} {cell['js_minus_rloo_z']:>+6.1f} | {'xctx' if cell['pooled_wins'] else 'rloo'}")
    lines = []
    for rollouts in sorted({cell["K"] for cell in cells}):
        for contexts in sorted({cell["B"] for cell in cells}):
            row = [cell for cell in cells if cell["K"] == rollouts and cell["B"] == contexts]
            pooled = [cell["ratio"] for cell in row if cell["pooled_wins"]]
            local = [cell["ratio"] for cell in row if not cell["pooled_wins"]]
            lines.append(f"K={rollouts} B={contexts}: xctx beats rloo at d2/s2 in {pooled or 'none'}, rloo beats xctx at {local or 'none'}; "
                         f"js/min(rloo, xctx) at most {max(cell['js_over_best'] for cell in row):.2f}")
    lines.append(f"JS below RLOO in {summary['js_below_rloo']} of {summary['cells']} cells, "
                 f"significantly (z < -{SIGNIFICANT}) in {summary['js_significantly_below_rloo']}.")
    for cell in summary["js_not_significantly_below_rloo"]:
        verdict = "JS significantly ABOVE RLOO" if cell["z"] > SIGNIFICANT else "unresolved tie"
        lines.append(f"  {verdict}: K={cell['K']} B={cell['B']} d2/s2={cell['ratio']:g}: JS - RLOO = {100 * cell['relative']:+.3f}% "
                     f"of RLOO's MSE (z = {cell['z']:+.1f}, {cell['batches'] * cell['B'] * cell['K']} rewards)")
    cell = summary["max_js_over_oracle_cell"]
    lines.append(f"JS MSE is at most {summary['max_js_over_oracle']:.2f}x the oracle's (worst: K={cell['K']} B={cell['B']} d2/s2={cell['ratio']:g}, "
                 f"where JS's a averages {cell['mean_weight']:.2f} against the true {cell['true_weight']:.2f}).")
    lines.append(f"JS MSE exceeds the oracle's by at most {100 * summary['max_js_excess']:.1f}% of RLOO's MSE.")
    below_oracle = summary["js_significantly_below_oracle"]
    lines.append(f"JS significantly below the oracle in {len(below_oracle)} cells"
                 + (": " + ", ".join(f"K={c['K']} B={c['B']} d2/s2={c['ratio']:g}" for c in below_oracle)
                    + " (its weight uses r[c, i], which the oracle leaves out)." if below_oracle else "."))
    cell = summary["max_js_over_best_cell"]
    lines.append(f"JS MSE is at most {summary['max_js_over_best']:.2f}x the better of RLOO and XCTX "
                 f"(worst: K={cell['K']} B={cell['B']} d2/s2={cell['ratio']:g}).")
    worse = summary["js_unbiased_significantly_above_rloo"]
    by_contexts = {contexts: sum(1 for cell in worse if cell["B"] == contexts) for contexts in sorted({cell["B"] for cell in cells})}
    lines.append(f"JS-unbiased significantly above RLOO in {len(worse)} cells, by B: {by_contexts}"
                 + (f"; worst {100 * max(cell['relative'] for cell in worse):+.0f}% of RLOO's MSE." if worse else "."))
    print("\nConclusions (Part A):")
    for line in lines:
        print("  " + line)
    return lines


# -----------------------------------------------------------------------------
# part B: a Dirichlet contextual bandit


def dirichlet_alpha(weight: torch.Tensor, bias: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """weight (..., M, D), bias (..., M), features (..., B, D) -> alpha (..., B, M), as policy.py does it."""
    return F.softplus(features @ weight.transpose(-1, -2) + bias[..., None, :]) + 1e-3


def quality(tau: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(..., M), (..., M) -> (...): -|tau - target|^2, 0 is perfect."""
    return -(tau - target).square().sum(dim=-1)


def expected_quality(alpha: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(..., M), (..., M) -> (...): E[-|tau - target|^2] for tau ~ Dirichlet(alpha), in closed form:
    Dirichlet mean m = alpha / alpha_0 and variance m (1 - m) / (alpha_0 + 1) per coordinate."""
    total = alpha.sum(dim=-1, keepdim=True)
    mean = alpha / total
    variance = mean * (1 - mean) / (total + 1)
    return -(variance + (mean - target).square()).sum(dim=-1)


class Bandit:
    """Contexts with a best schedule target(x) = softmax(A x) and hidden reward offset and scale."""

    def __init__(self, config: Config, generator: torch.Generator):
        self.features, self.actions = config.features, config.actions
        self.mixing = torch.randn((config.actions, config.features), generator=generator, dtype=DTYPE)  # A
        self.initial_bias = math.log(math.expm1(2.0))  # softplus^-1(2): every alpha starts near 2
        self.noise_unit = 1.0  # rewards() divides by it: measure the noise in raw units first
        self.noise_unit = self.rollout_noise(generator)

    def draw(self, shape: tuple, offset_spread: float, generator: torch.Generator):
        """-> features (*shape, D), targets (*shape, M), offsets (*shape,), scales (*shape,)."""
        features = torch.randn(shape + (self.features,), generator=generator, dtype=DTYPE)
        targets = torch.softmax(features @ self.mixing.T, dim=-1)
        offsets = offset_spread * torch.randn(shape, generator=generator, dtype=DTYPE)
        scales = torch.exp(0.5 * torch.randn(shape, generator=generator, dtype=DTYPE))  # log-normal, spread x1.6
        return features, targets, offsets, scales

    def rewards(self, tau: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """tau (..., B, K, M) -> rewards (..., B, K)."""
        return offsets[..., None] + scales[..., None] * quality(tau, targets[..., None, :]) / self.noise_unit

    def expected_reward(self, alpha, targets, offsets, scales):
        """alpha (..., B, M) -> (..., B): E[r] in closed form."""
        return offsets + scales * expected_quality(alpha, targets) / self.noise_unit

    def initial_policy(self, leading: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
        weight = torch.zeros(leading + (self.actions, self.features), dtype=DTYPE)
        bias = torch.full(leading + (self.actions,), self.initial_bias, dtype=DTYPE)
        return weight, bias

    def rollout_noise(self, generator: torch.Generator, contexts: int = 2048, rollouts: int = 64) -> float:
        """Root-mean within-context standard deviation of the reward at the initial policy."""
        weight, bias = self.initial_policy()
        features, targets, offsets, scales = self.draw((contexts,), 0.0, generator)
        alpha = dirichlet_alpha(weight, bias, features)
        tau = Dirichlet(alpha).sample((rollouts,)).movedim(0, -2)  # (B, K, M)
        return self.rewards(tau, targets, offsets, scales).var(dim=-1).mean().sqrt().item()


GRADIENT_BASELINES = {"none": lambda rewards: torch.zeros_like(rewards), **{n: e for n, e in ESTIMATORS.items()}}


def gradient_errors(bandit: Bandit, config: Config, offset_spread: float, generator: torch.Generator) -> dict:
    """MSE of the REINFORCE gradient (at the initial policy) against the exact gradient of the batch
    objective (1/B) sum_c E[r_c], per baseline. The target is the gradient for the batch's own
    contexts: only the rollout noise, which baselines act on, separates the two."""
    batches = config.gradient_batches
    weight, bias = bandit.initial_policy((batches,))  # one copy per batch, so autograd gives per-batch gradients
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    features, targets, offsets, scales = bandit.draw((batches, config.contexts), offset_spread, generator)
    alpha = dirichlet_alpha(weight, bias, features)  # (R, B, M)
    objective = bandit.expected_reward(alpha, targets, offsets, scales).mean(dim=-1).sum()
    exact = torch.cat([g.flatten(1) for g in torch.autograd.grad(objective, (weight, bias), retain_graph=True)], dim=1)  # (R, P)
    tau = Dirichlet(alpha.detach()).sample((config.rollouts,)).movedim(0, -2)  # (R, B, K, M)
    rewards = bandit.rewards(tau, targets, offsets, scales)  # (R, B, K)
    log_prob = Dirichlet(alpha[..., None, :]).log_prob(tau)  # (R, B, K), joint density of the whole action
    signal = exact.square().sum(dim=1).mean().item()
    errors = {}
    for name, baseline in GRADIENT_BASELINES.items():
        advantages = rewards - baseline(rewards)
        surrogate = (advantages * log_prob).mean(dim=(-2, -1)).sum()
        estimate = torch.cat([g.flatten(1) for g in torch.autograd.grad(surrogate, (weight, bias), retain_graph=True)], dim=1)
        errors[name] = (estimate - exact).square().sum(dim=1) / signal  # (R,) relative to E|grad|^2
    js_gain = z_score(errors["js"] - errors["rloo"])
    return dict(
        offset_spread=offset_spread,
        relative_mse={name: error.mean().item() for name, error in errors.items()},
        relative_mse_se={name: error.std().item() / math.sqrt(batches) for name, error in errors.items()},
        js_minus_rloo_z=js_gain[2],
        mean_weight=_shrinkage(rewards).mean().item(),
    )


def learning_curves(bandit: Bandit, config: Config, eval_set: tuple) -> torch.Tensor:
    """-> (offset spreads, baselines, seeds, evaluations): expected quality on held-out contexts.
    Every run is one slice of a leading (spread, baseline, seed) grid of weights. The loss is the sum
    over runs and Adam is elementwise, so the runs stay independent; all of them see the same stream
    of contexts (common random numbers: runs differ only in offsets, baseline and rollouts)."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    spreads = torch.tensor(config.offset_spreads, dtype=DTYPE)[:, None, None, None]  # (P, 1, 1, 1)
    baselines = list(GRADIENT_BASELINES.values())
    weight, bias = bandit.initial_policy((len(config.offset_spreads), len(baselines), config.seeds))  # (P, N, S, M, D), (P, N, S, M)
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    optimizer = torch.optim.Adam([weight, bias], lr=config.lr)
    eval_features, eval_targets = eval_set
    history = []
    for iteration in range(config.iterations + 1):
        if iteration % config.eval_every == 0 or iteration == config.iterations:
            with torch.no_grad():
                history.append(expected_quality(dirichlet_alpha(weight, bias, eval_features), eval_targets).mean(dim=-1))
        if iteration == config.iterations:
            break
        features, targets, unit_offsets, scales = bandit.draw((config.seeds, config.contexts), 1.0, generator)  # (S, B, ...)
        alpha = dirichlet_alpha(weight, bias, features)  # (P, N, S, B, M)
        with torch.no_grad():
            tau = Dirichlet(alpha).sample((config.rollouts,)).movedim(0, -2)  # (P, N, S, B, K, M)
            rewards = bandit.rewards(tau, targets, spreads * unit_offsets, scales)  # (P, N, S, B, K)
            advantages = torch.stack([rewards[:, n] - baseline(rewards[:, n]) for n, baseline in enumerate(baselines)], dim=1)
        log_prob = Dirichlet(alpha[..., None, :]).log_prob(tau)  # (P, N, S, B, K)
        loss = -(advantages * log_prob).mean(dim=(-2, -1)).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return torch.stack(history, dim=-1)


def run_bandit(config: Config) -> tuple[dict, list[dict], dict]:
    generator = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)  # Dirichlet sampling draws from the global generator
    bandit = Bandit(config, generator)
    gradient = [gradient_errors(bandit, config, spread, generator) for spread in config.offset_spreads]
    eval_features, eval_targets, _, _ = bandit.draw((config.eval_contexts,), 0.0, generator)
    curves = learning_curves(bandit, config, (eval_features, eval_targets))  # (P, N, S, E)
    evaluations = list(range(0, config.iterations, config.eval_every)) + [config.iterations]
    learning = {}
    for spread, spread_curves in zip(config.offset_spreads, curves):
        learning[str(spread)] = dict(
            iterations=evaluations,
            mean={name: run.mean(dim=0).tolist() for name, run in zip(GRADIENT_BASELINES, spread_curves)},
            se={name: (run.std(dim=0) / math.sqrt(config.seeds)).tolist() for name, run in zip(GRADIENT_BASELINES, spread_curves)},
        )
    setup = dict(noise_unit=bandit.noise_unit, initial_quality=curves[0, 0, :, 0].mean().item())
    return setup, gradient, learning


def print_bandit(config: Config, setup: dict, gradient: list[dict], learning: dict) -> list[str]:
    names = list(GRADIENT_BASELINES)
    print(f"\n=== Part B: Dirichlet bandit, B={config.contexts}, K={config.rollouts}, {config.actions} actions; "
          f"rollout noise at the initial policy = 1 (|tau - target|^2 units: {setup['noise_unit']:.4f}) ===")
    print("Gradient MSE relative to E|exact gradient|^2, at the initial policy "
          f"({config.gradient_batches} batches; +- one standard error):")
    print(f"{'offsets':>7} | " + " ".join(f"{name:>15}" for name in names) + f" | {'a_mean':>6} {'js-rloo z':>9}")
    for row in gradient:
        cells = [f"{row['relative_mse'][name]:>7.3f} +-{row['relative_mse_se'][name]:>6.3f}" for name in names]
        print(f"{row['offset_spread']:>7g} | " + " ".join(cells) + f" | {row['mean_weight']:>6.3f} {row['js_minus_rloo_z']:>+9.1f}")
    print(f"\nExpected quality E[-|tau - target|^2] on {config.eval_contexts} held-out contexts "
          f"(mean +- se over {config.seeds} seeds; Adam lr {config.lr}):")
    lines = []
    for spread, record in learning.items():
        print(f"offset spread {spread}:")
        print(f"{'iteration':>9} | " + " ".join(f"{name:>17}" for name in names))
        for step, iteration in enumerate(record["iterations"]):
            print(f"{iteration:>9} | " + " ".join(f"{record['mean'][name][step]:>9.5f} +-{record['se'][name][step]:>6.5f}" for name in names))
    for row in gradient:
        mse = row["relative_mse"]
        best = min(mse, key=mse.get)
        lines.append(f"offset spread {row['offset_spread']:g}: lowest gradient MSE with {best}; "
                     f"js/rloo = {mse['js'] / mse['rloo']:.2f} (z = {row['js_minus_rloo_z']:+.1f}), "
                     f"xctx/rloo = {mse['xctx'] / mse['rloo']:.2f}, none/rloo = {mse['none'] / mse['rloo']:.2f}")
    for spread, record in learning.items():
        final = {name: values[-1] for name, values in record["mean"].items()}
        error = {name: values[-1] for name, values in record["se"].items()}
        best, runner_up = sorted(final, key=final.get, reverse=True)[:2]
        gap = (final[best] - final[runner_up]) / math.hypot(error[best], error[runner_up])
        js_gap = (final["js"] - final["rloo"]) / math.hypot(error["js"], error["rloo"])
        lines.append(f"offset spread {spread}: best final quality with {best}, {gap:.1f} standard errors ahead of {runner_up}; "
                     f"js - rloo = {final['js'] - final['rloo']:+.4f} ({js_gap:+.1f} se) ("
                     + ", ".join(f"{name} {value:.4f}" for name, value in final.items()) + f"; start {record['mean']['rloo'][0]:.4f})")
    print("\nConclusions (Part B):")
    for line in lines:
        print("  " + line)
    return lines


# -----------------------------------------------------------------------------
# figure


COLORS = {"none": "0.5", "rloo": "C0", "xctx": "C1", "js": "C2", "js-unbiased": "C3", "oracle": "k"}


def plot(config: Config, cells: list[dict], gradient: list[dict], learning: dict, path: str) -> None:
    figure, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    contexts = config.contexts_grid[len(config.contexts_grid) // 2]
    for axis, rollouts in zip(axes[0], config.rollouts_grid):
        row = [cell for cell in cells if cell["K"] == rollouts and cell["B"] == contexts]
        ratios = [cell["ratio"] for cell in row]
        for name, style in [("xctx", "-"), ("js", "-o"), ("js-unbiased", "--"), ("oracle", ":")]:
            axis.plot(ratios, [cell["mse"][name] / cell["mse"]["rloo"] for cell in row], style, color=COLORS[name], label=name)
        positive = [cell for cell in row if cell["floor"] > 0]  # the floor is 0 at delta = 0, off a log axis
        axis.plot([cell["ratio"] for cell in positive], [cell["floor"] / cell["mse"]["rloo"] for cell in positive], color="0.7", label="floor (mu_0 known)")
        axis.axhline(1.0, color=COLORS["rloo"], label="rloo")
        axis.set_xscale("symlog", linthresh=0.03)  # shows delta^2 = 0 next to the log-spaced rest
        axis.set_xlim(0, max(ratios) * 1.5)
        axis.set(yscale="log", ylim=(5e-3, 5), xlabel="delta^2 / sigma^2", ylabel="MSE / RLOO's MSE",
                 title=f"estimating mu_c, K={rollouts}, B={contexts}")
        axis.legend(fontsize=7)
    names = list(GRADIENT_BASELINES)
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        heights = [row["relative_mse"][name] for row in gradient]
        axes[1, 0].bar([i + index * width for i in range(len(gradient))], heights, width, color=COLORS[name], label=name)
    axes[1, 0].set(xticks=[i + 0.4 - width / 2 for i in range(len(gradient))], xticklabels=[f"offset spread {row['offset_spread']:g}" for row in gradient],
                   yscale="log", ylabel="gradient MSE / E|grad|^2", title=f"REINFORCE gradient, B={config.contexts}, K={config.rollouts}")
    axes[1, 0].legend(fontsize=7)
    spreads = list(learning)
    for axis, spread in zip(axes[1, 1:], [spreads[0], spreads[-1]]):
        record = learning[spread]
        for name in names:
            distance, se = -torch.tensor(record["mean"][name]), torch.tensor(record["se"][name])  # E|tau - target|^2, lower is better
            axis.plot(record["iterations"], distance, color=COLORS[name], label=name)
            axis.fill_between(record["iterations"], distance - se, distance + se, color=COLORS[name], alpha=0.2)
        axis.set(yscale="log", xlabel="iteration", ylabel="E|tau - target|^2 (held out)", title=f"learning, offset spread {spread}")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    config = parse_config()
    torch.set_num_threads(config.threads)
    os.makedirs(config.out_dir, exist_ok=True)
    cells_count = len(config.ratios) * len(config.rollouts_grid) * len(config.contexts_grid)
    print(f"toy_js: {cells_count} estimation cells x {config.rewards_per_cell}..{config.max_rewards_per_cell} rewards; "
          f"bandit B={config.contexts} K={config.rollouts}, "
          f"{config.gradient_batches} gradient batches, {len(config.offset_spreads)} offset spreads x {len(GRADIENT_BASELINES)} baselines "
          f"x {config.seeds} seeds x {config.iterations} iterations")
    start = time.time()

    # ---- part A: estimation
    cells = run_estimation(config)
    summary = summarize_estimation(cells)
    estimation_lines = print_estimation(cells, summary)
    estimation_seconds = time.time() - start

    # ---- part B: gradients and learning
    setup, gradient, learning = run_bandit(config)
    bandit_lines = print_bandit(config, setup, gradient, learning)

    # ---- outputs
    plot(config, cells, gradient, learning, os.path.join(config.out_dir, "toy_js.png"))
    runtime = time.time() - start
    record = dict(config=asdict(config), estimation=cells, estimation_summary=summary, bandit=setup, gradient=gradient,
                  learning=learning, conclusions=estimation_lines + bandit_lines,
                  seconds=dict(estimation=estimation_seconds, total=runtime))
    with open(os.path.join(config.out_dir, "toy_js.json"), "w") as file:
        json.dump(record, file, indent=1)
    print(f"\nwrote {config.out_dir}/toy_js.json and toy_js.png in {runtime:.1f} s")
