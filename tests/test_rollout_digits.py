"""The embedded digits backbone: its velocity is the exact flow of the mixture, and the loop runs
schedules exactly."""

import math
from unittest import mock

import pytest
import torch
from test_stepwise import contexts  # count noises from a seed, the prompts in turn

from backbones import BACKBONES, load_backbone
from rollout import run_schedule


@pytest.fixture(scope="module")
def digits():
    return load_backbone("digits")


def rms(a, b):
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


def log_density(backbone, x, t, label):
    """log p_t(x) of x_t = (1 - t) x_0 + t noise for flattened samples x (..., 64), by brute force
    over the components of the class (each N(mu_m, s_m^2 I), all weighing the same)."""
    mixture = backbone.mixture(torch.tensor([label]))
    centres, _, variances, log_weights = (part[0] for part in mixture)
    real = log_weights == 0
    mu, total = centres[real], (1 - t) ** 2 * variances[real] + t**2  # (M, 64), (M,)
    squared = ((x[..., None, :] - (1 - t) * mu) ** 2).sum(-1)
    return torch.logsumexp(
        -squared / (2 * total) - 32 * torch.log(2 * math.pi * total), -1
    ) - math.log(len(mu))


def finite_difference_velocity(backbone, x, t, label, step=1e-5):
    """E[noise - x_0 | x_t = x] from the score, by central differences in float64: E[noise | x_t] =
    -t * score(x_t) (Tweedie) and E[x_0 | x_t] = (x_t - t E[noise | x_t]) / (1 - t)."""
    steps = step * torch.eye(64, dtype=torch.float64)  # one coordinate moved per row
    rise = log_density(backbone, x + steps, t, label) - log_density(backbone, x - steps, t, label)
    expected_noise = -t * rise / (2 * step)  # -t * score
    return expected_noise - (x - t * expected_noise) / (1 - t)


# (label, t, component): near the first or the last component of the class, from t = 0.9 to 0.02
POINTS = [(3, 0.9, 0), (7, 0.5, -1), (0, 0.2, -1), (5, 0.05, 0), (1, 0.02, 0)]


@pytest.mark.parametrize("name", ["digits", "digits-prompt", "digits-noise", "digits-xor"])
def test_velocity_matches_finite_difference_score(name):
    # digits-prompt and digits-noise: stds per component (0.02 and 0.5), so the posterior weights
    # need the -(d/2) log v_m term; points near a component of each kind
    backbone = load_backbone(name)
    generator = torch.Generator().manual_seed(1)
    for label, t, component in POINTS:
        mixture = backbone.mixture(torch.tensor([label]))
        centres, _, variances, log_weights = (part[0] for part in mixture)
        real = (log_weights == 0).nonzero().flatten()
        index = real[component]
        draws = torch.randn(2, 64, generator=generator, dtype=torch.float64)
        x = (1 - t) * (centres[index] + variances[index].sqrt() * draws[0]) + t * draws[1]
        velocity = backbone.velocity(x[None], torch.tensor([t]), mixture)[0]
        expected = finite_difference_velocity(backbone, x, t, label)
        # truncation ~ step^2 * third derivative ~ 1e-10 / variance^2, roundoff ~ 1e-16 / step
        torch.testing.assert_close(velocity, expected, rtol=1e-6, atol=1e-6, msg=f"t = {t}")


def test_velocity_at_the_ends(digits):
    noise, cond = contexts(digits, 10)
    mixture = digits.mixture(cond["label"])
    x = noise.double()
    # t = 1: uniform posterior over components, E[x_0 | x_1] is the class mean, E[noise | x_1] = x
    centres, _, _, log_weights = mixture
    real = (log_weights == 0).double()  # (N, M)
    class_mean = (centres * real[..., None]).sum(1) / real.sum(1, keepdim=True)
    at_one = digits.velocity(x, torch.ones(10), mixture)
    assert torch.allclose(at_one, x - class_mean.view(10, 1, 8, 8), atol=1e-12)
    # t = 0: x_0 = x is known, so the velocity is -x
    assert torch.allclose(digits.velocity(x, torch.zeros(10), mixture), -x, atol=1e-12)


def test_fidelity_error_goes_to_zero_as_steps_grow(digits):
    noise, cond = contexts(digits, 16)
    reference = digits.reference(noise, cond)
    errors = [
        rms(digits.sample(noise, cond, digits.default_times(steps).expand(16, -1)), reference)
        for steps in (4, 16, 64, 256)
    ]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[0] > 0.1 and errors[-1] < 0.01, errors


def test_reference_is_converged(digits):
    """The default teacher (64 uniform RK4 steps in float64) against 128 steps; digits' own (20
    steps on a grid large near t = 1, float32) within its stated bound of the default: 2e-4 RMS
    (measured 2.0e-5 over 256 held-out contexts), so the teacher reward of a 4-step sample moves by
    less than 2e-4 per context (measured at most 6.7e-5), against the main job's gain of 1e-2."""
    from backbones.mixture import MixtureBackbone

    noise, cond = contexts(digits, 64, seed=2)
    populations = BACKBONES["digits"]["populations"]
    default = MixtureBackbone("digits", populations)
    finer = MixtureBackbone("digits", populations)
    finer.reference_steps = 128
    reference, solved = default.reference(noise, cond), digits.reference(noise, cond)
    sampled = digits.sample(noise, cond, digits.default_times(4).expand(64, -1))
    coarse_error = rms(sampled, reference)
    converged = rms(reference, finer.reference(noise, cond))
    assert converged < 1e-5 and converged < 1e-4 * coarse_error
    assert rms(solved, reference) < 2e-4
    # the teacher reward of the 4-step sample, against the default teacher and digits' own
    to_default, to_solved = (sampled - reference).square(), (sampled - solved).square()
    assert (to_default.mean((1, 2, 3)) - to_solved.mean((1, 2, 3))).abs().max() < 2e-4


def test_exactly_steps_calls_and_schedule_matters(digits):
    noise, cond = contexts(digits, 8)
    custom_times = torch.tensor([1.0, 0.9, 0.6, 0.2, 0.05]).expand(8, -1)
    with mock.patch.object(digits, "velocity", wraps=digits.velocity) as velocity:
        default = digits.sample(noise, cond, digits.default_times(4).expand(8, -1))
        custom = digits.sample(noise, cond, custom_times)
    assert velocity.call_count == 8
    # the model sees the given times, unshifted
    assert torch.equal(velocity.call_args_list[5].args[1], torch.full((8,), 0.9))
    assert rms(default, custom) > 1e-2


def test_first_order_update_by_hand(digits):
    noise, cond = contexts(digits, 4)
    times = torch.tensor([[1.0, 0.3], [1.0, 0.5], [0.8, 0.1], [1.0, 0.0]])
    velocity = digits.velocity(noise, times[:, 0], digits.mixture(cond["label"])).float()
    expected = noise + (times[:, 1] - times[:, 0]).view(-1, 1, 1, 1) * velocity
    assert torch.allclose(digits.sample(noise, cond, times), expected, atol=1e-6)


def test_run_schedule_integrates_a_linear_ode_exactly():
    # dx/ds = 1 integrates exactly under any schedule and level map: x_L = x_0 + s(t_L) - s(t_0)
    times = torch.tensor([[1.0, 0.6, 0.1], [1.0, 0.2, 0.0]])
    state = torch.zeros(2, 3)
    out = run_schedule(lambda x, t: torch.ones_like(x), state, times, level=lambda t: 2 * t**2)
    assert torch.allclose(out, torch.tensor([[-1.98] * 3, [-2.0] * 3]))


def test_prompts_conditioning_and_policy_inputs(digits):
    assert digits.prompts == [f"a handwritten {d}" for d in range(10)]
    cond = digits.encode_prompts(["a handwritten 3", "a handwritten 8"])
    assert cond["label"].tolist() == [3, 8]
    inputs = digits.policy_inputs(digits.sample_noise(2), cond)
    assert inputs["text"].shape == (2, 4, digits.policy_dims["text_dim"])
    assert inputs["text_mask"].tolist() == [[True, True, True, False]] * 2  # three words, a pad
    text = cond["prompt_embeds"]
    assert not torch.allclose(text[0], text[1])  # the digit token differs
    assert torch.equal(text[0, :2], text[1, :2])  # the shared words do not
    # fixed across constructions: the text encoder is seeded
    assert torch.equal(
        load_backbone("digits").encode_prompts(["a handwritten 3"])["prompt_embeds"], text[:1]
    )
    with pytest.raises(ValueError, match="digits knows only the prompts .*, got 'a cat'"):
        digits.encode_prompts(["a handwritten 3", "a cat"])


def test_decode_is_grey_in_the_unit_interval(digits):
    images = digits.decode(torch.linspace(-2, 2, 5 * 64).view(5, 1, 8, 8))
    assert images.shape == (5, 3, 8, 8) and images.dtype == torch.float32
    assert images.min() == 0.0 and images.max() == 1.0
    assert torch.equal(images[:, 0], images[:, 2])
    assert torch.allclose(digits.decode(torch.zeros(1, 1, 8, 8)), torch.full((1, 3, 8, 8), 0.5))


def test_the_sampler_is_differentiable_in_the_times_and_oracles_beat_the_default():
    # ablation.py's oracles: gradient descent on the schedule through the exact sampler
    from evidence.ablation import best_schedules, teacher_errors

    backbone = load_backbone("digits-prompt")
    noise, cond = contexts(backbone, 20, seed=7)
    fit = noise, cond, backbone.reference(noise, cond)
    groups = (cond["label"] >= 5).long()  # sharp (0-4) and blurred (5-9) digits
    schedules = best_schedules(backbone, fit, groups, steps=4, iterations=60)
    assert schedules.shape == (2, 5) and (schedules[:, -1] > 0).all()
    assert (schedules[:, 1:] < schedules[:, :-1]).all()  # decreasing
    with torch.no_grad():
        default = teacher_errors(backbone, fit, backbone.default_times(4).expand(20, -1))
        best = teacher_errors(backbone, fit, schedules[groups])
    # descending from the default, each group's schedule beats it; the sharp digits by far (the
    # blurred ones' best is near the uniform default)
    assert best[groups == 1].mean() < default[groups == 1].mean()
    assert best[groups == 0].mean() < 0.9 * default[groups == 0].mean()
    assert schedules[0, 3] > schedules[1, 3] + 0.1  # the sharp digits want their last step later


def test_digits_xor_needs_prompt_and_noise_together():
    # The half a trajectory reaches follows the noise's top-bottom contrast, and which half is sharp
    # follows the digit's parity: the teacher's sample is sharp (near one centre, std 0.02) for even
    # digits with top-bright noise and odd digits with bottom-bright noise, and blurred otherwise.
    backbone = load_backbone("digits-xor")
    count = 200
    noise = backbone.sample_noise(count, torch.Generator().manual_seed(0))
    prompts = [backbone.prompts[i % 10] for i in range(count)]
    cond = backbone.encode_prompts(prompts)
    sample = backbone.reference(noise, cond).flatten(1).double()
    contrast = noise.flatten(1)[:, :32].mean(1) > noise.flatten(1)[:, 32:].mean(1)
    reached_top = sample[:, :32].mean(1) > sample[:, 32:].mean(1)
    assert (reached_top == contrast).float().mean() > 0.9  # the noise says which half
    centres, _, _, log_weights = backbone.mixture(cond["label"])
    distance = (sample[:, None] - centres).square().sum(-1) + (log_weights < 0) * 1e30
    nearest = distance.min(1).values.sqrt()  # to the nearest component centre
    sharp_half = (cond["label"] % 2 == 0) == contrast  # even & top-bright, or odd & bottom-bright
    # a sharp component's samples lie within about 0.02 * 8 = 0.16 of its centre, a blurred one's
    # about 0.5 * 8 = 4 away
    assert (nearest < 1.0).float()[sharp_half].mean() > 0.85
    assert (nearest > 1.0).float()[~sharp_half].mean() > 0.85
    for group in (cond["label"] % 2 == 0, contrast):  # either input alone: half sharp, half not
        assert 0.3 < sharp_half[group].float().mean() < 0.7
