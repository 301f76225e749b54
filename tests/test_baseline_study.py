"""baseline_study.py's measurements of Theorem 3.2 on cases with a known answer, and what it relies
on from training: the snapshots of evidence.results.train_here."""

import math
import os

import torch
import torch.nn.functional as F

from backbones import mixture
from baselines import BASELINES
from evaluate import load_policy
from evidence import baseline_study
from evidence.results import train_here


def test_baseline_errors_match_the_random_effects_model():
    """The paper's model r[c, i] = mu_c + eps, mu_c ~ N(0, delta^2), eps ~ N(0, sigma^2), and
    E (b - mu_c)^2 in closed form: RLOO sigma^2/(K-1); the cross-context mean
    K^2 B (B-1) delta^2/(BK-1)^2 + sigma^2/(BK-1) (its K B - K rewards of other contexts are off by
    their mu_c' - mu_c, its K-1 of its own are not). The measured values, per set of contexts, are
    independent across sets: each mean must lie within 4 standard errors of its known value. James-
    Stein must be below RLOO (Thm. 3.2, B >= 3) by far more than that."""
    contexts, rollouts, between, within = 4, 2, 0.5, 1.0
    generator = torch.Generator().manual_seed(0)

    def one_set():  # the errors on one set of fresh contexts, 12 rewards each
        means = math.sqrt(between) * torch.randn(1, contexts, 1, generator=generator)
        pool = means + math.sqrt(within) * torch.randn(1, contexts, 12, generator=generator)
        return baseline_study.baseline_errors(pool, contexts, rollouts, 20, generator)

    per_set = [one_set() for _ in range(400)]
    samples = contexts * rollouts
    known = {
        "rloo": within / (rollouts - 1),
        "xctx": rollouts**2 * contexts * (contexts - 1) * between / (samples - 1) ** 2
        + within / (samples - 1),
    }
    for name, value in known.items():
        values = torch.tensor([errors[name] for errors in per_set], dtype=torch.float64)
        error = values.std().item() / math.sqrt(len(values))
        assert abs(values.mean().item() - value) < 4 * error, (name, values.mean().item(), value)
    js = torch.tensor([errors["js"] for errors in per_set]).mean().item()
    assert js < 0.8 * known["rloo"]


def test_baseline_errors_subtract_the_truths_own_noise():
    """Rewards that are exactly the context's mean: every leave-one-out estimate is then exact, so
    every error must be 0 up to rounding, whatever the pool's size."""
    generator = torch.Generator().manual_seed(1)
    pool = torch.randn(2, 6, 1).expand(2, 6, 5).contiguous()
    errors = baseline_study.baseline_errors(pool, 6, 2, 10, generator)
    assert abs(errors["rloo"]) < 1e-12 and abs(errors["js"]) < 1e-12
    assert errors["xctx"] > 0.1  # the cross-context mean is off by the other contexts' means


def test_gradient_statistics_of_known_gaussian_gradients():
    """Gradients g0 + N(0, s^2 I) over N batches: the variance (the trace of the covariance) is
    P s^2, estimated with standard error s^2 sqrt(2P/(N-1)); with |g0|^2 = P s^2 the cosine of one
    batch to the pooled mean of the others is 1/sqrt(2) up to that mean's own noise (s^2/(3(N-1))
    per coordinate: a factor 1/sqrt(1 + 1/(3(N-1)))), within 0.02 (5 standard errors of a mean of N
    cosines whose spread is about 0.07 at P = 50)."""
    count, size, scale = 400, 50, 0.5
    generator = torch.Generator().manual_seed(2)
    direction = torch.randn(size, generator=generator)
    g0 = direction / direction.norm() * math.sqrt(size) * scale
    gradients = {
        name: g0 + scale * torch.randn(count, size, generator=generator) for name in BASELINES
    }
    gradients["xctx"] = g0 + 3 * scale * torch.randn(count, size, generator=generator)
    result = baseline_study.gradient_statistics(gradients)
    error = scale**2 * math.sqrt(2 * size / (count - 1))
    assert abs(result["rloo"][0] - size * scale**2) < 4 * error
    assert abs(result["xctx"][0] - 9 * size * scale**2) < 4 * 9 * error
    # xctx is 9x noisier: the inverse-variance mix of the unbiased three hardly uses it
    pooled_noise = 1 / (1 + 1 + 1 / 9) / (count - 1)  # the reference's variance, per s^2
    cosine = 1 / math.sqrt(2) / math.sqrt(1 + pooled_noise)
    assert abs(result["rloo"][1] - cosine) < 0.02
    assert result["xctx"][1] < result["rloo"][1] - 0.2


def global_batch(logits, reward, generator):
    """batch_gradients of alpha (4, L+1) = softplus(logits) + 1 for every context, a policy with a
    known gradient, at 2 rollouts per context."""

    def alpha():
        return (F.softplus(logits) + 1).expand(4, -1)

    return baseline_study.batch_gradients(alpha, reward, [logits], 2, generator)


def test_batch_gradients_are_zero_for_rloo_when_the_reward_ignores_the_schedule():
    """r[c, i] = mu_c: RLOO's advantages are exactly 0, the cross-context mean's are not."""
    logits = torch.zeros(4, requires_grad=True)
    means = torch.tensor([[-3.0], [0.0], [1.0], [5.0]])
    generator = torch.Generator().manual_seed(3)
    gradients, rewards = global_batch(logits, lambda tau: means.expand(4, tau.shape[1]), generator)
    assert torch.equal(gradients["rloo"], torch.zeros(4))
    assert gradients["xctx"].abs().sum() > 0
    assert rewards.shape == (4, 2)


def test_batch_gradients_average_to_the_true_gradient():
    """r = w . tau + mu_c: the objective is w . E[tau] = w . alpha / sum(alpha), whose gradient
    autograd gives exactly. Each exactly unbiased baseline's mean over 3,000 batches must lie within
    4 standard errors (per coordinate, from the batches' spread) of minus that gradient (the loss
    is -J)."""
    logits = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    weights, means = torch.tensor([2.0, -1.0, 0.5]), torch.tensor([[-2.0], [0.0], [1.0], [4.0]])
    alpha = F.softplus(logits) + 1
    (true,) = torch.autograd.grad(-(weights * alpha / alpha.sum()).sum(), logits)
    generator = torch.Generator().manual_seed(4)
    batches = {name: [] for name in BASELINES}
    for _ in range(3000):
        gradients, _ = global_batch(logits, lambda tau: tau @ weights + means, generator)
        for name, value in gradients.items():
            batches[name].append(value)
    for name in baseline_study.UNBIASED:
        values = torch.stack(batches[name]).double()
        error = values.std(0) / math.sqrt(len(values))
        assert ((values.mean(0) - true).abs() < 4 * error).all(), name


def test_snapshots_keep_the_policy_at_the_start_and_at_each_checkpoint(tmp_path, monkeypatch):
    """train_here's "--snapshots" keeps the policy at iteration 0 and at each checkpoint in
    <out_dir>-snapshots, as load_policy reads it; the last is the run's final policy."""
    monkeypatch.setattr(mixture.MixtureBackbone, "reference_steps", 16)  # as conftest's runs
    out = str(tmp_path / "out")
    arguments = ["--iterations", "2", "--contexts", "8", "--eval-contexts", "4", "--ckpt-interval"]
    train_here(out, [*arguments, "1", "--snapshots"])
    folder = tmp_path / "out-snapshots"
    names = sorted(os.listdir(folder))
    assert names == ["policy-0.pt", "policy-1.pt", "policy-2.pt"]
    loaded = [load_policy(str(folder / name)) for name in names]
    assert [config["iteration"] for _, config in loaded] == [0, 1, 2]
    assert not torch.equal(loaded[0][0].head[3].bias, loaded[2][0].head[3].bias)
    final, _ = load_policy(os.path.join(out, "ckpt.pt"))
    assert all(torch.equal(v, final.state_dict()[k]) for k, v in loaded[2][0].state_dict().items())


def eval_report(mean):
    return {"rows": [{"method": "learned (mean)", "mean": mean}]}, []


def test_a_cell_detects_only_where_doubling_the_batch_gains_beyond_its_interval():
    means = (1.0, 2.0, 3.0, 4.0, 5.0)
    rloo = [eval_report(m) for m in means]
    # paired differences 0.9-1.1: mean 1.0, half-width 2.776 * 0.0707 = 0.196, clear of 0
    gains = [eval_report(m + d) for m, d in zip(means, (0.9, 1.1, 1.0, 1.0, 1.0))]
    assert baseline_study.detects({"rloo": rloo, baseline_study.DOUBLED: gains}).startswith("yes")
    # differences -1, 1, -1, 1, 0.5: mean 0.1, the interval reaches below 0
    noisy = [eval_report(m + d) for m, d in zip(means, (-1, 1, -1, 1, 0.5))]
    assert baseline_study.detects({"rloo": rloo, baseline_study.DOUBLED: noisy}).startswith("no")
