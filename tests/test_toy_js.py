import json
import math
import os
import runpy
import subprocess
import sys

import matplotlib.image
import pytest
import torch
from torch.distributions import Dirichlet

from baselines import cross_context, james_stein, james_stein_unbiased, rloo
from toy_js import (
    BOUND_CONTEXTS,
    BOUND_RATIOS,
    BOUND_ROLLOUTS,
    CONTEXTS,
    RATIOS,
    ROLLOUTS,
    Bandit,
    cross_context_variance,
    effective_batch,
    expected_quality,
    factor_table,
    largest_factor_over_best,
    mix_variance,
    oracle_baseline,
    oracle_weight,
    rloo_variance,
    tie_cells,
    variance_optimal_weight,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("toy_js")
    with open(os.path.join(ROOT, "docs", "RESULTS.md"), "rb") as file:
        results_before = file.read()
    result = subprocess.run(
        [sys.executable, "toy_js.py", "--quick", "--out-dir", str(out_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    with open(out_dir / "toy_js.json") as file:
        record = json.load(file)
    with open(os.path.join(ROOT, "docs", "RESULTS.md"), "rb") as file:
        assert file.read() == results_before  # only `python -m evidence.toy_js` writes evidence
    return out_dir, result.stdout, record


def test_the_evidence_command_records_what_toy_js_prints(monkeypatch, tmp_path, capsys):
    import toy_js
    from evidence import results

    recorded = []
    monkeypatch.setattr(toy_js, "FULL", toy_js.QUICK)  # the same code path, a few seconds
    monkeypatch.setattr(results, "record", lambda *args, **kwargs: recorded.append(args))
    monkeypatch.setattr(sys, "argv", ["evidence.toy_js"])
    monkeypatch.chdir(tmp_path)  # out/toy_js goes here
    threads = torch.get_num_threads()
    try:
        runpy.run_module("evidence.toy_js", run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    [(name, command, lines)] = recorded
    assert (name, command) == ("toy_js", "python -m evidence.toy_js")
    stdout = capsys.readouterr().out
    assert stdout.startswith("\n".join(lines) + "\n") and "Conclusions:" in lines
    assert "docs/RESULTS.md (section toy_js)" in stdout.splitlines()[-1]
    assert (tmp_path / "out" / "toy_js" / "toy_js.json").is_file()


def test_quick_run_writes_the_promised_files(quick_run):
    out_dir, stdout, record = quick_run
    assert matplotlib.image.imread(out_dir / "toy_js.png").shape[0] > 300
    assert all(f"Part {part}" in stdout for part in "ABC") and "Conclusions" in stdout
    for line in record["conclusions"]:
        assert line.strip() in stdout  # what is printed is what is saved


def test_quick_run_estimation_table(quick_run):
    _, _, record = quick_run
    cells = record["estimation"]
    assert len(cells) == len(RATIOS) * len(ROLLOUTS) * len(CONTEXTS) == 72
    assert {(cell["K"], cell["B"]) for cell in cells} == {
        (k, b) for k in (2, 4, 8) for b in (4, 16, 32)
    }
    for cell in cells:
        assert set(cell["mse"]) == {"rloo", "xctx", "js", "js-unbiased", "oracle"}
        assert 0 <= cell["mean_weight"] <= 1
        # RLOO's MSE is sigma^2/(K-1) exactly; even --quick's few batches land within 30%
        assert cell["mse"]["rloo"] == pytest.approx(1 / (cell["K"] - 1), rel=0.3)
        # the floor sigma^2 delta^2 / (sigma^2 + (K-1) delta^2): nothing that leaves r[c, i] out
        # beats it (noisy in --quick)
        floor = cell["ratio"] / (1 + (cell["K"] - 1) * cell["ratio"])
        assert floor <= cell["mse"]["oracle"] * 1.2 + 1e-12
        # contexts identical: XCTX's MSE is sigma^2/(BK-1), RLOO's (BK-1)/(K-1) >= 4.4 times more
        if cell["ratio"] == 0:
            assert cell["mse"]["xctx"] == pytest.approx(1 / (cell["B"] * cell["K"] - 1), rel=0.3)
        # contexts far apart: XCTX is off by about delta, 100 sigma^2 >> RLOO's 1/(K-1)
        if cell["ratio"] == 100:
            assert cell["mse"]["xctx"] > 20 * cell["mse"]["rloo"]
    assert sum(cell["js_minus_rloo_z"] < -3.5 for cell in cells) >= 40


def test_quick_run_gradient_table(quick_run):
    _, _, record = quick_run
    assert list(record["gradient"]) == ["0.0", "1.0", "10.0"]
    for row in record["gradient"].values():
        assert set(row) == {"none", "rloo", "xctx", "js", "js-unbiased"}
    widest = record["gradient"]["10.0"]  # offsets 10x the rollout noise: no baseline is hopeless
    assert widest["none"][0] > 10 * widest["rloo"][0] and widest["xctx"][0] > 10 * widest["rloo"][0]


def test_quick_run_bound_table(quick_run):
    _, stdout, record = quick_run
    cells = record["bound"]["cells"]
    grid = {(k, b, ratio) for k in BOUND_ROLLOUTS for b in BOUND_CONTEXTS for ratio in BOUND_RATIOS}
    assert {(cell["K"], cell["B"], cell["ratio"]) for cell in cells} == grid
    for cell in cells:
        assert set(cell["form"]) == {"rloo", "xctx", "js a*", "oracle", "ideal"}
        assert {"js", "js-unbiased", "kept"} <= set(cell["simulated"])
    # the factor table is the closed forms alone: the same in --quick, and printed as saved
    assert record["bound"]["factors"] == factor_table()
    assert "\n".join(factor_table()) in stdout


# -----------------------------------------------------------------------------
# the pieces the tables rest on


def test_oracle_limits():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn((3, 5, 4), generator=generator, dtype=torch.float64)
    # delta = 0: mu_c = mu_0 for all contexts, the best estimate is the mean of all other rewards
    assert torch.allclose(oracle_baseline(rewards, 1.0, 0.0), cross_context(rewards))
    # delta huge: the other contexts say nothing, only the other rollouts of c count
    assert torch.allclose(oracle_baseline(rewards, 1.0, 1e12), rloo(rewards), atol=1e-9)


def test_oracle_is_a_floor_for_james_stein():
    # paired over 20000 simulated batches (B = 4, K = 2, delta^2/sigma^2 = 0.3): the oracle's mean
    # squared error is below JS's by more than 4 standard errors of the paired difference
    generator = torch.Generator().manual_seed(1)
    means = math.sqrt(0.3) * torch.randn((20000, 4, 1), generator=generator, dtype=torch.float64)
    rewards = means + torch.randn((20000, 4, 2), generator=generator, dtype=torch.float64)
    difference = (oracle_baseline(rewards, 1.0, 0.3) - means).square().mean(dim=(1, 2)) - (
        james_stein(rewards) - means
    ).square().mean(dim=(1, 2))
    assert difference.mean() + 4 * difference.std() / math.sqrt(20000) < 0


def test_expected_quality_matches_monte_carlo():
    # 200000 draws: the Monte Carlo mean is within 5 standard errors of the closed form
    alpha = torch.tensor(
        [[2.0, 0.5, 3.0, 1.0, 4.0], [0.3, 0.3, 0.3, 0.3, 0.3]], dtype=torch.float64
    )
    target = torch.softmax(
        torch.tensor([[1.0, 0.0, -1.0, 0.5, 0.2], [0.0, 2.0, 0.0, 0.0, 0.0]], dtype=torch.float64),
        dim=-1,
    )
    torch.manual_seed(2)
    samples = -(Dirichlet(alpha).sample((200000,)) - target).square().sum(-1)  # (200000, 2)
    error = samples.std(dim=0) / math.sqrt(200000)
    assert ((samples.mean(dim=0) - expected_quality(alpha, target)).abs() < 5 * error).all()


@pytest.mark.parametrize("name", ["rloo", "js-unbiased"])
def test_reinforce_gradient_is_unbiased_for_the_exact_gradient(name):
    # the machinery of part B: with an exactly unbiased baseline, the REINFORCE estimate averages to
    # the autograd gradient of the closed-form objective; every coordinate within 5 standard errors
    batches, contexts = 6000, 6
    generator = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    bandit = Bandit(generator, actions=5, features=4)
    weight, bias = bandit.initial_policy((batches,))
    weight = (
        weight + 0.3 * torch.randn(weight.shape[1:], generator=generator, dtype=weight.dtype)
    ).requires_grad_(True)
    bias.requires_grad_(True)
    features, targets, offsets, scales = bandit.draw((batches, contexts), 3.0, generator)
    alpha = bandit.alpha(weight, bias, features)
    objective = (
        (offsets + scales * expected_quality(alpha, targets) / bandit.noise_unit).mean(dim=-1).sum()
    )
    exact = torch.cat(
        [g.flatten(1) for g in torch.autograd.grad(objective, (weight, bias), retain_graph=True)],
        dim=1,
    )
    tau = Dirichlet(alpha.detach()).sample((2,)).movedim(0, -2)
    rewards = bandit.rewards(tau, targets, offsets, scales)
    baseline = rloo(rewards) if name == "rloo" else james_stein_unbiased(rewards)
    surrogate = (
        ((rewards - baseline) * Dirichlet(alpha[..., None, :]).log_prob(tau))
        .mean(dim=(-2, -1))
        .sum()
    )
    estimate = torch.cat(
        [g.flatten(1) for g in torch.autograd.grad(surrogate, (weight, bias))], dim=1
    )
    difference = estimate - exact  # (R, P)
    error = difference.std(dim=0) / math.sqrt(batches)
    assert (difference.mean(dim=0).abs() < 5 * error).all()
    assert (
        exact.mean(dim=0).abs() > 5 * error
    ).any()  # the gradient itself is resolved, so the test can fail


# -----------------------------------------------------------------------------
# part C: the variance of the advantage r - b in closed form (docs/BOUND.md)


def test_oracle_baseline_is_the_variance_optimal_mix():
    # BOUND.md, eq. 5: the posterior mean of mu_c given every other reward is the fixed mix of RLOO
    # and XCTX with the weight a_var, an identity (not a statistical statement)
    generator = torch.Generator().manual_seed(4)
    for ratio, rollouts, contexts in ((1.0, 2, 16), (0.3, 4, 5), (3.0, 3, 7)):
        rewards = torch.randn((10, contexts, rollouts), generator=generator, dtype=torch.float64)
        weight = variance_optimal_weight(ratio, rollouts, contexts)
        mix = (1 - weight) * rloo(rewards) + weight * cross_context(rewards)
        assert torch.allclose(mix, oracle_baseline(rewards, 1.0, ratio), rtol=0, atol=1e-12)
        # and a_var minimises eq. 3: a step of 0.01 either way raises the variance
        best = mix_variance(weight, ratio, rollouts, contexts)
        for step in (-0.01, 0.01):
            assert mix_variance(weight + step, ratio, rollouts, contexts) > best


def test_closed_forms_by_hand():
    assert rloo_variance(2) == 2 and rloo_variance(4) == pytest.approx(4 / 3)
    # B -> inf: XCTX 1 + rho, JS 1 + rho / (1 + (K-1) rho), a* = a_var
    assert cross_context_variance(1.0, 2) == pytest.approx(2.0)
    assert mix_variance(oracle_weight(1.0, 2), 1.0, 2) == pytest.approx(1.5)
    assert mix_variance(oracle_weight(0.5, 4), 0.5, 4) == pytest.approx(1 + 0.5 / 2.5)
    assert variance_optimal_weight(0.7, 3) == pytest.approx(oracle_weight(0.7, 3))
    # B = 16, K = 2: XCTX at rho = 1 is 32/31 + 4 * 16 * 15 / 31^2; at rho = 0 JS is XCTX, 32/31,
    # and RLOO would need 2 * 31/32 times its batch
    assert cross_context_variance(1.0, 2, 16) == pytest.approx(32 / 31 + 960 / 961)
    assert effective_batch(0.0, 2, 16) == pytest.approx({"rloo": 62 / 32, "best": 1.0})
    # eq. 9: 2K/(2K-1) as B -> inf, and the largest factor over the better of RLOO and XCTX
    assert largest_factor_over_best(2) == pytest.approx((1.0, 4 / 3))
    assert largest_factor_over_best(4) == pytest.approx((1 / 3, 8 / 7))
    for rollouts, contexts in ((2, 16), (4, 16), (2, 4)):
        ratio, factor = largest_factor_over_best(rollouts, contexts)
        weight = variance_optimal_weight(ratio, rollouts, contexts)
        assert weight == pytest.approx(0.5)
        at = effective_batch(ratio, rollouts, contexts, weight)["best"]
        assert at == pytest.approx(factor, rel=1e-12)
        around = [ratio * 10 ** (k / 500) for k in range(-500, 501)]  # rho / 10 .. 10 rho
        weights = [variance_optimal_weight(r, rollouts, contexts) for r in around]
        factors = [
            effective_batch(r, rollouts, contexts, w)["best"] for r, w in zip(around, weights)
        ]
        assert max(factors) <= factor * (1 + 1e-12)


@pytest.mark.parametrize(
    "ratio, rollouts, contexts", [(1.0, 2, 16), (0.3, 2, 16), (0.1, 2, 4), (3.0, 4, 8)]
)
def test_closed_forms_match_simulated_batches(ratio, rollouts, contexts):
    """Each closed form against R simulated batches of the random-effects model (sigma^2 = 1).

    Tolerance: per batch j, m_j = the mean of (r - b)^2 over its N = B*K advantages. The m_j are
    independent and identically distributed with mean Var(r - b) (E(r - b) = 0), so their average
    has standard error sd(m) / sqrt(R), sd(m) estimated from the same R values: the simulated fourth
    moments, the correlations of the advantages within a batch included. A form passes within 5
    standard errors; a correct one fails with probability about 6e-7 (normal approximation, sound
    at R >= 2^16). R * N = 2^21 rewards makes 5 standard errors under 1% of every form (asserted),
    so a factor wrong by 1% fails; at B = 16, K = 2 the B -> inf limits (off by 1.6% at rho = 1,
    2.4% at rho = 0.3) are asserted to fail."""
    batches = 2**21 // (contexts * rollouts)
    generator = torch.Generator().manual_seed(5)
    shape = (batches, contexts, rollouts)
    noise = torch.randn(shape[:2] + (1,), generator=generator, dtype=torch.float64)
    means = 3.0 + math.sqrt(ratio) * noise  # mu_c
    rewards = means + torch.randn(shape, generator=generator, dtype=torch.float64)
    own, cross = rloo(rewards), cross_context(rewards)
    star = oracle_weight(ratio, rollouts)
    best = variance_optimal_weight(ratio, rollouts, contexts)
    estimates = {
        "rloo": (own, rloo_variance(rollouts)),
        "xctx": (cross, cross_context_variance(ratio, rollouts, contexts)),
        "js a*": ((1 - star) * own + star * cross, mix_variance(star, ratio, rollouts, contexts)),
        "a_var": ((1 - best) * own + best * cross, mix_variance(best, ratio, rollouts, contexts)),
        "ideal": (means.expand(shape), 1.0),
    }
    js_limit = 1 + ratio / (1 + (rollouts - 1) * ratio)  # eq. 6
    limits = {"xctx": cross_context_variance(ratio, rollouts), "js a*": js_limit}
    for name, (baseline, form) in estimates.items():
        squares = (rewards - baseline).square().mean(dim=(1, 2))  # (R,) the m_j
        simulated = squares.mean().item()
        tolerance = 5 * squares.std().item() / math.sqrt(batches)
        assert tolerance < 0.01 * form, name  # the test can tell a 1% error
        assert abs(simulated - form) < tolerance, (name, simulated, form, tolerance)
        if (rollouts, contexts) == (2, 16) and name in limits:
            assert abs(simulated - limits[name]) > tolerance, name  # finite B is resolved


def test_the_plug_in_weight_keeps_less_than_a_star():
    """Part C's tie table at K = 2: the effective batch over the better of RLOO and XCTX of the
    plug-in JS, per unit of signal, against JS with a* (eq. 8). At B = 4 the plug-in weight, a
    noisy estimate of a*, leaves much of a*'s lead at the tie (eq. 9: 14/11, a* within 0.002) and
    falls below 1 at rho = 0, where cross-context is better; as B grows the estimate converges to
    a*, so at B = 32 the two are within 4%. Each gap is more than 10 simulated standard errors
    (2^19 rewards per cell)."""
    cells = {(c["B"], c["ratio"]): c for c in tie_cells(2**19, torch.Generator().manual_seed(1))}

    def factors(contexts, ratio):
        c = cells[(contexts, ratio)]
        better = min(c["form"]["rloo"], c["form"]["xctx"])
        se = c["standard_error"]["js"] / c["simulated"]["js"] * better / c["js_per_signal"]
        return effective_batch(ratio, 2, contexts)["best"], better / c["js_per_signal"], se

    ideal, plug_in, se = factors(4, largest_factor_over_best(2, 4)[0])
    assert ideal == pytest.approx(14 / 11, abs=2e-3) and plug_in < ideal - 10 * se and plug_in > 1
    _, plug_in, se = factors(4, 0.0)
    assert plug_in < 1 - 10 * se
    ideal, plug_in, se = factors(32, largest_factor_over_best(2, 32)[0])
    assert plug_in < ideal and plug_in > 0.96 * ideal, (ideal, plug_in, se)
