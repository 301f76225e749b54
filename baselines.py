"""
Baselines for REINFORCE with K rollouts per context (the paper, Sec. 3): pure functions from a
batch's rewards, (B, K) or (..., B, K) for many batches at once, to a detached baseline b of the
same shape; the trainer's loss is -mean((r - b) * log pi(tau)). A baseline built from the *other*
rewards is a constant for rollout (c, i), so (r - b) * grad log pi stays an unbiased gradient term:
RLOO, XCTX and the unbiased JS are built that way, the plug-in JS nearly so (its weight sees
r[c, i]).

    rloo           b[c, i] = mean of the other K-1 rewards of context c
    cross_context  b[c, i] = mean of the other B*K-1 rewards of the batch
    james_stein    b[c, i] = (1 - a) * rloo + a * cross_context, a estimated from the batch

JS comes from the paper's random-effects model, r[c, i] = mu_c + eps (Var eps = sigma^2, the
rollout noise), mu_c = mu_0 + xi (Var xi = delta^2, how much contexts differ): the posterior mean of
mu_c given the other K-1 rollouts weighs the cross-context mean by
    a = (sigma^2/(K-1)) / (sigma^2/(K-1) + delta^2),
and JS plugs in estimates s2 and d2 from the batch. Thm. 3.2's guarantee (a lower MSE than RLOO's
for B >= 3) is a statement about that model, with the weight's estimates as the theorem takes them;
the plug-in weight, a ratio of two noisy estimates from the same few contexts, can leave it (at few
contexts that differ a lot, `python toy_js.py` measures it above RLOO's MSE). Which reading of the
paper's s2 and d2 is used, and why: docs/DESIGN.md; what each baseline can be worth: docs/BOUND.md.

Arithmetic runs in float64: rewards such as HPSv2 x100 sit near 30 with differences of 0.1, and
the variance estimates subtract nearly equal numbers. Results come back in the rewards' dtype.
"""

import torch

# Contexts per batch each baseline needs: James-Stein estimates a between-context variance from B-1
# degrees of freedom (B >= 3, Thm. 3.2), the unbiased form from the B - 1 other contexts (B >= 4).
MIN_CONTEXTS = {"js": 3, "js-unbiased": 4, "rloo": 1, "xctx": 1}


def _checked(rewards: torch.Tensor, min_contexts: int) -> torch.Tensor:
    """rewards (..., B, K) detached in float64, after the shape checks a caller can get wrong."""
    shape = tuple(rewards.shape)
    if len(shape) < 2 or shape[-1] < 2:
        raise ValueError(f"rewards must have shape (..., contexts, rollouts >= 2), got {shape}")
    if shape[-2] < min_contexts:
        raise ValueError(
            f"this baseline needs at least {min_contexts} contexts per batch, got "
            f"B={shape[-2]}; use more contexts or the rloo baseline"
        )
    return rewards.detach().to(torch.float64)


def _like(baseline: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    return baseline.to(rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype())


def _rloo(values: torch.Tensor) -> torch.Tensor:
    return (values.sum(-1, keepdim=True) - values) / (values.shape[-1] - 1)


def _cross_context(values: torch.Tensor) -> torch.Tensor:
    return (values.sum((-2, -1), keepdim=True) - values) / (values.shape[-2:].numel() - 1)  # B*K-1


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """(..., B, K) -> (..., B, K): b[c, i] = mean_{j != i} r[c, j] (the paper, RLOO)."""
    return _like(_rloo(_checked(rewards, MIN_CONTEXTS["rloo"])), rewards)


def cross_context(rewards: torch.Tensor) -> torch.Tensor:
    """(..., B, K) -> (..., B, K): the mean of every reward of the batch but r[c, i] (XCTX)."""
    return _like(_cross_context(_checked(rewards, MIN_CONTEXTS["xctx"])), rewards)


def js_weight(s2: torch.Tensor, spread: torch.Tensor, rollouts: int) -> torch.Tensor:
    """a = (s2/(K-1)) / (s2/(K-1) + d2), d2 = max(0, spread - s2/K) (the paper, JS); shapes
    (...) -> (...). spread estimates Var rbar_c = delta^2 + sigma^2/K. a = 1 when s2 = d2 = 0
    (every reward equal: all baselines agree and every advantage is 0)."""
    d2 = (spread - s2 / rollouts).clamp(min=0)
    rloo_noise = s2 / (rollouts - 1)  # Var of the RLOO estimate of mu_c
    total = rloo_noise + d2
    return torch.where(total > 0, rloo_noise / total, torch.ones_like(total))


def _statistics(values: torch.Tensor):
    """(..., B) each: within-context variances, squared deviations of rbar_c from the batch mean."""
    means = values.mean(-1)  # (..., B) rbar_c
    variances = (values - means[..., None]).square().sum(-1) / (values.shape[-1] - 1)
    deviations = (means - means.mean(-1, keepdim=True)).square()
    return variances, deviations


def _inflation(contexts: int, rollouts: int) -> float:
    """(BK/(BK-1))^2: the spread around mean_i b_xctx[c, i], as the paper writes d2
    (docs/DESIGN.md): the deviation is (BK/(BK-1)) (rbar_c - rbar)."""
    return (contexts * rollouts / (contexts * rollouts - 1)) ** 2


def shrinkage(rewards: torch.Tensor) -> torch.Tensor:
    """(..., B, K) -> (...): the plug-in weight a of the batch on the cross-context mean (0 is pure
    RLOO, 1 the pooled mean): s2 the pooled within-context variance, 1/(B(K-1)) sum (r[c,i] -
    rbar_c)^2, and d2 as the paper writes it (docs/DESIGN.md)."""
    values = _checked(rewards, MIN_CONTEXTS["js"])
    contexts, rollouts = values.shape[-2:]
    variances, deviations = _statistics(values)
    s2 = variances.mean(-1)  # equal K per context: the pooled variance is a plain mean
    spread = _inflation(contexts, rollouts) * deviations.sum(-1) / (contexts - 1)
    return _like(js_weight(s2, spread, rollouts), rewards)


def shrinkage_leave_one_out(rewards: torch.Tensor) -> torch.Tensor:
    """(..., B, K) -> (..., B): a_c, the plug-in weight of the batch with context c left out. s2
    loses that context's variance, and the sum of squares loses it by the one-point downdate
        sum_{c' != c} (rbar_c' - mean of the others)^2
            = sum_c' (rbar_c' - rbar)^2 - B/(B-1) (rbar_c - rbar)^2."""
    values = _checked(rewards, MIN_CONTEXTS["js-unbiased"])
    contexts, rollouts = values.shape[-2:]
    variances, deviations = _statistics(values)
    s2 = (variances.sum(-1, keepdim=True) - variances) / (contexts - 1)  # (..., B) without c
    squares = deviations.sum(-1, keepdim=True) - contexts / (contexts - 1) * deviations  # (..., B)
    spread = _inflation(contexts - 1, rollouts) * squares / (contexts - 2)
    return _like(js_weight(s2, spread, rollouts), rewards)


def james_stein(rewards: torch.Tensor) -> torch.Tensor:
    """(..., B, K) -> (..., B, K): b = (1 - a) * b_rloo + a * b_xctx (the paper, JS; Thm. 3.2),
    a the plug-in weight of the batch, estimated from all B*K rewards. It depends on r[c, i], so
    the gradient is unbiased only up to O(1/(BK)). Needs B >= 3."""
    values = _checked(rewards, MIN_CONTEXTS["js"])
    weight = shrinkage(values)[..., None, None]  # (..., 1, 1)
    return _like((1 - weight) * _rloo(values) + weight * _cross_context(values), rewards)


def james_stein_unbiased(rewards: torch.Tensor) -> torch.Tensor:
    """(..., B, K) -> (..., B, K): JS with each context's weight a_c fitted without it, which makes
    it exactly unbiased (this project's addition; JSPO, arXiv 2511.03710, computes its James-Stein
    baseline leave one prompt out). The plug-in JS sees r[c, i], the one reward that is a function
    of tau[c, i], only through a; with a_c from the batch without context c,
        b[c, i] = (1 - a_c) * b_rloo[c, i] + a_c * b_xctx[c, i]
    is a function of the other rewards. A weight shared by the whole of b[c, :] cannot use any
    reward of context c (for K = 2, r[c, 1] is excluded from b[c, 0] and r[c, 0] from b[c, 1]),
    hence one context out rather than one rollout out. The price of exactness is a weight fitted on
    B-1 contexts that knows nothing of how far context c lies from them: when contexts differ a lot
    it now and then over-shrinks (a_c is a ratio with few degrees of freedom below, so its tail is
    heavy), which costs at small B; prefer it at B >= 16. Needs B >= 4."""
    values = _checked(rewards, MIN_CONTEXTS["js-unbiased"])
    weight = shrinkage_leave_one_out(values)[..., None]  # (..., B, 1)
    return _like((1 - weight) * _rloo(values) + weight * _cross_context(values), rewards)


BASELINES = {
    "js": james_stein,
    "js-unbiased": james_stein_unbiased,
    "rloo": rloo,
    "xctx": cross_context,
}
