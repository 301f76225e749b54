"""
The comparator TPDM ("Schedule On the Fly", Ye et al., CVPR 2025, arXiv 2412.01243): a step-wise
policy that picks each next time from the sampler's state, trained with PPO as TPDM's trainer
takes it, with the settings of TPDM's public code (github.com/maple-research-lab/TPDM; TPDM below
and README name each file, docs/COMPARATOR.md what differs). After the model call at t_l:

    t_{l+1} = r_l t_l,  r_l ~ Beta(alpha_l, beta_l),  alpha_l = 1 + exp(a_l),  beta_l = 1 + exp(b_l)

so L steps cost L model calls and L policy calls, t_L > 0 is the learnable stop margin, and log pi
is the sum of the L Beta log-densities. The network is policy.SchedulePolicy.encode's, with t_l
and the step joining the pooled prompt embedding; it reads (run_stepwise's `decide`):
- inputs="hidden", TPDM's (src/models/stable_diffusion_3/modeling_sd3_pnt.py): the denoiser's
  hidden states and timestep embedding (hidden_states, forward hooks on HIDDEN_LAYERS);
- inputs="sampler": the state and the prediction of the clean sample (2 C channels).
init="tpdm" starts every step at TPDM's head bias (a, b) = (2.5, 1.0) (scripts/launch_sd3_train.sh
--init_alpha 2.5 --init_beta 1.0), any other init at the Dirichlet policy's initial mean schedule.
At inference the rate is the Beta's mode, TPDM's (modeling_sd3_pnt.py, `predict`), or its mean.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from backbones import FAMILIES
from policy import (
    ALPHA_MIN,
    SchedulePolicy,
    initial_logits,
    log_prob,
    mean_increments,
    sample_increments,
    times_from_increments,
)

FREQUENCIES = 8  # sin and cos of 2^k pi t, k < 8: the time's features
TPDM_LOGITS = (2.5, 1.0)  # TPDM's head bias (a, b): alpha = 1 + e^2.5, beta = 1 + e^1
# The denoiser's modules whose outputs the time predictor reads: the first and last hidden states
# and the timestep embedding (TPDM's on SD3, modeling_sd3_pnt.py; their counterparts on Flux and
# the SD-XL UNet)
HIDDEN_LAYERS = {
    "sd3": ("pos_embed", "norm_out", "time_text_embed"),
    "flux": ("x_embedder", "norm_out", "time_text_embed"),
    "sdxl": ("conv_in", "conv_norm_out", "time_embedding"),
}


def hidden_dims(backbone):
    """The sizes a policy reading a diffusers backbone's hidden states needs: feature_channels (the
    first and last hidden states, stacked) and time_dim (the timestep embedding)."""
    model = backbone.model
    if isinstance(backbone, FAMILIES["sdxl"]):
        channels, time_dim = model.config.block_out_channels[0], model.time_embedding.linear_2
        return dict(feature_channels=2 * channels, time_dim=time_dim.out_features)
    width = model.config.num_attention_heads * model.config.attention_head_dim
    return dict(feature_channels=2 * width, time_dim=width)


def token_grid(features):
    """Tokens (N, h * w, D) of a square image -> (N, D, h, w); UNet maps (N, D, h, w) stay."""
    if features.dim() == 4:
        return features
    side = math.isqrt(features.shape[1])
    return features.transpose(1, 2).reshape(len(features), -1, side, side)


def hidden_states(backbone):
    """read() -> (features (N, 2D, h, w), embedding (N, E)) float32 of the last model call,
    CFG-guided, as TPDM's predictor reads them: forward hooks on HIDDEN_LAYERS, put on once (a
    compiled model runs only the hooks it had when compiled: train.py calls this first)."""
    if getattr(backbone, "read_hidden", None) is not None:
        return backbone.read_hidden
    assert backbone.model._compiled_call_impl is None, "hidden_states(backbone), then compile"
    names = next(HIDDEN_LAYERS[name] for name, cls in FAMILIES.items() if isinstance(backbone, cls))
    modules = [backbone.model.get_submodule(name) for name in names]
    captured = dict.fromkeys(modules)  # its keys fixed: a compiled model then compiles once

    def keep(module, inputs, output):
        captured[module] = output

    def read():
        first, last, time = (backbone.guide(captured[module].float()) for module in modules)
        return torch.cat([token_grid(first), token_grid(last)], dim=1), time

    for module in modules:
        module.register_forward_hook(keep)
    backbone.read_hidden = read
    return read


def time_features(time, step, steps):
    """(N,) times and step indices -> (N, 2 FREQUENCIES + steps): Fourier features, one-hot step."""
    angles = time.float()[:, None] * math.pi * 2.0 ** torch.arange(FREQUENCIES, device=time.device)
    one_hot = F.one_hot(step.long(), steps).float()
    return torch.cat([angles.sin(), angles.cos(), one_hot], dim=-1)


def initial_rates(steps, init, init_times, concentration, stop_margin):
    """(L, 2) float64 logits (a_l, b_l) whose Beta means r_l = t_{l+1} / t_l give the Dirichlet
    policy's initial mean schedule (policy.initial_logits), with alpha + beta = concentration
    raised so that both are at least 2."""
    bias = initial_logits(steps, init, init_times, concentration, stop_margin)
    times = times_from_increments(mean_increments(F.softplus(bias) + ALPHA_MIN))
    rate = times[1:] / times[:-1]  # (L,)
    total = torch.maximum(torch.full_like(rate, concentration), 2.0 / torch.minimum(rate, 1 - rate))
    alpha, beta = rate * total, (1 - rate) * total
    return torch.stack([alpha - 1, beta - 1], dim=-1).log()


class StepwisePolicy(SchedulePolicy):
    """(denoiser features, t_l, step l, prompt) -> Beta parameters (alpha_l, beta_l) (N, 2),
    float32. latent_channels is the backbone's C; feature_channels and time_dim, the hidden
    states' channels and timestep-embedding width (inputs="hidden"); `arguments`, the base's."""

    def __init__(
        self,
        steps,
        latent_channels,
        text_dim,
        pooled_dim=None,
        inputs="sampler",
        feature_channels=None,
        time_dim=None,
        inference="mean",
        **arguments,
    ):
        init = arguments.pop("init", "uniform")  # "tpdm": the rates below replace the start
        # the state and the estimate (2 C channels); time and step join the pooled embedding
        channels, pooled = 2 * latent_channels, (pooled_dim or 0) + 2 * FREQUENCIES + steps
        if inputs == "hidden":
            channels, pooled = feature_channels, pooled + time_dim
        start = "uniform" if init == "tpdm" else init
        super().__init__(steps, channels, text_dim, pooled, init=start, **arguments)
        self.config.update(kind="stepwise", latent_channels=latent_channels, pooled_dim=pooled_dim)
        self.config.update(init=init, inputs=inputs, inference=inference)
        self.config.update(feature_channels=feature_channels, time_dim=time_dim)
        self.inputs, self.inference = inputs, inference
        self.described = f"step-wise (Beta {inference}s)", "step-wise (one Beta draw per step)"
        self.head[-1] = nn.Linear(self.head[-1].in_features, 2)
        self.rate_logits = nn.Parameter(torch.empty(steps, 2))  # (L, 2): a_l, b_l at the start
        if init == "tpdm":
            rates = torch.tensor(TPDM_LOGITS).expand(steps, 2)
        else:
            names = ("init", "init_times", "concentration", "stop_margin")
            rates = initial_rates(steps, *(self.config[name] for name in names))
        with torch.no_grad():  # copied: on any default device (evidence/bench.py builds on "meta")
            # these logits act on log(alpha - 1): a tenth of the Dirichlet head's 0.01
            self.head[-1].weight.normal_(0.0, 0.001)
            self.head[-1].bias.zero_()
            self.rate_logits.copy_(rates)

    pipeline_refusal = (
        "a step-wise policy (TPDM) picks each time from the sampler's state inside the loop, "
        "which a stock pipeline's scheduler does not hand out: sample it with sample.py without "
        "--pipeline"
    )

    def rollouts(self, policy, backbone, noise, cond, generators, rollouts):
        return StepwiseRollouts(policy, backbone, noise, cond, generators, rollouts)

    def schedule(self, backbone, noise, cond, generator=None):
        """(times (N, L+1), latents): each time picked while sampling, by the Beta means or modes
        (generator None), else drawn as Stepper takes its draws."""
        stepper = Stepper(self, backbone, cond, generator)
        latents = run_stepwise(backbone, noise, cond, self.steps, stepper)
        return stepper.times(), latents

    def forward(self, latent, text, text_mask, pooled, time, step, embedding=None):
        # latent (N, 2C, H, W) or the hidden states (N, 2D, h, w); time (N,) t_l; step: an int or
        # (N,) step indices; embedding (N, E): the denoiser's timestep embedding (inputs="hidden")
        step = torch.as_tensor(step, device=latent.device).expand(len(latent))
        given = [value.float() for value in (pooled, embedding) if value is not None]
        pooled = torch.cat([*given, time_features(time.to(latent.device), step, self.steps)], -1)
        logits = self.head(self.encode(latent, text, text_mask, pooled)) + self.rate_logits[step]
        return 1.0 + logits.clamp(max=30.0).exp()  # (N, 2) alpha, beta; exp(30) keeps it finite


def beta_log_prob(parameters, pair):
    """log pi (N,), the sum over the steps of log Beta(r | alpha, beta): parameters and the pair
    (r, 1 - r) are (N, L, 2); a Beta is the Dirichlet of two components (policy.log_prob)."""
    per_step = log_prob(parameters.flatten(0, 1), pair.flatten(0, 1)[:, None, :])[:, 0]  # (N L,)
    return per_step.view(len(pair), -1).sum(1)


def run_stepwise(backbone, noise, cond, steps, decide):
    """rollout.run_schedule with each next time chosen after the model call at t_l, from t_0 = 1:
    decide(step, t, state, estimate) -> t_{l+1} (N,) sees the state at unit scale, x / sqrt(s^2 +
    1) (SD-XL's model input; a factor in [0.71, 1] for the flows), and the model's prediction of
    the clean sample, x - s * derivative (flows: x = (1 - t) x_0 + t n with velocity n - x_0;
    SD-XL: x = x_0 + sigma n with the predicted noise). Returns the final latents."""
    t = torch.ones(len(noise), device=noise.device)
    derivative, state, level = backbone.ode(noise, cond, t)
    level = level or (lambda t: t)
    view = (-1,) + (1,) * (state.dim() - 1)
    for step in range(steps):
        slope = derivative(state, t).float()
        s = level(t).to(torch.float32).view(view)
        chosen = decide(step, t, state / (s**2 + 1).sqrt(), state - s * slope)
        state = state + (level(chosen).to(torch.float32).view(view) - s) * slope
        t = chosen
    return state


class Stepper:
    """run_stepwise's `decide` for a step-wise policy: a rate r_l at each step, deterministic when
    draws is None, else drawn from one generator or one per sample, recorded for the update."""

    def __init__(self, policy, backbone, cond, draws=None):
        self.policy, self.backbone, self.cond, self.draws = policy, backbone, cond, draws
        self.read = hidden_states(backbone) if policy.inputs == "hidden" else None  # last call's
        self.steps = []  # per step: the policy's inputs, its Beta, the rate pair and t_{l+1}
        self.prompt = None

    def __call__(self, step, t, state, estimate):
        if self.prompt is None:  # the prompt's inputs: the same at every step
            self.prompt = self.backbone.policy_inputs(state, self.cond)
            del self.prompt["latent"]
        if self.read:
            # kept in the backbone's dtype (memory), and read so both at rollout and update
            latent, embedding = (value.to(self.backbone.dtype) for value in self.read())
            inputs = dict(latent=latent, embedding=embedding)
        else:
            image = self.backbone.as_image  # Flux: its packed tokens as an image
            inputs = dict(latent=torch.cat([image(state), image(estimate)], dim=1).float())
        parameters = self.policy(**inputs, **self.prompt, time=t, step=step)  # (N, 2)
        if self.draws is None:  # the mode (alpha - 1) / (alpha + beta - 2), or the mean
            mode = self.policy.inference == "mode"
            pair = mean_increments(parameters - 1.0 if mode else parameters)
        else:
            pair = sample_increments(parameters, 1, self.draws)[:, 0]
        chosen = (t.float() * pair[:, 0]).to(t.dtype)  # t_{l+1} = r_l t_l
        self.steps.append(dict(inputs, time=t, parameters=parameters, pair=pair, next=chosen))
        return chosen

    def times(self):
        """(N, L+1): t_0 = 1 and the times chosen."""
        return torch.stack([self.steps[0]["time"], *(step["next"] for step in self.steps)], dim=1)

    def record(self):
        """What trajectory_log_prob needs, per sample: latent (N, L, 2C, H, W) or the hidden
        states (N, L, 2D, h, w) with the timestep embedding (N, L, E), time (N, L), pair (N, L, 2),
        the prompt inputs; and times (N, L+1), parameters (N, L, 2) and log pi when drawn (N,)."""
        keys = [key for key in self.steps[0] if key != "next"]
        stacked = {key: torch.stack([step[key] for step in self.steps], dim=1) for key in keys}
        logp = beta_log_prob(stacked["parameters"], stacked["pair"])
        return dict(stacked, **self.prompt, times=self.times(), logp=logp)


def join_records(records):
    """The records of several rollout parts, as one."""
    return {key: torch.cat([record[key] for record in records]) for key in records[0]}


def trajectory_log_prob(policy, record, index=slice(None)):
    """log pi(schedule) (count,) of the samples `index` of a record (Stepper.record), with
    gradients: one policy call over all (sample, step) pairs (DDP: one forward per backward)."""
    picked = {key: value[index] for key, value in record.items()}
    count, steps = picked["time"].shape
    keys = ("text", "text_mask", "pooled")  # the prompt's inputs, repeated for each step
    prompt = {key: picked[key].repeat_interleave(steps, 0) for key in keys}
    states = {key: picked[key].flatten(0, 1) for key in ("latent", "embedding") if key in picked}
    step = torch.arange(steps, device=picked["time"].device).repeat(count)
    parameters = policy(**states, **prompt, time=picked["time"].flatten(), step=step)
    return beta_log_prob(parameters.view(count, steps, 2), picked["pair"])


class StepwiseRollouts:
    """K schedules per context from a step-wise policy, drawn inside the sampling loop (Stepper):
    the interface policy.DirichletRollouts describes. Each sample draws from its own generator,
    seeded from its context's, so its schedule does not depend on how the batch is split."""

    def __init__(self, policy, backbone, noise, cond, generators, rollouts):
        seeds = torch.cat([torch.randint(2**62, (rollouts,), generator=g) for g in generators])
        self.draws = [torch.Generator().manual_seed(seed) for seed in seeds.tolist()]
        self.policy = getattr(policy, "module", policy)  # not DDP's: sampling takes no gradients
        self.backbone, self.records = backbone, []

    def sample(self, part, noise, cond):
        stepper = Stepper(self.policy, self.backbone, cond, [self.draws[i] for i in part])
        latents = run_stepwise(self.backbone, noise, cond, self.policy.steps, stepper)
        self.records.append(stepper.record())
        return latents

    def record(self):
        """The records of every part sampled, joined into one."""
        if len(self.records) > 1:
            self.records = [join_records(self.records)]
        return self.records[0]

    logp = property(lambda self: self.record()["logp"])
    concentration = property(lambda self: self.record()["parameters"].sum(-1).mean())  # each Beta's
    stop_margin = property(lambda self: self.record()["times"][:, -1].mean())

    def log_prob(self, policy, index=slice(None)):
        return trajectory_log_prob(policy, self.record(), index)


# -----------------------------------------------------------------------------
# PPO as TPDM's trainer takes it (src/train/rloo_trainer.py, on TRL 0.11's RLOO trainer): the update
# of `train.py --optimizer ppo`, and TPDM's settings, which that flag makes the defaults.

# TPDM's settings: unnormalised RLOO advantages (src/train/rloo_trainer.py); Adam(0.9, 0.99), eps
# 1e-5, no weight decay, a constant rate (scripts/launch_sd3_train.sh)
TPDM = dict(baseline="rloo", weight_decay=0.0, lr_decay="constant", adam_beta2=0.99, adam_eps=1e-5)
# ... and the step-wise policy's head bias, inputs and inference (modeling_sd3_pnt.py)
TPDM_STEPWISE = dict(init="tpdm", policy_inputs="hidden", inference="mode")
# TPDM's lr (1e-6 for SD3's head) does not transfer to this network: the backbone's REINFORCE rate
# times this factor, not tuned (evidence/comparator_study.py tunes --lr; docs/COMPARATOR.md)
LR_FACTOR = 1 / 30


def preset(given, values, spec):
    """The values --optimizer ppo puts over a backbone's preset (`values`, train.PRESETS): TPDM's
    settings and lr; the sampler's state as inputs on an exact mixture, which has no hidden
    states. `given`: the command line's values."""
    chosen = dict(TPDM, lr=values["lr"] * LR_FACTOR)
    if given.get("policy") == "stepwise":
        chosen.update(TPDM_STEPWISE)
        if spec["family"] == "mixture":
            chosen["policy_inputs"] = "sampler"
    return chosen


def policy_options(config, backbone):
    """The step-wise policy's constructor options of a run (policy.make_policy), the sizes of the
    backbone's hidden states among them when it reads them."""
    options = dict(inputs=config.policy_inputs, inference=config.inference, init=config.init)
    return options | hidden_dims(backbone) if config.policy_inputs == "hidden" else options


def ppo_objective(logp, logp_old, advantages, clip):
    """PPO's clipped surrogate loss (Schulman et al. 2017), to minimise, and the fraction clipped:
        -mean(min(rho A, clip(rho, 1 - eps, 1 + eps) A)),   rho = exp(log pi - log pi_old)
    one ratio per schedule (its only reward is the final image's)."""
    ratio = (logp - logp_old.detach()).exp()
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).mean()
    return loss, (clipped != ratio).float().mean().detach()


def ppo_update(config, iteration, rollouts, policy, advantages, optimizer):
    """PPO's update on one batch (train.py's --optimizer ppo): ppo_epochs passes over a shuffle
    seeded by the run's seed and iteration, one clipped optimiser step per minibatch against log pi
    as drawn; advantages (N,) r - b. Returns the last loss and grad norm, and the fraction clipped
    in the last pass."""
    shuffle = torch.Generator().manual_seed(config.seed * 1_000_003 + iteration)
    for _ in range(config.ppo_epochs):
        order = torch.randperm(len(advantages), generator=shuffle).to(advantages.device)
        clipped = []
        for index in order.chunk(config.ppo_minibatches):
            logp, logp_old = rollouts.log_prob(policy, index), rollouts.logp[index]
            loss, fraction = ppo_objective(logp, logp_old, advantages[index], config.ppo_clip)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), config.grad_clip)
            optimizer.step()
            clipped.append(fraction * len(index))
    return loss, grad_norm, (sum(clipped) / len(advantages)).item()
