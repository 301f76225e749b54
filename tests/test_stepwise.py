"""The step-wise comparator (comparator/tpdm.py, TPDM): its log-probability against
torch.distributions, PPO's clipped objective on a hand-computed case, and the loop with a step-wise
policy against the loop fed the times it chose, on the embedded and the diffusers backbones."""

import math

import pytest
import torch

from backbones import from_pipeline, load_backbone
from baselines import BASELINES
from comparator import tpdm
from miniatures.layouts import TINY_GUIDANCE, TINY_RESOLUTION, tiny_pipeline
from policy import make_policy

STEPS = 4
PROMPTS = ["a cat", "a red house on a hill"]  # on the diffusers backbones


@pytest.fixture(scope="module")
def digits():
    backbone = load_backbone("digits-noise")
    policy = make_policy(
        tpdm.StepwisePolicy, backbone.policy_dims, STEPS, init_times=backbone.default_times(STEPS)
    )
    return backbone, policy


def contexts(backbone, count, seed=0, prompts=None):
    """count noises drawn from seed, with these prompts or the backbone's own in turn."""
    noise = backbone.sample_noise(count, torch.Generator().manual_seed(seed))
    prompts = prompts or [backbone.prompts[i % len(backbone.prompts)] for i in range(count)]
    return noise, backbone.encode_prompts(prompts)


def drawn(backbone, policy, noise, cond, seeds):
    """One stochastic rollout, one draw stream per sample: (latents, record)."""
    draws = [torch.Generator().manual_seed(seed) for seed in seeds]
    stepper = tpdm.Stepper(policy, backbone, cond, draws)
    with torch.no_grad():
        latents = tpdm.run_stepwise(backbone, noise, cond, policy.steps, stepper)
    return latents, stepper.record()


def test_the_log_probability_is_the_sum_of_the_steps_beta_log_densities_and_parts_join(digits):
    backbone, policy = digits
    noise, cond = contexts(backbone, 6)
    _, record = drawn(backbone, policy, noise, cond, range(6))
    alpha, beta = record["parameters"].double().unbind(-1)  # (N, L) each
    rate = record["pair"][..., 0].double()
    assert (alpha > 1).all() and (beta > 1).all()  # 1 + exp(.)
    expected = torch.distributions.Beta(alpha, beta).log_prob(rate).sum(1)  # (N,)
    torch.testing.assert_close(record["logp"].double(), expected, rtol=1e-5, atol=1e-4)
    recomputed = tpdm.trajectory_log_prob(policy, record)  # with gradients, from the stored states
    torch.testing.assert_close(recomputed.double(), expected, rtol=1e-5, atol=1e-4)
    assert recomputed.requires_grad
    index = torch.tensor([4, 1])
    torch.testing.assert_close(tpdm.trajectory_log_prob(policy, record, index), recomputed[index])
    # the times are the products of the rates, strictly decreasing to a positive stop margin
    times = record["times"]
    torch.testing.assert_close(times[:, 1:], times[:, :-1] * record["pair"][..., 0])
    assert (times[:, 1:] < times[:, :-1]).all() and (times[:, -1] > 0).all()
    # the records of rollout parts, each with its own samples' draws, join as the whole one
    parts = []
    for part in (torch.arange(4), torch.arange(4, 6)):
        sub = {key: value[part] for key, value in cond.items()}
        parts.append(drawn(backbone, policy, noise[part], sub, part.tolist())[1])
    torch.testing.assert_close(tpdm.join_records(parts), record, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["digits-noise", *TINY_GUIDANCE])
def test_the_loop_with_a_stepwise_policy_equals_the_loop_fed_its_times(family, monkeypatch):
    """Exactly L model calls, each followed by one decision that reads the state and the prediction
    as images (Flux: its packed tokens unpacked); the loop fed the times chosen gives the same
    latents, exactly on the embedded backbone."""
    if family == "digits-noise":
        backbone, prompts, tolerance = load_backbone(family), None, 0.0
    else:
        pipe, guidance = tiny_pipeline(family), TINY_GUIDANCE[family]
        backbone = from_pipeline(pipe, resolution=TINY_RESOLUTION, guidance=guidance)
        prompts, tolerance = PROMPTS, 1e-5
    steps = 3
    policy = make_policy(
        tpdm.StepwisePolicy, backbone.policy_dims, steps, init_times=backbone.default_times(3)
    )
    noise, cond = contexts(backbone, 2, seed=1, prompts=prompts)
    calls, ode = [], backbone.ode

    def counted(*args):  # the sampler's derivative: one model call each
        derivative, state, level = ode(*args)
        return lambda *inputs: calls.append(1) or derivative(*inputs), state, level

    monkeypatch.setattr(backbone, "ode", counted)
    latents, record = drawn(backbone, policy, noise, cond, [10, 11])
    assert len(calls) == steps
    image = backbone.as_image(noise)  # (N, C, H, W)
    assert record["latent"].shape == (2, steps, 2 * image.shape[1], *image.shape[2:])
    replay = backbone.sample(noise, cond, record["times"])
    torch.testing.assert_close(replay, latents, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name, steps", [("digits-noise", 4), ("digits", 20)])
def test_it_starts_at_the_dirichlet_policys_initial_mean_schedule(name, steps):
    backbone = load_backbone(name)
    default = backbone.default_times(steps)
    # the Dirichlet policy's initial mean: the default with the 5e-3 stop margin, (t + m) / (1 + m)
    start = (default + 5e-3) / (1 + 5e-3)
    noise, cond = contexts(backbone, 32, seed=2)
    for seed in range(3):
        torch.manual_seed(seed)
        policy = make_policy(tpdm.StepwisePolicy, backbone.policy_dims, steps, init_times=default)
        times, _ = policy.schedule(backbone, noise, cond)  # the Beta means
        assert (times - start).abs().max() < 5e-3


def test_ppo_clipped_objective_on_a_hand_computed_case():
    ratio = torch.tensor([1.5, 0.5, 1.1, 0.7])
    logp = ratio.log().requires_grad_(True)
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped = tpdm.ppo_objective(logp, torch.zeros(4), advantages, clip=0.2)
    # min(rho A, clip(rho) A): min(1.5, 1.2) = 1.2; min(0.5, 0.8) = 0.5; min(-1.1, -1.1) = -1.1;
    # min(-0.7, -0.8) = -0.8; the loss is minus their mean
    assert loss.item() == pytest.approx(-(1.2 + 0.5 - 1.1 - 0.8) / 4)
    assert clipped.item() == pytest.approx(0.75)  # 1.5, 0.5 and 0.7 lie outside [0.8, 1.2]
    loss.backward()
    # where the clipped term is the minimum the gradient is zero; elsewhere d/dlogp = -rho A / N
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.5 / 4, 1.1 / 4, 0.0]))
    # at the old policy PPO's gradient is REINFORCE's
    logp = torch.zeros(4, requires_grad=True)
    tpdm.ppo_objective(logp, torch.zeros(4), advantages, clip=0.2)[0].backward()
    torch.testing.assert_close(logp.grad, -advantages / 4)


@pytest.mark.parametrize("family", ["sd3", "flux-dev", "sdxl"])
def test_the_denoisers_hidden_states_reach_the_policy_on_each_family(family):
    """inputs="hidden": what the policy is called with at the first step is the denoiser's own
    first-layer tokens and last normalised features on the token grid, side by side, and its
    timestep embedding, CFG-combined as the prediction; the hooks change no output, and put on
    before compiling (train.py's --compile) they run in the compiled model."""
    pipe = tiny_pipeline(family)
    backbone = from_pipeline(pipe, resolution=TINY_RESOLUTION, guidance=TINY_GUIDANCE[family])
    steps = 3
    options = dict(init="tpdm", inputs="hidden", **tpdm.hidden_dims(backbone))
    policy = make_policy(tpdm.StepwisePolicy, backbone.policy_dims, steps, **options)
    noise, cond = contexts(backbone, 2, prompts=PROMPTS)
    layers = tpdm.HIDDEN_LAYERS[family.removesuffix("-dev")]  # first, last, time embedding
    outputs = {name: [] for name in layers}  # each model call's, in order
    for name in outputs:  # the hooks stay on: this pipeline and policy are this test's own
        backbone.model.get_submodule(name).register_forward_hook(
            lambda module, args, output, name=name: outputs[name].append(output.float())
        )
    seen = []  # the policy's keyword arguments at each call: (module, args, kwargs)[2]
    policy.register_forward_pre_hook(lambda *call: seen.append(call[2]), with_kwargs=True)
    stepper = tpdm.Stepper(policy, backbone, cond, torch.Generator())
    with torch.no_grad():
        latents = tpdm.run_stepwise(backbone, noise, cond, steps, stepper)
    assert len(seen) == steps and all(len(values) == steps for values in outputs.values())
    first, last, embedding = (values[0] for values in outputs.values())  # the first model call
    if family != "flux-dev":  # true CFG: [uncond; cond], combined as the prediction is
        guidance = TINY_GUIDANCE[family]
        first, last, embedding = (
            value[:2] + guidance * (value[2:] - value[:2]) for value in (first, last, embedding)
        )

    def grid(value):  # tokens (N, h w, D) -> (N, D, h, w); a UNet's maps are already so
        if value.dim() == 4:
            return value
        side = int(value.shape[1] ** 0.5)
        return value.transpose(1, 2).reshape(len(value), -1, side, side)

    features = torch.cat([grid(first), grid(last)], dim=1)
    assert features.shape[1] == tpdm.hidden_dims(backbone)["feature_channels"]
    torch.testing.assert_close(seen[0]["latent"].float(), features)
    torch.testing.assert_close(seen[0]["embedding"].float(), embedding)
    record = stepper.record()
    # the update reads the same inputs: the recomputed log-probability equals the rollout's
    torch.testing.assert_close(tpdm.trajectory_log_prob(policy, record), record["logp"])
    replay = backbone.sample(noise, cond, record["times"])  # with the hooks on
    torch.testing.assert_close(replay, latents, rtol=1e-5, atol=1e-5)
    compiled = from_pipeline(pipe, resolution=TINY_RESOLUTION, guidance=TINY_GUIDANCE[family])
    tpdm.hidden_states(compiled)  # its hooks, then compile: a compiled model runs no later ones
    compiled.model.compile(backend="eager")  # dynamo's handling of hooks, without a C++ build
    _, again = policy.schedule(compiled, noise, cond, torch.Generator())  # the same draws
    torch.testing.assert_close(again, latents, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("inference, start", [("mode", 0.818), ("mean", 0.78)])
def test_tpdms_start_rate_is_its_betas_mode_or_mean_at_every_step(digits, inference, start):
    """At inference a rate is its Beta's mode (TPDM) or mean (the project's variant); at TPDM's
    start, head bias (2.5, 1.0), the mode (alpha - 1) / (alpha + beta - 2) is e^2.5 / (e^2.5 + e)
    and the mean 0.78, at every step for all contexts: the head's last layer has N(0, 1e-3)
    weights, which move the logits by about 0.01 (at most 1.8e-3 measured over 5 seeds)."""
    backbone, _ = digits
    torch.manual_seed(0)
    policy = make_policy(
        tpdm.StepwisePolicy, backbone.policy_dims, STEPS, init="tpdm", inference=inference
    )
    noise, cond = contexts(backbone, 16, seed=5)
    stepper = tpdm.Stepper(policy, backbone, cond)
    with torch.no_grad():
        tpdm.run_stepwise(backbone, noise, cond, STEPS, stepper)
    record = stepper.record()
    rates = record["pair"][..., 0].double()  # (N, L)
    distribution = torch.distributions.Beta(*record["parameters"].double().unbind(-1))
    expected = distribution.mode if inference == "mode" else distribution.mean
    torch.testing.assert_close(rates, expected, rtol=1e-6, atol=0)
    alpha, beta = 1 + math.exp(2.5), 1 + math.exp(1.0)
    at_start = (alpha - 1) / (alpha + beta - 2) if inference == "mode" else alpha / (alpha + beta)
    assert at_start == pytest.approx(start, abs=1e-3)
    assert (rates - at_start).abs().max() < 5e-3


def test_rloo_advantages_unnormalised_and_one_ppo_step_with_tpdms_optimiser_by_hand():
    """train.py's PPO defaults on a hand-computed case: the advantages are r minus the other
    rollout's reward (K = 2), not divided by their spread; each batch takes 4 Adam steps on the
    whole batch (4 epochs x 1 minibatch); the first is Adam(0.9, 0.99) with eps 1e-5 and no weight
    decay (train.py's AdamW with the run's settings): theta_1 = -lr g / (|g| + 1e-5), visible here
    as |g| is near eps."""
    import train

    config = train.parse_config(["--policy", "stepwise", "--optimizer", "ppo"])
    rewards = torch.tensor([[1.0, 0.4], [0.3, 0.5], [2.0, 2.0]])  # (B, K)
    advantages = (rewards - BASELINES[config.baseline](rewards)).flatten()
    torch.testing.assert_close(advantages, torch.tensor([0.6, -0.6, -0.2, 0.2, 0.0, 0.0]))
    features = 1e-5 * torch.tensor(
        [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0], [3.0, 1.0], [0.5, 0.5]]
    )
    policy = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(policy.weight)
    betas = (0.9, config.adam_beta2)
    optimizer = torch.optim.AdamW(
        policy.parameters(), config.lr, betas, config.adam_eps, config.weight_decay
    )
    weights, sizes = [], []

    class Rollouts:  # what ppo_update asks of a policy's rollouts
        logp = torch.zeros(6)

        def log_prob(self, policy, index):
            sizes.append(len(index))
            return policy(features[index])[:, 0]

    optimizer.register_step_post_hook(lambda *_: weights.append(policy.weight.detach()[0] + 0))
    tpdm.ppo_update(config, 0, Rollouts(), policy, advantages, optimizer)
    assert sizes == [6, 6, 6, 6]  # 4 epochs, each one minibatch of the whole batch
    # at theta = 0 every ratio is 1 (unclipped): g = -mean_i A_i x_i
    g = -(advantages[:, None] * features).mean(0)
    torch.testing.assert_close(g, torch.tensor([-0.6e-5 + 0.2e-5 + 0.4e-5, 0.6e-5 - 0.2e-5]) / 6)
    expected = -config.lr * g / (g.abs() + 1e-5)
    torch.testing.assert_close(weights[0], expected, rtol=1e-5, atol=0)
    assert config.lr_decay == "constant" and train.get_lr(config, 123) == config.lr
