"""
Baselines for REINFORCE with K rollouts per context (the paper, Sec. 3).

A batch holds B contexts (prompt + initial noise) with K sampled schedules each; its rewards are a
tensor of shape (B, K), or (..., B, K) for many independent batches at once (toy_js.py simulates
thousands). Every estimator returns a detached baseline b of the same shape, and the trainer's loss
is -mean((r - b) * log pi(tau)). The K rollouts of a context are independent given the context, so a
baseline b[c, i] built from the *other* rewards is a constant as far as rollout (c, i) is concerned
and (r - b) * grad log pi stays an unbiased gradient term. RLOO, XCTX and the unbiased JS are built
that way; the plug-in JS nearly so (its weight a sees r[c, i], see below).

    rloo           b[c, i] = mean of the other K-1 rewards of context c
    cross_context  b[c, i] = mean of the other B*K-1 rewards of the batch
    james_stein    b[c, i] = (1 - a) * rloo + a * cross_context, a estimated from the batch

James-Stein comes from the random-effects model r[c, i] = mu_c + eps (Var eps = sigma^2, the rollout
noise), mu_c = mu_0 + xi (Var xi = delta^2, how much contexts differ). The variance-optimal baseline
of a near-deterministic policy is about mu_c (Prop. 3.1). RLOO estimates it without bias but with
variance sigma^2/(K-1); the cross-context mean has little variance but is off by mu_c - mu_0. The
posterior mean of mu_c given the other K-1 rollouts mixes the two with the weight
a = (sigma^2/(K-1)) / (sigma^2/(K-1) + delta^2); JS plugs in estimates of sigma^2 and delta^2 from
the batch (empirical Bayes), which Thm. 3.2 shows beats RLOO in mean squared error for B >= 3.
The plug-in estimate of a is noisy with few contexts, which is where that guarantee is weakest
(toy_js.py measures by how much).

That plug-in weight uses every reward of the batch, r[c, i] included, so the plain JS gradient is
biased by O(1/(BK)). `james_stein(rewards, unbiased=True)` fits the weight of context c on the other
B-1 contexts only (leave one context out), which removes the bias exactly.

Arithmetic runs in float64: rewards such as HPSv2 x100 sit near 30 with differences of 0.1, and the
variance estimates subtract nearly equal numbers. Results come back in the rewards' dtype.
"""

from functools import partial

import torch

# Contexts per batch each baseline needs: James-Stein estimates a between-context variance from B - 1
# degrees of freedom (B >= 3, Thm. 3.2), the unbiased form from the B - 1 other contexts (B >= 4).
MIN_CONTEXTS = {"js": 3, "js-unbiased": 4, "rloo": 1, "xctx": 1}


def _float64(rewards: torch.Tensor, min_contexts: int) -> torch.Tensor:
    """The shape checks a caller can get wrong; rewards (..., B, K) detached in float64."""
    if rewards.dim() < 2 or rewards.shape[-1] < 2:
        raise ValueError(f"rewards must have shape (..., contexts, rollouts >= 2), got {tuple(rewards.shape)}")
    if rewards.shape[-2] < min_contexts:
        raise ValueError(f"this baseline needs at least {min_contexts} contexts per batch, got B={rewards.shape[-2]}; "
                         "use more contexts or the rloo baseline")
    return rewards.detach().to(torch.float64)


def _same_dtype(baseline: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    return baseline.to(rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype())


def _rloo(values: torch.Tensor) -> torch.Tensor:
    return (values.sum(-1, keepdim=True) - values) / (values.shape[-1] - 1)


def _cross_context(values: torch.Tensor) -> torch.Tensor:
    contexts, rollouts = values.shape[-2:]
    return (values.sum((-2, -1), keepdim=True) - values) / (contexts * rollouts - 1)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """(..., B, K) -> (..., B, K): b[c, i] = mean_{j != i} r[c, j] (the paper, RLOO)."""
    return _same_dtype(_rloo(_float64(rewards, MIN_CONTEXTS["rloo"])), rewards)


def cross_context(rewards: torch.Tensor) -> torch.Tensor:
    """(..., B, K) -> (..., B, K): b[c, i] = mean of all rewards of the batch but r[c, i] (the paper, XCTX)."""
    return _same_dtype(_cross_context(_float64(rewards, MIN_CONTEXTS["xctx"])), rewards)


def _weight(within: torch.Tensor, squares: torch.Tensor, contexts: int, rollouts: int) -> torch.Tensor:
    """The James-Stein weight a from two batch statistics (the paper, JS), shapes (...) -> (...).

    within  = s2, the pooled unbiased within-context variance (the estimate of sigma^2),
    squares = sum_c (rbar_c - rbar)^2 over the `contexts` contexts used.
    a = (s2/(K-1)) / (s2/(K-1) + d2),  d2 = max(0, 1/(B-1) * sum_c (rbar_c - mean_i b_xctx[c, i])^2 - s2/K).
    The paper takes each deviation from mean_i b_xctx[c, i] = (B*K*rbar - rbar_c) / (B*K - 1), and
    rbar_c minus that is B*K/(B*K-1) * (rbar_c - rbar): the textbook spread times (BK/(BK-1))^2, so d2
    leans large and a leans towards RLOO. We keep the paper's form.
    a = 1 when s2 = d2 = 0 (every reward equal: all baselines agree and every advantage is 0).
    """
    inflation = (contexts * rollouts / (contexts * rollouts - 1)) ** 2
    spread = inflation * squares / (contexts - 1)  # estimates Var rbar_c = delta^2 + sigma^2/K
    between = (spread - within / rollouts).clamp(min=0)  # d2
    rloo_noise = within / (rollouts - 1)  # Var of the RLOO estimate of mu_c
    total = rloo_noise + between
    return torch.where(total > 0, rloo_noise / total, torch.ones_like(total))


def shrinkage(rewards: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """(..., B, K) -> the weight a on the cross-context mean: (...), or (..., B) with unbiased=True.

    0 means pure RLOO, 1 the pooled mean. unbiased=True gives a_c, the plug-in weight of the batch with
    context c left out: s2 loses that context's variance, and the sum of squares loses it by the
    one-point downdate sum_{c' != c} (rbar_c' - mean of the others)^2 = sum_c' (rbar_c' - rbar)^2
    - B/(B-1) * (rbar_c - rbar)^2.
    """
    values = _float64(rewards, MIN_CONTEXTS["js-unbiased" if unbiased else "js"])
    contexts, rollouts = values.shape[-2:]
    means = values.mean(-1)  # (..., B) rbar_c
    variances = (values - means[..., None]).square().sum(-1) / (rollouts - 1)  # (..., B) within each context
    deviations = (means - means.mean(-1, keepdim=True)).square()  # (..., B)
    if not unbiased:  # equal K per context makes the pooled variance a plain mean
        return _same_dtype(_weight(variances.mean(-1), deviations.sum(-1), contexts, rollouts), rewards)
    within = (variances.sum(-1, keepdim=True) - variances) / (contexts - 1)  # (..., B) s2 without c
    squares = deviations.sum(-1, keepdim=True) - contexts / (contexts - 1) * deviations  # (..., B)
    return _same_dtype(_weight(within, squares, contexts - 1, rollouts), rewards)


def james_stein(rewards: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """(..., B, K) -> (..., B, K): b = (1 - a) * b_rloo + a * b_xctx (the paper, JS; Thm. 3.2).

    unbiased=False: a is the paper's plug-in weight, one per batch, estimated from all B*K rewards.
    It depends on r[c, i], so the gradient is unbiased only up to O(1/(BK)). Needs B >= 3.

    unbiased=True: leave one context out, as the paper suggests. Unbiasedness needs exactly one thing:
    b[c, i] must not depend on r[c, i], the one reward that is a function of tau[c, i]. b_rloo and
    b_xctx already leave r[c, i] out; the plug-in JS breaks the rule only through a. So each context
    gets its own weight a_c, fitted on the batch without context c, and
        b[c, i] = (1 - a_c) * b_rloo[c, i] + a_c * b_xctx[c, i]
    is a function of the rewards other than r[c, i]. A weight shared by the whole of b[c, :] cannot
    use any reward of context c (for K = 2, r[c, 1] is excluded from b[c, 0] and r[c, 0] from b[c, 1]),
    hence one context out rather than one rollout out. The mean shrunk towards stays b_xctx[c, i],
    which keeps r[c, j]: like the Bayes posterior mean when mu_0 is unknown, it pools the other
    rollouts of c into the estimate of mu_0. Needs B >= 4. The price of exactness is a weight fitted on
    B-1 contexts that knows nothing of how far context c lies from them: when contexts differ a lot it
    now and then over-shrinks (a_c is a ratio with few degrees of freedom below, so its tail is
    heavy), which costs at small B; prefer it at B >= 16.
    """
    values = _float64(rewards, MIN_CONTEXTS["js-unbiased" if unbiased else "js"])
    weight = shrinkage(values, unbiased)
    weight = weight[..., None] if unbiased else weight[..., None, None]  # (..., B, 1) or (..., 1, 1)
    return _same_dtype((1 - weight) * _rloo(values) + weight * _cross_context(values), rewards)


BASELINES = {
    "js": james_stein,
    "js-unbiased": partial(james_stein, unbiased=True),
    "rloo": rloo,
    "xctx": cross_context,
}
