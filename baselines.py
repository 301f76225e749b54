"""
Baselines for REINFORCE with K rollouts per context (the paper, Sec. 3).

A batch holds B contexts (prompt + initial noise) with K sampled schedules each; its rewards are a
tensor of shape (B, K). Every estimator here returns a detached baseline b of the same shape, and the
trainer's loss is -mean((r - b) * log pi(tau)). The K rollouts of a context are independent given the
context, so a baseline b[c, i] built from the *other* rewards is a constant as far as rollout (c, i)
is concerned and (r - b) * grad log pi stays an unbiased gradient term. RLOO, XCTX and the unbiased
JS are built that way; the plug-in JS nearly so (its weight a sees r[c, i], see below).

    rloo           b[c, i] = mean of the other K-1 rewards of context c
    cross_context  b[c, i] = mean of the other B*K-1 rewards of the batch
    james_stein    b[c, i] = (1 - a) * rloo + a * cross_context, a estimated from the batch

James-Stein comes from the random-effects model r[c, i] = mu_c + eps (Var eps = sigma^2, the rollout
noise), mu_c = mu_0 + xi (Var xi = delta^2, how much contexts differ). The variance-optimal baseline
of a near-deterministic policy is about mu_c (Prop. 3.1). RLOO estimates it without bias but with
variance sigma^2/(K-1); the cross-context mean has little variance but is off by mu_c - mu_0. The
posterior mean of mu_c given the other K-1 rollouts mixes the two with the weight
a = (sigma^2/(K-1)) / (sigma^2/(K-1) + delta^2); JS plugs in estimates of sigma^2 and delta^2 from
the batch (empirical Bayes). The paper's Thm. 3.2 states: a lower mean squared error than RLOO for
B >= 3. toy_js.py measures this per-rollout form: lower in every setting with B >= 6 it tries, and far
lower when contexts are alike; with few contexts, many rollouts and contexts far apart it sits just
above RLOO (B = 4, K = 8, delta^2 >= 10 sigma^2: by up to 0.25% of RLOO's MSE; B = 3, K = 8,
delta^2 >= 3 sigma^2: up to 1.6%; B = 3, K = 4, delta^2 >= 30 sigma^2: up to 0.3%).

That plug-in weight uses every reward of the batch, r[c, i] included, so the plain JS gradient is
biased by O(1/(BK)). `james_stein(rewards, unbiased=True)` fits the weight of context c on the other
B-1 contexts only (leave one context out), which removes the bias exactly.

Arithmetic runs in float64: rewards such as HPSv2 x100 sit near 30 with differences of 0.1, and the
variance estimates subtract nearly equal numbers. Results come back in the rewards' dtype.

The public functions check one batch (B, K). The underscored forms below take any number of
independent batches (..., B, K) and check nothing; toy_js.py simulates thousands of batches with them.
"""

from functools import partial

import torch

# Contexts per batch each baseline needs: James-Stein estimates a between-context variance from B - 1
# degrees of freedom (B >= 3, Thm. 3.2), the unbiased form from the B - 1 other contexts (B >= 4).
MIN_CONTEXTS = {"js": 3, "js-unbiased": 4, "rloo": 1, "xctx": 1}

# -----------------------------------------------------------------------------
# the estimators, over independent batches (..., B, K)


def _rloo(rewards: torch.Tensor) -> torch.Tensor:
    """(..., B, K) -> (..., B, K): mean of the other K-1 rewards of the same context (RLOO)."""
    rollouts = rewards.shape[-1]
    context_sums = rewards.sum(dim=-1, keepdim=True)  # (..., B, 1)
    return (context_sums - rewards) / (rollouts - 1)


def _cross_context(rewards: torch.Tensor) -> torch.Tensor:
    """(..., B, K) -> (..., B, K): mean of the other B*K-1 rewards of the batch (XCTX)."""
    contexts, rollouts = rewards.shape[-2:]
    batch_sums = rewards.sum(dim=(-2, -1), keepdim=True)  # (..., 1, 1)
    return (batch_sums - rewards) / (contexts * rollouts - 1)


def _weight(within: torch.Tensor, squares: torch.Tensor, contexts: int, rollouts: int) -> torch.Tensor:
    """The James-Stein weight a from two batch statistics (the paper, JS), shapes (...) -> (...).

    within  = s2, the pooled unbiased within-context variance (the estimate of sigma^2),
    squares = sum_c (rbar_c - rbar)^2 over the `contexts` contexts used.
    a = (s2/(K-1)) / (s2/(K-1) + d2),  d2 = max(0, 1/(B-1) * sum_c (rbar_c - mean_i b_xctx[c, i])^2 - s2/K).
    The paper takes each deviation from mean_i b_xctx[c, i] = (B*K*rbar - rbar_c) / (B*K - 1), which
    is rbar_c - that = B*K/(B*K-1) * (rbar_c - rbar): the textbook spread times (BK/(BK-1))^2 (1.03 at
    B=32, K=2; 1.31 at B=4, K=2), so d2 leans large and a leans towards RLOO. We keep the paper's form.
    a = 1 when s2 = d2 = 0 (every reward equal: all baselines agree and every advantage is 0).
    """
    inflation = (contexts * rollouts / (contexts * rollouts - 1)) ** 2
    spread = inflation * squares / (contexts - 1)  # estimates Var rbar_c = delta^2 + sigma^2/K
    between = (spread - within / rollouts).clamp(min=0)  # d2
    rloo_noise = within / (rollouts - 1)  # Var of the RLOO estimate of mu_c
    total = rloo_noise + between
    return torch.where(total > 0, rloo_noise / total, torch.ones_like(total))


def _context_summaries(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., B, K) -> means rbar_c (..., B), unbiased within-context variances (..., B)."""
    means = rewards.mean(dim=-1)
    variances = (rewards - means[..., None]).square().sum(dim=-1) / (rewards.shape[-1] - 1)
    return means, variances


def _shrinkage(rewards: torch.Tensor) -> torch.Tensor:
    """(..., B, K) -> (...): the plug-in weight a, estimated from every reward of the batch."""
    contexts, rollouts = rewards.shape[-2:]
    means, variances = _context_summaries(rewards)
    within = variances.mean(dim=-1)  # s2; equal K per context makes pooling a plain mean
    squares = (means - means.mean(dim=-1, keepdim=True)).square().sum(dim=-1)
    return _weight(within, squares, contexts, rollouts)


def _unbiased_shrinkage(rewards: torch.Tensor) -> torch.Tensor:
    """(..., B, K) -> (..., B): a_c, the plug-in weight of the batch with context c left out.

    Equal to _shrinkage(rewards with row c deleted), computed by removing context c from the two
    statistics: s2 loses its variance, and sum_{c' != c} (rbar_c' - mean of the others)^2 =
    sum_c' (rbar_c' - rbar)^2 - B/(B-1) * (rbar_c - rbar)^2 (the one-point downdate of a sum of squares).
    """
    contexts, rollouts = rewards.shape[-2:]
    means, variances = _context_summaries(rewards)
    within = (variances.sum(dim=-1, keepdim=True) - variances) / (contexts - 1)  # (..., B) s2 without c
    deviations = (means - means.mean(dim=-1, keepdim=True)).square()  # (..., B)
    squares = deviations.sum(dim=-1, keepdim=True) - contexts / (contexts - 1) * deviations  # (..., B)
    return _weight(within, squares, contexts - 1, rollouts)


def _james_stein(rewards: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """(..., B, K) -> (..., B, K): b_js = (1 - a) * b_rloo + a * b_xctx (the paper, JS); see james_stein."""
    if unbiased:
        weight = _unbiased_shrinkage(rewards)[..., None]  # (..., B, 1): one weight per context
    else:
        weight = _shrinkage(rewards)[..., None, None]  # (..., 1, 1): one weight per batch
    return (1 - weight) * _rloo(rewards) + weight * _cross_context(rewards)


# -----------------------------------------------------------------------------
# the public interface: one batch (B, K), checked


def _checked(rewards: torch.Tensor, name: str, min_contexts: int) -> torch.Tensor:
    """Validate one batch of rewards and return it detached in float64."""
    if rewards.dim() != 2:
        raise ValueError(f"{name}: rewards must have shape (contexts, rollouts), got {tuple(rewards.shape)}; reshape to (B, K)")
    contexts, rollouts = rewards.shape
    if rollouts < 2:
        raise ValueError(f"{name}: needs at least 2 rollouts per context, got K={rollouts}; sample 2 or more rollouts per context")
    if contexts < min_contexts:
        raise ValueError(f"{name}: needs at least {min_contexts} contexts per batch, got B={contexts}; use more contexts or the rloo baseline")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"{name}: rewards contain NaN or inf; check the reward model's output before computing a baseline")
    return rewards.detach().to(torch.float64)


def _output_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """rewards (B, K) -> baseline (B, K): b[c, i] = mean_{j != i} r[c, j] (the paper, RLOO). Needs K >= 2."""
    return _rloo(_checked(rewards, "rloo", min_contexts=1)).to(_output_dtype(rewards))


def cross_context(rewards: torch.Tensor) -> torch.Tensor:
    """rewards (B, K) -> baseline (B, K): b[c, i] = mean of all rewards but r[c, i] (the paper, XCTX). Needs K >= 2."""
    return _cross_context(_checked(rewards, "cross_context", min_contexts=1)).to(_output_dtype(rewards))


def james_stein(rewards: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """rewards (B, K) -> baseline (B, K): b = (1 - a) * b_rloo + a * b_xctx (the paper, JS; Thm. 3.2).

    unbiased=False: a is the paper's plug-in weight, one per batch, estimated from all B*K rewards
    (see _weight). It depends on r[c, i], so the gradient is unbiased only up to O(1/(BK)). Needs B >= 3.

    unbiased=True: leave one context out, as the paper suggests. Unbiasedness needs exactly one thing:
    b[c, i] must not depend on r[c, i], the one reward that is a function of tau[c, i]; r[c, j]
    (j != i) and the other contexts' rewards are independent of tau[c, i] given the context. b_rloo
    and b_xctx already leave r[c, i] out; the plug-in JS breaks the rule only through a. So each
    context c gets its own weight a_c: s2, d2 and a computed on the batch without context c. Then
        b[c, i] = (1 - a_c) * b_rloo[c, i] + a_c * b_xctx[c, i]
    is a function of the rewards other than r[c, i], and every advantage is exactly unbiased. A weight
    shared by the whole of b[c, :] cannot use any reward of context c (for K = 2, r[c, 1] is excluded
    from b[c, 0] and r[c, 0] from b[c, 1]), hence one context out rather than one rollout out.
    The mean shrunk towards stays b_xctx[c, i], which keeps r[c, j]: like the Bayes posterior mean
    when mu_0 is unknown, it pools the other rollouts of c into the estimate of mu_0, which keeps the
    target closer to mu_c than the mean of the other contexts alone would be.
    Needs B >= 4 (the B >= 3 estimate on B-1 contexts). The price of exactness is a weight fitted on
    B-1 contexts that knows nothing of how far context c lies from them: when contexts differ a lot it
    now and then over-shrinks (a_c is a ratio with few degrees of freedom below, so its tail is heavy;
    the plug-in a grows with the spread context c itself adds, this one cannot). toy_js.py: up to 2.4x
    RLOO's MSE at B = 4, still above RLOO at B = 6-8 once delta^2 >= 3 sigma^2 (>= sigma^2 at K = 8),
    within 10% of the plug-in JS at B = 16 and 32. Prefer it at B >= 16.
    """
    name = "james_stein(unbiased=True)" if unbiased else "james_stein"
    checked = _checked(rewards, name, min_contexts=MIN_CONTEXTS["js-unbiased" if unbiased else "js"])
    return _james_stein(checked, unbiased=unbiased).to(_output_dtype(rewards))


def shrinkage(rewards: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """rewards (B, K) -> the JS weight a on the cross-context mean, for logging: a scalar tensor, or
    (B,) with unbiased=True (a_c, fitted without context c). 0 means pure RLOO, 1 the pooled mean."""
    name = "shrinkage(unbiased=True)" if unbiased else "shrinkage"
    checked = _checked(rewards, name, min_contexts=MIN_CONTEXTS["js-unbiased" if unbiased else "js"])
    weight = _unbiased_shrinkage(checked) if unbiased else _shrinkage(checked)
    return weight.to(_output_dtype(rewards))


BASELINES = {
    "js": james_stein,
    "js-unbiased": partial(james_stein, unbiased=True),
    "rloo": rloo,
    "xctx": cross_context,
}
