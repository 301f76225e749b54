import pytest
import torch

from backbones import BACKBONES
from evaluate import POLICIES
from evidence.bench import POLICY_DIMS
from policy import (
    ALPHA_MIN,
    TAU_FLOOR,
    GlobalPolicy,
    SchedulePolicy,
    increments_from_times,
    initial_logits,
    log_prob,
    make_policy,
    mean_increments,
    sample_increments,
    times_from_increments,
)

DIGITS = dict(latent_channels=1, text_dim=32, pooled_dim=32)


def digits_inputs(batch, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn(batch, 1, 8, 8, generator=generator).to(dtype)
    text = torch.randn(batch, 4, 32, generator=generator).to(dtype)
    text_mask = torch.ones(batch, 4, dtype=torch.bool)
    text_mask[::2, 3] = False  # every other prompt has a padding token
    pooled = torch.randn(batch, 32, generator=generator).to(dtype)
    return latent, text, text_mask, pooled


def sd3_default_times(steps, shift=3.0):
    # SD3's default: linspace sigmas, statically shifted, ending at 0
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def reinforce_step(policy, inputs, lr=0.1, seed=0):
    """One SGD step on a REINFORCE loss with random advantages: the zero-initialised head moves."""
    alpha = policy(*inputs)
    tau = sample_increments(alpha, 2, torch.Generator().manual_seed(seed))
    advantages = torch.randn(tau.shape[:2], generator=torch.Generator().manual_seed(seed + 1))
    loss = -(advantages * log_prob(alpha, tau)).mean()
    policy.zero_grad()
    loss.backward()
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter -= lr * parameter.grad


def assert_valid_schedule(times, steps):
    assert times.shape[-1] == steps + 1
    assert times.dtype == torch.float32
    assert torch.all(times[..., 0] == 1.0)
    assert torch.all(times[..., 1:] < times[..., :-1]), "times must be strictly decreasing"
    assert torch.all(times > 0) and torch.all(times <= 1)


# -----------------------------------------------------------------------------
# schedules <-> increments


def test_times_and_increments_by_hand_and_inverting_each_other():
    tau = torch.tensor([0.5, 0.3, 0.2])
    assert torch.allclose(times_from_increments(tau), torch.tensor([1.0, 0.5, 0.2]))
    assert torch.allclose(increments_from_times(torch.tensor([1.0, 0.5, 0.2])), tau)
    # the last time is the stop margin exactly, even where 1 - cumsum would round it away in float32
    tiny = torch.tensor([0.6, 0.4 - 1e-7, 1e-7])
    assert times_from_increments(tiny)[-1].item() == pytest.approx(1e-7, rel=1e-6)
    tau = torch.distributions.Dirichlet(torch.full((5, 21), 2.0)).sample((3,))  # (3, 5, 21)
    times = times_from_increments(tau)
    assert torch.allclose(increments_from_times(times), tau, atol=1e-6)
    default = sd3_default_times(20).float()
    assert torch.allclose(times_from_increments(increments_from_times(default)), default, atol=1e-6)


# -----------------------------------------------------------------------------
# the Dirichlet


@pytest.mark.parametrize("kind", ["instance", "global"])
def test_samples_and_means_are_valid_schedules(kind):
    steps = 10
    policy = make_policy(POLICIES[kind], DIGITS, steps)
    alpha = policy(*digits_inputs(6))
    assert alpha.shape == (6, steps + 1) and alpha.dtype == torch.float32
    tau = sample_increments(alpha, 4, torch.Generator().manual_seed(0))
    assert tau.shape == (6, 4, steps + 1)
    assert torch.allclose(tau.sum(-1), torch.ones(6, 4), atol=1e-6)
    assert_valid_schedule(times_from_increments(tau), steps)
    assert_valid_schedule(times_from_increments(mean_increments(alpha)), steps)
    equal = torch.full((6, steps + 1), 1 / (steps + 1))  # no init_times: equal increments
    assert torch.allclose(mean_increments(alpha), equal, atol=2e-3)  # but for the head's last layer
    # the draws are the generator's alone: the same seed draws the same schedules, another others
    assert torch.equal(tau, sample_increments(alpha, 4, torch.Generator().manual_seed(0)))
    assert not torch.allclose(tau, sample_increments(alpha, 4, torch.Generator().manual_seed(1)))


def test_sample_mean_matches_dirichlet_mean():
    alpha = torch.tensor([[30.0, 50.0, 19.5, 0.5], [1.0, 2.0, 3.0, 4.0]])
    draws = 20000
    tau = sample_increments(alpha, draws, torch.Generator().manual_seed(0))  # (2, draws, 4)
    mean = alpha / alpha.sum(-1, keepdim=True)
    # Var tau_i = m_i (1 - m_i) / (A + 1); the sample mean is within 5 standard errors
    standard_error = (mean * (1 - mean) / (alpha.sum(-1, keepdim=True) + 1) / draws).sqrt()
    assert torch.all((tau.mean(1) - mean).abs() < 5 * standard_error)


@pytest.mark.parametrize("scale", [0.05, 1.0, 30.0, 3000.0])
def test_log_prob_matches_torch_dirichlet(scale):
    """The joint log-density of the L+1 increments: a sum over components, not a mean."""
    generator = torch.Generator().manual_seed(0)
    alpha = (torch.rand(4, 11, generator=generator) + 0.5) * scale
    tau = sample_increments(alpha, 5, generator)
    dirichlet = torch.distributions.Dirichlet(alpha.double()[:, None, :])
    expected = dirichlet.log_prob(tau.double())  # (4, 5)
    got = log_prob(alpha, tau)
    assert got.shape == (4, 5) and got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("low, high", [(-30.0, -30.0), (1e4, 1e4), (-30.0, 1e4)])
def test_extreme_concentrations_at_80_steps_are_finite(low, high):
    """Every concentration at the softplus floor ALPHA_MIN (a head bias of -30), every one at 1e4,
    or some at the floor among others at 1e4: draws and means are valid schedules, log-densities
    and their gradients finite."""
    policy = GlobalPolicy(80)
    head = policy.head[-1]
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(high)
        head.bias[::7] = low  # softplus(-30) ~ 1e-13, so alpha = ALPHA_MIN
    alpha = policy(torch.zeros(3, 1, 8, 8))
    alpha.retain_grad()
    assert alpha.min().item() == pytest.approx(ALPHA_MIN if low < 0 else 1e4, rel=1e-4)
    tau = sample_increments(alpha, 4, torch.Generator().manual_seed(0))
    assert torch.all(torch.isfinite(tau)) and torch.all(tau >= TAU_FLOOR * (1 - 1e-3))
    assert_valid_schedule(times_from_increments(tau), 80)
    assert_valid_schedule(times_from_increments(mean_increments(alpha)), 80)
    values = log_prob(alpha, tau)
    values.sum().backward()
    assert torch.all(torch.isfinite(values)) and torch.all(torch.isfinite(head.bias.grad))
    assert torch.all(torch.isfinite(alpha.grad)) and alpha.grad.abs().sum() > 0


# -----------------------------------------------------------------------------
# the networks


def test_gradients_reach_every_parameter_and_the_policy_reads_its_input_but_no_padding():
    policy = make_policy(SchedulePolicy, DIGITS, 10)
    inputs = digits_inputs(8)
    reinforce_step(policy, inputs)
    # the head's last layer and its bias move from the first step on
    assert policy.head[-1].weight.grad.abs().sum() > 0 and policy.head[-1].bias.grad.abs().sum() > 0
    reinforce_step(policy, inputs, seed=1)
    for name, parameter in policy.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
        assert torch.all(torch.isfinite(parameter.grad)), name
    latent, text, text_mask, pooled = inputs
    alpha = policy(latent, text, text_mask, pooled)
    assert not torch.allclose(alpha[0], alpha[1])
    padded = text.clone()
    padded[~text_mask] = 1e3  # values behind the mask must not matter
    assert torch.allclose(policy(latent, padded, text_mask, pooled), alpha, atol=1e-6)
    # a prompt with every token masked still has the learned null token to attend to
    assert torch.all(torch.isfinite(policy(latent, text, torch.zeros_like(text_mask), pooled)))
    # bf16 inputs are cast at the top; all policy math is float32
    bf16 = policy(*digits_inputs(8, dtype=torch.bfloat16))
    assert bf16.dtype == torch.float32 and torch.all(torch.isfinite(bf16))


def test_the_global_policy_is_the_instance_network_on_constant_inputs():
    """One schedule for every context, whatever the noise and prompt; the instance policy's
    network and start (its sizes, its initial concentrations), trained by the same gradients."""
    policy = make_policy(GlobalPolicy, DIGITS, 10, init_times=torch.linspace(1, 0, 11))
    instance = make_policy(SchedulePolicy, DIGITS, 10, init_times=torch.linspace(1, 0, 11))
    inputs = digits_inputs(8)
    alpha = policy(*inputs)
    assert torch.equal(alpha, alpha[:1].expand_as(alpha))  # the same for every context
    assert torch.equal(policy.head[-1].bias, instance.head[-1].bias)  # the same start
    names = [name for name, _ in instance.named_parameters() if "pooled" not in name]
    assert names == [name for name, _ in policy.named_parameters()]  # but the pooled FiLM
    reinforce_step(policy, inputs)
    assert policy.head[-1].bias.grad.abs().sum() > 0 and policy.head[-1].weight.grad.abs().sum() > 0


def test_policy_sizes_are_about_20m_for_the_real_models():
    # the paper: about 20M parameters, under 1% of the sampler
    for name, dims in POLICY_DIMS.items():
        with torch.device("meta"):
            policy = make_policy(SchedulePolicy, dims, 20, network=BACKBONES[name]["policy"])
        params = sum(p.numel() for p in policy.parameters())
        low, high = (50_000, 200_000) if name == "digits" else (15e6, 25e6)
        assert low <= params <= high, (name, params)


def test_real_network_runs_on_a_small_latent():
    # the real network's shapes on a 512px latent (64x64) and a short prompt: any resolution works
    dims = dict(latent_channels=16, text_dim=4096, pooled_dim=2048)
    small = dict(widths=[8, 16, 16, 32], dim=32, heads=4, head_hidden=32)
    policy = make_policy(SchedulePolicy, dims, 5, network="real", **small)
    latent, text, pooled = torch.randn(2, 16, 64, 64), torch.randn(2, 7, 4096), torch.randn(2, 2048)
    alpha = policy(latent, text, torch.ones(2, 7, dtype=torch.bool), pooled)
    assert alpha.shape == (2, 6) and torch.all(torch.isfinite(alpha))


# -----------------------------------------------------------------------------
# initialisation


@pytest.mark.parametrize("kind", ["instance", "global"])
@pytest.mark.parametrize("steps", [2, 10, 80])
def test_default_init_reproduces_the_default_schedule(kind, steps):
    default = sd3_default_times(steps)
    stop_margin, concentration = 5e-3, 100.0
    start = dict(stop_margin=stop_margin, concentration=concentration)
    policy = make_policy(POLICIES[kind], DIGITS, steps, init_times=default, **start)
    alpha = policy(*digits_inputs(4))
    # the network's last layer starts at N(0, 1e-4) weights over 128 SiLU features (the global
    # policy is the same network): logit deviations of about 0.07, so alpha within 10% and the mean
    # times within 3e-3 (2.6e-3 at most measured at L = 80 over 5 seeds)
    rtol, atol = 0.1, 5e-3
    assert torch.allclose(alpha.sum(-1), torch.full((4,), concentration), rtol=rtol)
    times = times_from_increments(mean_increments(alpha))  # (4, L+1)
    # the default's last increment 0 is raised to stop_margin m and the sum renormalised, which maps
    # every time t to (t + m) / (1 + m) exactly, hence within m of the default
    expected = ((default + stop_margin) / (1 + stop_margin)).float()
    assert torch.allclose(times, expected.expand(4, -1), atol=atol)
    assert torch.all((times - default.float()).abs() <= stop_margin + atol)


def test_default_init_starting_below_one_starts_from_one():
    # SD-XL's "leading" spacing at 2 steps runs timesteps [501, 1] -> times [501/999, 1/999, 0]
    default = torch.tensor([501 / 999, 1 / 999, 0.0])
    policy = make_policy(GlobalPolicy, DIGITS, 2, init_times=default, stop_margin=5e-3)
    with torch.no_grad():
        policy.head[-1].weight.zero_()  # the bias alone: the start exactly
    times = times_from_increments(mean_increments(policy(*digits_inputs(1))))[0]
    expected = (torch.tensor([1.0, 1 / 999, 0.0]) + 5e-3) / (1 + 5e-3)
    assert times[0] == 1.0
    assert torch.allclose(times[1:], expected[1:].float(), atol=1e-6)


def test_initial_logits_invert_softplus_for_small_and_large_concentrations():
    times = torch.tensor([1.0, 0.5, 1e-3, 0.0], dtype=torch.float64)  # increments .5, .499, 1e-3, 0
    for concentration in (1.01, 100.0, 1e6):
        logits = initial_logits(3, "default", times, concentration, stop_margin=1e-3)
        increments = increments_from_times(times)
        increments[-1] = 1e-3  # only the final 0 is raised to the stop margin
        expected = concentration * increments / increments.sum()
        assert torch.allclose(torch.nn.functional.softplus(logits) + ALPHA_MIN, expected, rtol=1e-9)


@pytest.mark.parametrize(
    "arguments",
    [
        dict(),  # no init_times
        dict(init_times=[1.0, 0.5, 0.0]),  # the wrong length
        dict(init_times=[1.0, 0.5, 0.5, 0.2, 0.0]),  # a repeated time
        # a concentration of 1 puts the stop margin's alpha at 1e-4, below ALPHA_MIN
        dict(init_times=[1.0, 0.8, 0.6, 0.3, 0.0], concentration=1.0, stop_margin=1e-4),
    ],
)
def test_bad_initial_schedules_raise_value_errors(arguments):
    with pytest.raises(ValueError):
        GlobalPolicy(4, init="default", **arguments)
