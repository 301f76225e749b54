"""docs/BOUND.md's closed forms against simulated batches, and python -m evidence.bound's run."""

import itertools
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch
from conftest import ROOT

from baselines import cross_context, rloo
from evidence.bound import (
    CONTEXTS,
    RATIOS,
    ROLLOUTS,
    bound_cell,
    cross_context_variance,
    effective_batch,
    factor_table,
    largest_factor_over_best,
    mix_variance,
    plug_in_variance,
    rloo_variance,
    tie_cells,
    variance_optimal_weight,
)
from toy_js import oracle_baseline, oracle_weight

RESULTS = Path(ROOT, "docs", "RESULTS.md")


def test_quick_run_prints_every_table_and_draws_the_figure(tmp_path):
    results_before = RESULTS.read_bytes()
    command = [sys.executable, "-m", "evidence.bound", "--quick", "--out-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert RESULTS.read_bytes() == results_before  # --quick records nothing
    assert matplotlib.image.imread(tmp_path / "bound.png").shape[0] > 300
    # the factor table is the closed forms alone: the same in --quick
    assert "\n".join(factor_table()) in result.stdout and "Conclusions:" in result.stdout
    for k, b, ratio in itertools.product(ROLLOUTS, CONTEXTS, RATIOS):  # a row per simulated cell
        assert f"\n{k:>2} {b:>3} {ratio:>6g} | " in result.stdout, (k, b, ratio)


# -----------------------------------------------------------------------------
# the closed forms and the plug-in weight


def test_oracle_baseline_is_the_variance_optimal_mix():
    # BOUND.md, eq. 5: the posterior mean of mu_c given every other reward is the fixed mix of RLOO
    # and XCTX with the weight a_var, an identity (not a statistical statement); at rho = 0 the
    # weight is 1 and the oracle is XCTX, the mean of all other rewards
    generator = torch.Generator().manual_seed(4)
    for ratio, rollouts, contexts in ((1.0, 2, 16), (0.3, 4, 5), (3.0, 3, 7), (0.0, 3, 5)):
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


def test_the_plug_in_approximation_against_simulated_batches():
    """Eq. 10 (the weight's sampling distribution, its dependence on the reward left out) against
    the simulated variance per unit of signal, 2^20 rewards per cell (a standard error of about
    0.2%). At the tie, where the test of "JS beats both" belongs, the two agree within 1%; off it
    the approximation drifts by a few per cent (docs/BOUND.md), and both stay below a*'s factor."""
    generator = torch.Generator().manual_seed(6)
    for contexts, ratio, tolerance in ((4, None, 0.01), (16, None, 0.01), (4, 0.0, 0.08)):
        ratio = largest_factor_over_best(2, contexts)[0] if ratio is None else ratio
        cell = bound_cell(ratio, contexts, 2, 2**20, generator)
        approximation = plug_in_variance(ratio, 2, contexts)
        assert approximation == pytest.approx(cell["js_per_signal"], rel=tolerance), contexts
        assert approximation > mix_variance(oracle_weight(ratio, 2), ratio, 2, contexts)
    # at the tie the plug-in keeps less of a*'s lead the fewer contexts there are
    factors = []
    for contexts in (3, 4, 8, 16, 32):
        tie = largest_factor_over_best(2, contexts)[0]
        factors.append(rloo_variance(2) / plug_in_variance(tie, 2, contexts))
    assert factors == sorted(factors) and 1.1 < factors[0] and factors[-1] < 4 / 3
