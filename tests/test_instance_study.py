"""evidence/instance_study.py's pieces on cases with a known answer: the oracle searches, the
supervised predictor, and the section's rows."""

import pytest
import torch

from evidence import instance_study
from policy import SchedulePolicy, make_policy, times_from_increments


def targets(count, steps):
    """Strictly decreasing schedules from t_0 = 1, one per context."""
    increments = torch.distributions.Dirichlet(torch.full((steps + 1,), 5.0)).sample((count,))
    return times_from_increments(increments)


def test_the_searches_find_a_known_optimum():
    """objective = -|times - target_c|^2: each context's own search reaches its target, and the
    best single schedule for all reaches their mean (the minimiser of the mean squared distance)."""
    torch.manual_seed(0)
    goal = targets(12, 3)

    def objective(index, times):
        return -(times - goal[index]).square().sum(-1)

    start = torch.linspace(1.0, 0.0, 4)
    own = next(instance_study.best_each(objective, start.expand(12, -1), iterations=300))
    assert (own - goal).abs().max() < 0.01
    single = next(instance_study.best_single(objective, 12, start, 300, batch=12, seed=0))
    assert (single - goal.mean(0)).abs().max() < 0.01


def test_a_continued_search_is_the_search_run_twice_as_long():
    """The convergence checks continue a fit and the searches: N iterations, then N more, give
    what 2N in one go give (the Adam state and the batch stream carried on)."""
    torch.manual_seed(0)
    goal = targets(200, 3)  # two batches of contexts for each context's own search

    def objective(index, times):
        return -(times - goal[index]).square().sum(-1).sqrt()

    start = torch.linspace(1.0, 0.0, 4)
    for search in (
        lambda n: instance_study.best_single(objective, 200, start, n, batch=16, seed=0),
        lambda n: instance_study.best_each(objective, start.expand(200, -1), n),
    ):
        halves = search(7)
        first, continued = next(halves), next(halves)
        once = next(search(14))
        assert not torch.allclose(first, once, atol=1e-4)  # the second half moved it
        torch.testing.assert_close(continued, once)


def test_the_supervised_predictor_learns_a_schedule_the_noise_determines():
    """Targets set by the sign of the noise's mean (two schedules): fitted on 256 contexts, the
    predictor's mean schedule on 128 others is within 0.05 of each one's target, where a predictor
    blind to the noise could at best give their midpoint (0.1 away)."""
    torch.manual_seed(0)
    count, steps = 384, 2
    latent = torch.randn(count, 1, 8, 8)
    sign = latent.mean((1, 2, 3)) > 0
    early, late = torch.tensor([1.0, 0.7, 0.2]), torch.tensor([1.0, 0.5, 0.2])
    goal = torch.where(sign[:, None], early, late)
    text, mask = torch.zeros(count, 4, 32), torch.ones(count, 4, dtype=torch.bool)
    inputs = dict(latent=latent, text=text, text_mask=mask, pooled=torch.zeros(count, 32))
    part = {key: value[:256] for key, value in inputs.items()}
    held = {key: value[256:] for key, value in inputs.items()}
    dims = dict(latent_channels=1, text_dim=32, pooled_dim=32)
    policy = make_policy(SchedulePolicy, dims, steps, torch.tensor([1.0, 0.6, 0.2]))
    instance_study.fit_predictor(policy, part, goal[:256], held, goal[256:], seed=0)
    with torch.no_grad():
        alpha = policy(**held)
    predicted = times_from_increments(alpha / alpha.sum(-1, keepdim=True))
    assert (predicted - goal[256:])[:, 1].abs().mean() < 0.05


def row(reward):
    """A cell's row: the mean reward per context, its schedules and Frechet distance."""
    return dict(reward=reward, times=[[1.0, 0.5, 0.0]] * len(reward), frechet=1.0)


def test_a_cell_states_each_rows_gain_over_the_best_single_schedule_and_share_of_the_gap():
    rows = {
        "default": row([0.0, 0.0]),
        "best single schedule": row([1.0, 2.0]),
        "per-context best schedule": row([2.0, 3.0]),
        "supervised (noise and prompt), 64 contexts, seed 0": row([1.5, 2.5]),
        "supervised (noise and prompt), 64 contexts, seed 1": row([1.5, 2.5]),
        "supervised (noise and prompt), 256 contexts, seed 0": row([1.2, 2.2]),
        "supervised (constant inputs), 256 contexts, seed 0": row([1.0, 2.0]),
    }
    text = "\n".join(instance_study.cell_lines("mini-sd3", 2, rows, [0.1, 0.1]))
    assert "| best single schedule | 1.500 | +0.000 ± 0.000 | +0% | 1.000 |" in text
    assert "| per-context best schedule | 2.500 | +1.000 ± 0.000 | +100% | 1.000 |" in text
    # two seeds are one row: their mean, their range, half the gap
    assert "| supervised (noise and prompt), 64 contexts | 2.000 (2.000 to 2.000) | +0.500" in text
    assert "+50% |" in text and "| default | 0.000 | -1.500 ± 6.353 | -150% |" in text
    assert "continued to twice its iterations adds +0.100 ± 0.000 on its 2 contexts (+10%" in text
    assert "learnable share, noise and prompt: supervised minus the same fit on constant " in text
    assert "inputs, +0.200 ± 0.000 (+20% of the gap)" in text
    assert "- the best single schedule against its checks" not in text  # no check in the rows


def test_a_cell_pairs_a_partial_row_and_says_when_a_check_beats_the_best_single_schedule():
    rows = {
        "best single schedule": row([1.0, 2.0, 7.0]),
        "per-context best schedule": dict(row([2.0, 3.0]), **{"single frechet": 0.5}),
        "best single schedule, twice the iterations": row([1.0, 2.1, 6.9]),
    }
    text = "\n".join(instance_study.cell_lines("mini-sd3", 2, rows, [0.1]))
    assert "| best single schedule | 3.333 | +0.000 ± 0.000 | +0% | 1.000 |" in text
    row_line = "| per-context best schedule, first 2 contexts | 2.500 | +1.000 ± 0.000 | +100% | "
    assert row_line + "1.000 (best single schedule 0.500) |" in text
    assert "checks (best single schedule, twice the iterations +0.000 ± 0.248): none" in text
    rows["REINFORCE global, seed 0"] = row([1.5, 2.5, 7.5])  # above by 0.5 at every context
    text = "\n".join(instance_study.cell_lines("mini-sd3", 2, rows, [0.1]))
    assert "REINFORCE global +0.500 ± 0.000): not found: REINFORCE global above it" in text
    assert "the gap is no bound" in text
    starts = {"best shift": 1.0, "uniform": 0.5, "REINFORCE global, seed 0": 2.0}
    text = "\n".join(instance_study.cell_lines("mini-sd3", 2, rows, [0.1], starts))
    assert "starts, mean reward on training contexts: best shift 1.000, uniform 0.500, " in text


@pytest.mark.parametrize("steps", [2, 3])
def test_logits_start_from_pure_noise_with_a_stop_margin(steps):
    default = torch.linspace(0.9, 0.0, steps + 1)  # SD-XL's starts below 1, ends at 0
    times = instance_study.times_of(instance_study.logits_of(default))
    margin = instance_study.STOP_MARGIN  # raised, then the increments renormalised
    assert times[0] == 1.0 and times[-1] >= margin / (1 + margin) - 1e-7
    assert (times[1:] < times[:-1]).all()
