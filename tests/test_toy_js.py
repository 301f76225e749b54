import contextlib
import io
import json
import math
import runpy
import sys
from itertools import product

import matplotlib.image
import pytest
import torch
from torch.distributions import Dirichlet

from baselines import james_stein, james_stein_unbiased, rloo
from toy_js import CONTEXTS, RATIOS, ROLLOUTS, Bandit, expected_quality, oracle_baseline


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """python -m evidence.toy_js at toy_js's --quick settings (the same code path, a few seconds) in
    a fresh folder, what it would record in docs/RESULTS.md caught: (out dir, what it printed, the
    record calls, toy_js.json)."""
    import toy_js
    from evidence import results

    folder, recorded, threads = tmp_path_factory.mktemp("toy_js"), [], torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as out:
        patch.setattr(toy_js, "FULL", toy_js.QUICK)
        patch.setattr(results, "record", lambda *args, **kwargs: recorded.append(args))
        patch.setattr(sys, "argv", ["evidence.toy_js"])
        patch.chdir(folder)
        runpy.run_module("evidence.toy_js", run_name="__main__")
    torch.set_num_threads(threads)
    out_dir = folder / "out" / "toy_js"
    return out_dir, out.getvalue(), recorded, json.loads((out_dir / "toy_js.json").read_text())


def test_the_evidence_command_records_what_toy_js_prints_and_saves(quick_run):
    out_dir, stdout, recorded, record = quick_run
    [(name, command, lines)] = recorded
    assert (name, command) == ("toy_js", "python -m evidence.toy_js")
    assert stdout.startswith("\n".join(lines) + "\n") and "Conclusions:" in lines
    assert all(f"Part {part}" in stdout for part in "AB")
    assert "docs/RESULTS.md (section toy_js)" in stdout.splitlines()[-1]
    assert matplotlib.image.imread(out_dir / "toy_js.png").shape[0] > 300
    for line in record["conclusions"]:
        assert line.strip() in stdout  # what is printed is what is saved


def test_quick_run_estimation_and_gradient_tables(quick_run):
    record = quick_run[-1]
    cells = record["estimation"]
    assert len(cells) == len(RATIOS) * len(ROLLOUTS) * len(CONTEXTS) == 72
    assert {(cell["K"], cell["B"]) for cell in cells} == set(product((2, 4, 8), (4, 16, 32)))
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
    assert list(record["gradient"]) == ["0.0", "1.0", "10.0"]
    for row in record["gradient"].values():
        assert set(row) == {"none", "rloo", "xctx", "js", "js-unbiased"}
    widest = record["gradient"]["10.0"]  # offsets 10x the rollout noise: no baseline is hopeless
    assert widest["none"][0] > 10 * widest["rloo"][0] and widest["xctx"][0] > 10 * widest["rloo"][0]


# -----------------------------------------------------------------------------
# the pieces the tables rest on


def test_oracle_is_a_floor_for_james_stein():
    # paired over 20000 simulated batches (B = 4, K = 2, delta^2/sigma^2 = 0.3): the oracle's mean
    # squared error is below JS's by more than 4 standard errors of the paired difference
    generator = torch.Generator().manual_seed(1)
    means = math.sqrt(0.3) * torch.randn((20000, 4, 1), generator=generator, dtype=torch.float64)
    rewards = means + torch.randn((20000, 4, 2), generator=generator, dtype=torch.float64)
    oracle = (oracle_baseline(rewards, 1.0, 0.3) - means).square().mean(dim=(1, 2))
    difference = oracle - (james_stein(rewards) - means).square().mean(dim=(1, 2))
    assert difference.mean() + 4 * difference.std() / math.sqrt(20000) < 0


def test_expected_quality_matches_monte_carlo():
    # 200000 draws: the Monte Carlo mean is within 5 standard errors of the closed form
    alpha = torch.tensor([[2.0, 0.5, 3.0, 1.0, 4.0], [0.3] * 5], dtype=torch.float64)
    logits = [[1.0, 0.0, -1.0, 0.5, 0.2], [0.0, 2.0, 0.0, 0.0, 0.0]]
    target = torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=-1)
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
    weight = weight + 0.3 * torch.randn(weight.shape[1:], generator=generator, dtype=weight.dtype)
    parameters = (weight.requires_grad_(True), bias.requires_grad_(True))

    def gradient(objective):  # (R, P), one row per batch
        gradients = torch.autograd.grad(objective, parameters, retain_graph=True)
        return torch.cat([g.flatten(1) for g in gradients], dim=1)

    features, targets, offsets, scales = bandit.draw((batches, contexts), 3.0, generator)
    alpha = bandit.alpha(weight, bias, features)
    quality = offsets + scales * expected_quality(alpha, targets) / bandit.noise_unit
    exact = gradient(quality.mean(dim=-1).sum())
    tau = Dirichlet(alpha.detach()).sample((2,)).movedim(0, -2)
    rewards = bandit.rewards(tau, targets, offsets, scales)
    baseline = rloo(rewards) if name == "rloo" else james_stein_unbiased(rewards)
    log_prob = Dirichlet(alpha[..., None, :]).log_prob(tau)
    difference = gradient(((rewards - baseline) * log_prob).mean(dim=(-2, -1)).sum()) - exact
    error = difference.std(dim=0) / math.sqrt(batches)
    assert (difference.mean(dim=0).abs() < 5 * error).all()
    # the gradient itself is resolved, so the test can fail
    assert (exact.mean(dim=0).abs() > 5 * error).any()
