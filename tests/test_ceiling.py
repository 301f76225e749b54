"""evidence/ceiling.py on a toy objective with a known answer: the jobs and the section find each
context's optimum where the prompt sets it, and the decision rule on hand-made rows."""

import argparse
import math
import time

import pytest
import torch

from evidence import ceiling
from rollout import Backbone

STEPS, WEIGHT, DELTA = 2, 10.0, 0.02  # L; the reward's weight; the distance each run must reach
PROMPTS = [f"a handwritten {digit}" for digit in range(10)]


class Toy(Backbone):
    """What the trainer reads of a backbone: 8x8 noise and a prompt embedding per digit."""

    name, device, latent_shape = "toy", torch.device("cpu"), (1, 8, 8)
    policy_dims = dict(latent_channels=1, text_dim=8, pooled_dim=8)
    table = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))

    def default_times(self, steps):
        return torch.linspace(1.0, 0.0, steps + 1)

    def encode_prompts(self, prompts):
        rows = self.table[[ceiling.digit_of(prompt) for prompt in prompts]]
        mask = torch.ones(len(prompts), 2, dtype=torch.bool)
        return dict(prompt_embeds=rows[:, None].expand(-1, 2, -1), text_mask=mask,
                    pooled_prompt_embeds=rows)  # fmt: skip


class Squared:
    """-WEIGHT x |times - target|^2, the target of each context by its digit (10, L+1): its
    optimum is 0 for every context; reward() as objective(), without gradients."""

    def __init__(self, targets):
        self.targets = targets

    def objective(self, contexts, times):
        return -WEIGHT * (times - self.targets[contexts.digits]).square().sum(-1)

    @torch.no_grad()
    def reward(self, contexts, times):
        return self.objective(contexts, times)


def contexts(count, seed):
    return next(ceiling.fresh_contexts(Toy(), PROMPTS, count, seed))


EARLY, LATE = torch.tensor([1.0, 0.7, 0.3]), torch.tensor([1.0, 0.4, 0.1])


def test_the_ceiling_finds_an_optimum_the_prompt_sets(tmp_path, monkeypatch):
    """Digits 0-4 want EARLY, 5-9 LATE. The oracle's best single schedule is their midpoint (its
    reward -WEIGHT |EARLY - LATE|^2 / 4 = -0.325 for every context) and each context's own search
    reaches 0, a gap of 0.325 that the noise does not touch (the perturbations keep all of it),
    that other contexts' schedules lose and the schedules' mean keeps none of; the instance
    network reaches each context's optimum within WEIGHT L DELTA^2 = 0.008, its global twin and
    its average stay at the best single schedule's reward, and the verdict: the ceiling gains."""
    targets = torch.stack([EARLY] * 5 + [LATE] * 5)
    sets = dict(prompts=PROMPTS, training=contexts(256, 3), validation=contexts(64, 1))
    sets.update(heldout=contexts(128, 2))
    monkeypatch.setattr(ceiling, "load", lambda name: (Toy(), Squared(targets), sets))
    args = argparse.Namespace(out_dir=str(tmp_path), batch=32, iterations=100, lr=1e-2, jobs=1)
    args.seeds, bound = [0], WEIGHT * STEPS * DELTA**2
    found = ceiling.oracle(args, "digits", STEPS)
    middle = targets[sets["training"].digits].mean(0)  # the best single schedule there
    assert (torch.tensor(found["single"]) - middle).abs().max() < 0.03  # Adam at lr 0.1 jitters
    gain = {row: torch.tensor(values).mean().item() for row, values in found["rows"].items()}
    single = torch.tensor(found["single_heldout"])  # about -0.325 (digits are not balanced)
    assert gain["own context"] == pytest.approx(-single[: ceiling.SEARCHED].mean(), abs=bound)
    for e in ceiling.NOISE_LEVELS:
        assert gain[f"noise perturbed, e = {e}"] == gain["own context"]
    assert gain["their mean as one schedule"] == pytest.approx(0, abs=bound)
    # another context's schedule: +0.325 where its target is the same, -0.975 where not
    assert gain["given to other contexts"] < 0
    trained = {}
    for kind in ceiling.KINDS:
        job = ceiling.training(args, "digits", STEPS, kind, 0, found["single"])
        trained["digits", STEPS, kind, 0] = job
        assert not job["read"] and ceiling.training(args, "digits", STEPS, kind, 0, None)["read"]
    reward = {row: torch.tensor(values["reward"]).mean().item()
              for job in trained.values() for row, values in job["rows"].items()}  # fmt: skip
    assert reward["instance"] > -bound
    for row in ("global", "average"):
        assert reward[row] == pytest.approx(single.mean(), abs=0.02)
    lines = ceiling.report(args, {("digits", STEPS): found}, trained, "abc", time.time())
    assert lines[0].startswith("The rule")
    assert any(line.startswith(f"Verdict: {ceiling.GAINS}. Beyond the rule: ") for line in lines)


def row(mean, half, gap=0.4):
    return dict(backbone="mini-sd3", steps=3, seed=0, contrast="instance - global", mean=mean,
                half=half, gap=gap)  # fmt: skip


def test_the_verdict_applies_the_rule():
    """Every row below 0.05 with its upper bound below 25% of its gap: no gain; one row above
    either, or without an interval: the ceiling gains, that row named."""
    quiet = [row(0.01, 0.02), row(-0.05, 0.1), row(0.0, 0.005, gap=0.1)]
    assert ceiling.verdict(quiet) == (ceiling.NO_GAIN, [])
    for broken in (row(0.06, 0.01), row(0.04, 0.07), row(0.01, 0.03, gap=0.1), row(0, math.nan)):
        assert ceiling.verdict(quiet + [broken]) == (ceiling.GAINS, [broken])
    with pytest.raises(ValueError):
        ceiling.verdict([])
