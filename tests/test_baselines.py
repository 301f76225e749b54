import math

import pytest
import torch

from baselines import (
    BASELINES,
    cross_context,
    james_stein,
    james_stein_unbiased,
    rloo,
    shrinkage,
    shrinkage_leave_one_out,
)

# Hand example used below, B = 3 contexts, K = 2 rollouts.
#   context means 2, 4, 6 (grand mean 4)
#   within variances (1-3)^2/2 = 2, (2-6)^2/2 = 8, (4-8)^2/2 = 8
#   s2 = (2 + 8 + 8) / 3 = 6
#   b_xctx = (24 - r) / 5; mean_i b_xctx[c, i] = (24 - rbar_c) / 5 = 4.4, 4.0, 3.6
#   1/(B-1) sum_c (rbar_c - mean_i b_xctx)^2 = (2.4^2 + 0 + 2.4^2) / 2 = 5.76
#   d2 = 5.76 - s2/K = 2.76;  a = (6/1) / (6 + 2.76) = 6 / 8.76 = 50/73
HAND = torch.tensor([[1.0, 3.0], [2.0, 6.0], [4.0, 8.0]], dtype=torch.float64)
HAND_WEIGHT = 50 / 73


def random_rewards(contexts, rollouts, seed=0, spread=2.0):
    generator = torch.Generator().manual_seed(seed)
    means = spread * torch.randn((contexts, 1), generator=generator, dtype=torch.float64)
    return means + torch.randn((contexts, rollouts), generator=generator, dtype=torch.float64)


# -----------------------------------------------------------------------------
# hand-computed values


def test_rloo_cross_context_and_james_stein_hand_values():
    # [1, 2, 6]: others' means (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5
    assert torch.allclose(rloo(torch.tensor([[1.0, 2.0, 6.0]])), torch.tensor([[4.0, 3.5, 1.5]]))
    # K = 2: the other rollout
    assert torch.equal(rloo(HAND), HAND.new_tensor([[3.0, 1.0], [6.0, 2.0], [8.0, 4.0]]))
    # cross-context: total 24, B*K - 1 = 5: (24 - r) / 5
    expected = HAND.new_tensor([[23.0, 21.0], [22.0, 18.0], [20.0, 16.0]]) / 5
    assert torch.allclose(cross_context(HAND), expected)
    assert shrinkage(HAND).item() == pytest.approx(HAND_WEIGHT, rel=1e-12)
    assert shrinkage(HAND).shape == ()
    # b = (23/73) * rloo + (50/73) * xctx, e.g. b[0, 0] = (23*3 + 50*4.6) / 73 = 299/73
    expected = HAND.new_tensor([[299.0, 233.0], [358.0, 226.0], [384.0, 252.0]]) / 73
    assert torch.allclose(james_stein(HAND), expected, rtol=1e-12)


def test_james_stein_follows_the_written_formula():
    # the paper's d2 uses deviations from mean_i b_xctx[c, i]; _weight uses the equivalent
    # (BK/(BK-1))^2 * sum (rbar_c - rbar)^2; check the two agree on random data
    rewards = random_rewards(7, 3, seed=1)
    contexts, rollouts = rewards.shape
    within = rewards.var(dim=1).mean()
    # s2's literal reading (docs/DESIGN.md), the dispersion around b_rloo, is K/(K-1) times it
    literal = (rewards - rloo(rewards)).square().mean()
    assert literal.item() == pytest.approx(rollouts / (rollouts - 1) * within.item(), rel=1e-12)
    deviations = rewards.mean(dim=1) - cross_context(rewards).mean(dim=1)
    spread = deviations.square().sum() / (contexts - 1)
    between = torch.clamp(spread - within / rollouts, min=0)
    weight = (within / (rollouts - 1)) / (within / (rollouts - 1) + between)
    assert shrinkage(rewards).item() == pytest.approx(weight.item(), rel=1e-12)
    mix = (1 - weight) * rloo(rewards) + weight * cross_context(rewards)
    assert torch.allclose(james_stein(rewards), mix, rtol=1e-12)


def test_unbiased_weight_is_the_weight_without_that_context():
    """a_c is the plug-in weight of the other contexts, so no reward of context c moves it; the
    baseline mixes RLOO and XCTX, both free of r[c, i], with it."""
    rewards = random_rewards(9, 4, seed=2)
    weights = shrinkage_leave_one_out(rewards)
    for context in range(rewards.shape[0]):
        others = torch.cat([rewards[:context], rewards[context + 1 :]])
        assert weights[context].item() == pytest.approx(shrinkage(others).item(), rel=1e-10)
    mix = (1 - weights[:, None]) * rloo(rewards) + weights[:, None] * cross_context(rewards)
    assert torch.allclose(james_stein_unbiased(rewards), mix, rtol=1e-12)


# -----------------------------------------------------------------------------
# leave-one-out properties


@pytest.mark.parametrize("name", ["rloo", "xctx", "js-unbiased", "js"])
def test_baseline_of_a_rollout_ignores_its_own_reward_but_plug_in_js(name):
    """Leave-one-out, hence unbiased; not automatic: the plug-in weight of js sees r[c, i]."""
    rewards = random_rewards(5, 3, seed=3)
    baseline = BASELINES[name](rewards)
    for context in range(5):
        for rollout in range(3):
            changed = rewards.clone()
            changed[context, rollout] += 7.5
            after = BASELINES[name](changed)[context, rollout].item()
            before = baseline[context, rollout].item()
            if name == "js":
                assert abs(after - before) > 1e-3
            else:
                assert after == pytest.approx(before, rel=1e-12, abs=1e-12)


# -----------------------------------------------------------------------------
# limits, invariances, types


def test_weight_goes_to_zero_when_contexts_differ_a_lot():
    rewards = random_rewards(8, 2, seed=5) + 1000.0 * torch.arange(8, dtype=torch.float64)[:, None]
    assert shrinkage(rewards).item() < 1e-4
    assert shrinkage_leave_one_out(rewards).max().item() < 1e-4
    assert torch.allclose(james_stein(rewards), rloo(rewards), atol=1e-2)


def test_weight_is_one_when_contexts_do_not_differ_and_degenerate_batches():
    # every context has mean 5: the between-context spread is 0, d2 = 0, a = 1, and JS is XCTX
    rewards = torch.tensor([[4.0, 6.0], [3.0, 7.0], [5.0, 5.0], [0.0, 10.0]])
    assert shrinkage(rewards).item() == 1.0
    assert torch.allclose(shrinkage_leave_one_out(rewards), torch.ones(4))
    assert torch.allclose(james_stein(rewards), cross_context(rewards))
    # all rewards equal: a = 1 by convention, every baseline equals the reward
    constant = torch.full((4, 2), 3.0)
    assert shrinkage(constant).item() == 1.0
    assert torch.equal(james_stein(constant), constant)
    # identical rollouts within each context but different contexts: s2 = 0, so a = 0 and JS is RLOO
    rewards = torch.tensor([[1.0, 1.0], [2.0, 2.0], [5.0, 5.0]])
    assert shrinkage(rewards).item() == 0.0
    assert torch.equal(james_stein(rewards), rloo(rewards))


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_equivariant_detached_and_in_the_rewards_dtype(name):
    rewards = random_rewards(6, 3, seed=6)
    scaled = BASELINES[name](2.5 * rewards - 40.0)
    assert torch.allclose(scaled, 2.5 * BASELINES[name](rewards) - 40.0, atol=1e-10)
    baseline = BASELINES[name](rewards.float().requires_grad_(True))
    assert baseline.shape == (6, 3) and baseline.dtype == torch.float32
    assert not baseline.requires_grad
    integers = torch.tensor([[1, 2], [3, 5], [4, 4], [0, 9]])
    assert BASELINES[name](integers).dtype == torch.get_default_dtype()


def test_float32_rewards_near_30_are_handled_in_float64():
    # HPSv2-like rewards at 30 with differences of 0.1: float32 alone would lose digits in s2 and d2
    rewards64 = 30.0 + 0.1 * random_rewards(16, 2, seed=8, spread=0.7)
    rewards32 = rewards64.float()
    rewards = rewards32.double()
    assert shrinkage(rewards32).item() == pytest.approx(shrinkage(rewards).item(), rel=1e-6)
    assert torch.allclose(james_stein(rewards32).double(), james_stein(rewards), atol=1e-5)


def test_a_stack_of_batches_equals_each_batch_alone():
    batches = torch.stack([random_rewards(5, 3, seed=s) for s in range(4)])  # (4, 5, 3)
    for index in range(4):
        for name, function in dict(BASELINES, a=shrinkage, a_c=shrinkage_leave_one_out).items():
            assert torch.allclose(function(batches)[index], function(batches[index])), name


# -----------------------------------------------------------------------------
# statistics under the random-effects model r = mu_c + eps, mu_c = mu_0 + xi


def simulate(batches, contexts, rollouts, sigma2, delta2, seed):
    options = dict(generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    means = 1.0 + math.sqrt(delta2) * torch.randn((batches, contexts, 1), **options)
    return means, means + math.sqrt(sigma2) * torch.randn((batches, contexts, rollouts), **options)


@pytest.mark.parametrize("rollouts, delta2", [(2, 1.0), (4, 0.25)])
def test_weight_is_consistent(rollouts, delta2):
    # One batch of B = 20000 contexts, sigma^2 = 1, true a = (1/(K-1)) / (1/(K-1) + delta^2).
    # With s2 (estimates 1) and T, the spread (estimates Var rbar_c = delta^2 + 1/K), the weight is
    # a = (s2/(K-1)) / (s2/(K(K-1)) + T); at the truth the denominator is delta^2 + 1/(K-1).
    # Delta method: da/ds2 = T/(K-1)/den^2, da/dT = -1/(K-1)/den^2, SD(s2) = sqrt(2/(B(K-1))),
    # SD(T) = T sqrt(2/(B-1)), s2 and T independent for normal data. The (BK/(BK-1))^2 factor in T
    # moves a by under 1e-4. Tolerance: 5 SD.
    contexts = 20000
    _, rewards = simulate(1, contexts, rollouts, 1.0, delta2, seed=9)
    true = (1 / (rollouts - 1)) / (1 / (rollouts - 1) + delta2)
    spread = delta2 + 1 / rollouts
    # |da/ds2| SD(s2) and |da/dT| SD(T) share the factor T/(K-1)/den^2
    factor = spread / (rollouts - 1) / (delta2 + 1 / (rollouts - 1)) ** 2
    sd = factor * math.sqrt(2 / (contexts * (rollouts - 1)) + 2 / (contexts - 1))
    assert sd < 0.01  # a tolerance that can tell a from neighbouring values
    assert abs(shrinkage(rewards[0]).item() - true) < 5 * sd
    assert abs(shrinkage_leave_one_out(rewards[0]).mean().item() - true) < 5 * sd


@pytest.mark.parametrize(
    "contexts, rollouts, delta2", [(3, 2, 1.0), (4, 4, 0.3), (16, 2, 3.0), (32, 8, 0.1)]
)
def test_james_stein_beats_rloo_as_an_estimate_of_mu(contexts, rollouts, delta2):
    # paired over the same 4000 simulated batches: mean of (JS error - RLOO error) must be below 0
    # by more than 4 standard errors of that mean
    means, rewards = simulate(4000, contexts, rollouts, 1.0, delta2, seed=10)
    js_error = (james_stein(rewards) - means).square().mean(dim=(1, 2))
    rloo_error = (rloo(rewards) - means).square().mean(dim=(1, 2))
    difference = js_error - rloo_error
    assert difference.mean() + 4 * difference.std() / math.sqrt(4000) < 0


# -----------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_shape_errors(name):
    with pytest.raises(ValueError, match=r"shape \(\.\.\., contexts, rollouts >= 2\), got \(8,\)"):
        BASELINES[name](torch.ones(8))
    with pytest.raises(ValueError, match="rollouts >= 2"):
        BASELINES[name](torch.ones(8, 1))


def test_context_count_errors():
    functions = (james_stein, shrinkage, james_stein_unbiased, shrinkage_leave_one_out)
    for function, least in zip(functions, (3, 3, 4, 4)):
        with pytest.raises(ValueError, match=f"needs at least {least} contexts per batch"):
            function(torch.rand(least - 1, 2))
    # RLOO and XCTX work from one context
    assert torch.equal(rloo(torch.tensor([[1.0, 2.0]])), torch.tensor([[2.0, 1.0]]))
    assert torch.equal(cross_context(torch.tensor([[1.0, 2.0]])), torch.tensor([[2.0, 1.0]]))
