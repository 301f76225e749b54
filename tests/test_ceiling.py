"""evidence/ceiling.py on toy objectives with a known answer: the jobs and the section find each
context's optimum where the prompt sets it, a positive control's where the noise sets it, and the
rules on hand-made rows."""

import argparse
import math

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
    optimum is 0 for every context; reward() as objective(), without gradients. At weight 0, a
    reward that no schedule changes."""

    def __init__(self, targets, weight=WEIGHT):
        self.targets, self.weight = targets, weight

    def objective(self, contexts, times):
        return -self.weight * (times - self.targets[contexts.digits]).square().sum(-1)

    @torch.no_grad()
    def reward(self, contexts, times):
        return self.objective(contexts, times)


def contexts(count, seed):
    return next(ceiling.fresh_contexts(Toy(), PROMPTS, count, seed))


EARLY, LATE = torch.tensor([1.0, 0.7, 0.3]), torch.tensor([1.0, 0.4, 0.1])


def test_the_ceiling_finds_an_optimum_the_prompt_sets(tmp_path, monkeypatch):
    """Digits 0-4 want EARLY, 5-9 LATE. The oracle's best single schedule is their midpoint (its
    reward -WEIGHT |EARLY - LATE|^2 / 4 = -0.325 for every context) and each context's own search
    reaches 0, a gap of 0.325 that the noise does not touch (perturbed or split, all of it kept),
    that other contexts' schedules lose and the schedules' mean keeps none of; the instance
    network reaches each context's optimum within WEIGHT L DELTA^2 = 0.008, its global twin and
    its average stay at the best single schedule's reward, and the verdict: the ceiling gains."""
    targets = torch.stack([EARLY] * 5 + [LATE] * 5)
    sets = dict(prompts=PROMPTS, training=contexts(256, 3), validation=contexts(64, 1),
                heldout=contexts(128, 2))  # fmt: skip
    monkeypatch.setattr(ceiling, "load", lambda name: (Toy(), Squared(targets), sets))
    args = argparse.Namespace(out_dir=str(tmp_path), batch=32, iterations=100, lr=1e-2, jobs=1)
    args.seeds, args.control_seeds, bound = [0], [0], WEIGHT * STEPS * DELTA**2
    found = ceiling.oracle(args, "digits", STEPS)
    middle = targets[sets["training"].digits].mean(0)  # the best single schedule there
    assert (torch.tensor(found["single"]) - middle).abs().max() < 0.03  # Adam at lr 0.1 jitters
    gain = {row: torch.tensor(values).mean().item() for row, values in found["rows"].items()}
    single = torch.tensor(found["single_heldout"])  # about -0.325 (digits are not balanced)
    assert gain["own context"] == pytest.approx(-single[: ceiling.SEARCHED].mean(), abs=bound)
    for row in [*(f"noise perturbed, e = {e}" for e in ceiling.NOISE_LEVELS), *ceiling.SPLITS]:
        assert gain[row] == gain["own context"]
    assert gain["their mean as one schedule"] == pytest.approx(0, abs=bound)
    # another context's schedule: +0.325 where its target is the same, -0.975 where not
    assert gain["given to other contexts"] < 0
    trained = {}
    for kind in ceiling.KINDS:
        job = ceiling.training(args, "digits", STEPS, kind, 0, found)
        trained["digits", STEPS, kind, 0] = job
        assert not job["read"] and ceiling.training(args, "digits", STEPS, kind, 0, None)["read"]
        trained |= {("digits", STEPS, f"{c} control, {kind}", 0): job for c in ceiling.FEATURES}
    reward = {row: torch.tensor(values["reward"]).mean().item()
              for job in trained.values() for row, values in job["rows"].items()}  # fmt: skip
    assert reward["instance"] > -bound
    for row in ("global", "average"):
        assert reward[row] == pytest.approx(single.mean(), abs=0.02)
    lines = ceiling.report(args, {("digits", STEPS): found}, trained)
    assert lines[0].startswith("The rule")
    assert any(line.startswith(f"Verdict: {ceiling.GAINS}. Deciding: ") for line in lines)


def test_a_positive_control_is_learned_where_the_noise_sets_it(tmp_path, monkeypatch):
    """A network starts at its schedule, t_L = 1e-5 included. A reward no schedule changes plus the
    noise control sized to a gap of 0.3: the global twin stays at the best single schedule (-0.3
    where x_T's mean is as often positive as negative), the instance network reads the sign of
    x_T's mean and takes at least 80% of the gap: it passes."""
    sets = dict(prompts=PROMPTS, validation=contexts(64, 1), heldout=contexts(128, 2))
    flat = Squared(torch.zeros(10, STEPS + 1), weight=0.0)
    monkeypatch.setattr(ceiling, "load", lambda name: (Toy(), flat, sets))
    args = argparse.Namespace(out_dir=str(tmp_path), batch=32, iterations=200, lr=1e-2)
    found = dict(single=[1.0, 0.6, 1e-5], rows={"own context": [0.3]})  # a t_L REINFORCE reaches
    start, options = torch.tensor(found["single"]), ceiling.starting_at(found["single"])
    policy = ceiling.make_policy(ceiling.POLICIES["global"], {}, STEPS, start, **options)
    times = ceiling.mean_times(policy, Toy(), sets["heldout"][:1])[0]
    torch.testing.assert_close(times, start, rtol=0.01, atol=0)
    reward = {kind: torch.tensor(ceiling.training(args, "digits", STEPS, kind, 0, found, "noise")
                                 ["rows"][kind]["reward"]) for kind in ceiling.KINDS}  # fmt: skip
    assert reward["global"].mean() == pytest.approx(-0.3, abs=0.03)
    mean, half = ceiling.mean_ci(reward["instance"] - reward["global"])
    assert mean > 0.8 * 0.3 and ceiling.passes(dict(mean=mean, half=half, gap=0.3))


def row(mean, half, gap=0.4):
    return dict(backbone="mini-sd3", steps=3, seed=0, contrast="instance - global", mean=mean,
                half=half, gap=gap)  # fmt: skip


def test_the_verdict_applies_the_rules():
    """Rows below 0.05, upper bounds below 25% of the gap, controls at 50% of theirs, lower bounds
    above 0: no gain; a control short (or a nan): uncalibrated; a row above (or a nan): gains."""
    quiet = [row(0.01, 0.02), row(-0.05, 0.1), row(0.0, 0.005, gap=0.1)]
    learned = [dict(control="noise", mean=0.2, half=0.1, gap=0.4)]
    assert ceiling.verdict(quiet, learned) == (ceiling.NO_GAIN, [])
    for short in (dict(learned[0], mean=0.19), dict(learned[0], half=0.21), row(0.3, math.nan)):
        assert ceiling.verdict(quiet, learned + [short]) == (ceiling.UNCALIBRATED, [short])
    for broken in (row(0.06, 0.01), row(0.04, 0.07), row(0.01, 0.03, gap=0.1), row(0, math.nan)):
        assert ceiling.verdict(quiet + [broken], learned) == (ceiling.GAINS, [broken])
    for empty in (([], learned), (quiet, [])):
        with pytest.raises(ValueError):
            ceiling.verdict(*empty)
