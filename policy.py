"""
The schedule policy pi(tau | x_T, c) of the paper: one forward pass from the initial noise x_T and
the prompt c to the concentrations alpha of a Dirichlet over the L+1 time increments.

The action is tau ~ Dirichlet(alpha) on the simplex of dimension L+1; its schedule for L steps is
`times` (..., L+1): 1 = t_0 > t_1 > ... > t_L > 0, t_l = 1 - (tau_1 + ... + tau_l), so the last
increment tau_{L+1} = t_L (at least TAU_FLOOR) is the learnable stop margin: sampling ends at t_L.

SchedulePolicy, instance-level: multi-scale conv blocks over x_T, modulated by the pooled prompt
embedding (FiLM), cross-attending to the prompt's token embeddings; an MLP maps the mean token to
alpha = softplus(.) + ALPHA_MIN. GlobalPolicy: one schedule for every context (the ablation). Both
start at `initial_logits`' increments for every input (a default schedule, or equal ones) with
sum(alpha) = concentration (why: docs/DESIGN.md) and answer train.py's loop with DirichletRollouts.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from huggingface_hub import PyTorchModelHubMixin

# softplus(.) + ALPHA_MIN keeps every concentration positive (the paper's policy head).
ALPHA_MIN = 1e-3
# Smallest increment a sampled or mean schedule may have. Dirichlet draws underflow with small alpha
# (a Gamma(0.01) draw is below 1e-30 about half of the time), and two float32 times closer than the
# float32 spacing near 1 (1.2e-7) would be equal; 1e-6 keeps every schedule strictly decreasing.
TAU_FLOOR = 1e-6
# The README.md that save_pretrained writes beside config.json, not the mixin's placeholder one
MODEL_CARD = """
---
{{ card_data }}
---

A sampling-schedule policy: for an initial noise and a prompt it proposes when a frozen
text-to-image sampler takes its L steps. Trained with
REINFORCE and a James-Stein baseline, after Yu et al., "Designing Instance-Level Sampling Schedules
via REINFORCE with James-Stein Shrinkage" (CVPR 2026, {{ paper_url }}). config.json names the
backbone, L and the training configuration. Load it with `evaluate.load_policy(folder or repo id)`
and sample with `backbones.pipeline.generate(pipe, policy, prompt)`, from the reference
implementation of the paper that trained it (library `instance-schedules`).
"""
HUB = dict(
    model_card_template=MODEL_CARD,
    paper_url="https://arxiv.org/abs/2511.22177",
    library_name="instance-schedules",
    tags=["arxiv:2511.22177", "sampling-schedule", "text-to-image"],
)


def times_from_increments(tau):
    """tau (..., L+1) on the simplex -> times (..., L+1): t_0 = 1, t_l = 1 - (tau_1 + ... + tau_l),
    computed as tau_{l+1} + ... + tau_{L+1} in float64 so that t_L equals the stop margin tau_{L+1}
    exactly (1 - cumsum would round a 1e-7 margin to 0 in float32) and t_l - t_{l+1} = tau_{l+1}."""
    remaining = tau.double().flip(-1).cumsum(-1).flip(-1)  # (..., L+1), remaining[l] = sum(tau[l:])
    times = torch.cat([torch.ones_like(remaining[..., :1]), remaining[..., 1:]], dim=-1)
    return times.to(tau.dtype)


def increments_from_times(times):
    """times (..., L+1) with t_0 = 1 -> tau (..., L+1): tau_l = t_{l-1} - t_l, the last is t_L."""
    return torch.cat([times[..., :-1] - times[..., 1:], times[..., -1:]], dim=-1)


# ---- the Dirichlet action distribution
@torch.no_grad()
def sample_increments(alpha, rollouts, generator=None):
    """alpha (N, L+1) -> tau (N, rollouts, L+1) float32: K = rollouts Dirichlet draws per row.

    `generator`: one for every draw, or a list of one per row (train.py: each context draws from its
    own, so that a context's draws depend neither on the batch nor on the number of ranks). Drawn in
    float64 on the generators' device (then moved to alpha's), so a CPU generator gives the same
    schedules on any device. Gamma draws are taken in log space, log G(a) = log G(a+1) + log(U)/a
    (Marsaglia & Tsang), and normalised with a softmax: a plain Gamma(1e-3) draw underflows to 0
    even in float64, and a row of zeros would give NaN. Flooring at TAU_FLOOR and renormalising
    changes only draws below 1e-6, so the gradient is biased only where such draws are common:
    P(tau_i < 1e-6) ~ 1e-6 ** a / (a B(a, A - a)), 1e-4 at a = alpha_i = 1 and A = sum(alpha) = 100.
    """
    rows = generator if isinstance(generator, (list, tuple)) else [generator]
    device = rows[0].device if rows[0] is not None else alpha.device
    concentration = alpha.detach().to(device=device, dtype=torch.float64)
    concentration = concentration[:, None, :].expand(-1, rollouts, -1).contiguous()  # (N, K, L+1)
    parts = concentration.split(1) if len(rows) > 1 else [concentration]
    uniform, gamma = [], []
    for part, draws in zip(parts, rows):  # each row's draws from its own generator, in this order
        uniform.append(torch.rand(part.shape, generator=draws, device=device, dtype=part.dtype))
        # torch._standard_gamma is what Gamma.sample uses, called directly: it takes a generator
        gamma.append(torch._standard_gamma(part + 1.0, generator=draws))
    log_gamma = torch.cat(gamma).log() + (1.0 - torch.cat(uniform)).log() / concentration
    tau = torch.softmax(log_gamma, dim=-1).clamp_min(TAU_FLOOR)
    tau = tau / tau.sum(-1, keepdim=True)
    return tau.to(device=alpha.device, dtype=torch.float32)


def mean_increments(alpha):
    """alpha (N, L+1) -> the Dirichlet mean alpha / sum(alpha) (N, L+1), the deterministic schedule,
    floored at TAU_FLOOR and renormalised like the samples: strictly decreasing in float32 even
    where one concentration is 1e7 times smaller than the sum."""
    mean = (alpha / alpha.sum(-1, keepdim=True)).clamp_min(TAU_FLOOR)
    return mean / mean.sum(-1, keepdim=True)


def log_prob(alpha, tau):
    """Joint Dirichlet log-density log pi(tau | alpha): alpha (N, L+1), tau (N, K, L+1) -> (N, K).

    A SUM over the L+1 components including the normaliser,
        sum_i (alpha_i - 1) log tau_i + lgamma(sum_i alpha_i) - sum_i lgamma(alpha_i),
    not a mean over steps: REINFORCE needs the gradient of the log-probability of the whole action.
    Computed in float64 (lgamma(sum alpha) and sum lgamma(alpha) nearly cancel when alpha is large);
    the gradient flows to alpha; tau is clamped at TAU_FLOOR so log tau stays finite.
    """
    concentration = alpha.double()[:, None, :]  # (N, 1, L+1)
    log_tau = tau.detach().double().clamp_min(TAU_FLOOR).log()  # (N, K, L+1)
    normaliser = torch.lgamma(concentration.sum(-1)) - torch.lgamma(concentration).sum(-1)  # (N, 1)
    return (((concentration - 1.0) * log_tau).sum(-1) + normaliser).float()


class DirichletRollouts:
    """K schedules per context drawn before the sampling loop runs, and their log-probability:
        rollouts.sample(part, noise, cond) -> latents of the samples `part` (L model calls)
        rollouts.log_prob(policy, index) -> (len,) log pi of those schedules, with gradients
        rollouts.logp (N,): log pi of each schedule as drawn; rollouts.concentration and
        rollouts.stop_margin: the means that train.py logs
    Samples are context-major (N = contexts x K), each context's K drawn by its own generator. The
    policy's forward pass keeps its graph (the backbone's sampling runs without) for log pi."""

    def __init__(self, policy, backbone, noise, cond, generators, rollouts):
        self.backbone, self.inputs = backbone, backbone.policy_inputs(noise, cond)
        self.alpha = policy(**self.inputs)  # (B, L+1) Dirichlet concentrations, with gradients
        alpha = self.alpha.detach()
        self.tau = sample_increments(alpha, rollouts, generators)  # (B, K, L+1), detached
        self.times = times_from_increments(self.tau).flatten(0, 1)  # (B K, L+1)
        self.logp = log_prob(alpha, self.tau).flatten()  # (B K,)
        self.concentration = alpha.sum(-1).mean()
        self.stop_margin = mean_increments(alpha)[:, -1].mean()  # the mean t_L

    def sample(self, part, noise, cond):
        return self.backbone.sample(noise, cond, self.times[part])

    def log_prob(self, policy, index=slice(None)):
        """The Dirichlet log-density of the drawn increments `index`, with gradients: through the
        rollout's own forward pass the first time (REINFORCE's one step), through the policy run
        again after that (an update of several steps, the policy having moved)."""
        alpha, self.alpha = self.alpha, None
        if alpha is None or not alpha.requires_grad:
            alpha = policy(**self.inputs)
        return log_prob(alpha, self.tau).flatten()[index]


def initial_logits(steps, init, init_times, concentration, stop_margin):
    """The head's output bias (L+1,) float64 on CPU: softplus(bias) + ALPHA_MIN = alpha_init.

    alpha_init = concentration * increments (module docstring). For "default" the last increment
    t_L, 0 in a default schedule and impossible for a Dirichlet, is raised to at least stop_margin
    and all renormalised: every time t maps to (t + stop_margin) / (1 + stop_margin), within
    stop_margin of the default. Only the last: a shifted 80-step schedule's first are below 0.005.
    """
    if init == "uniform":
        increments = torch.full((steps + 1,), 1.0 / (steps + 1), dtype=torch.float64, device="cpu")
    else:
        assert init == "default", f'init must be "default" or "uniform", got {init!r}'
        if init_times is None:
            raise ValueError('init="default" needs init_times, the default schedule (L+1,)')
        times = torch.as_tensor(init_times, dtype=torch.float64, device="cpu").clone()
        # Learned schedules always start from pure noise, t_0 = 1. SD-XL's "leading" spacing starts
        # its default below that (t_0 = 981/999 at 50 steps): its first step then starts from 1.
        times[0] = 1.0
        if times.shape != (steps + 1,) or (times[1:] >= times[:-1]).any() or times[-1] < 0:
            wanted = f"{steps + 1} strictly decreasing times down to >= 0"
            raise ValueError(f"init_times must be {wanted}, got {times.tolist()}")
        increments = increments_from_times(times)
        increments[-1] = increments[-1].clamp_min(stop_margin)
        increments = increments / increments.sum()
    target = concentration * increments - ALPHA_MIN  # softplus(bias) must equal this
    if target.min() <= 0:
        raise ValueError(
            f"every initial concentration must exceed {ALPHA_MIN}: concentration "
            f"{concentration} x smallest increment {increments.min().item():.3g}; "
            "raise the concentration"
        )
    # inverse softplus log(exp(y) - 1) as y + log(1 - exp(-y)): accurate for y = 1e-6 and y = 1e4
    return target + torch.log(-torch.expm1(-target))


def json_times(init_times):
    """init_times as a plain list of floats (or None), so that `.config` stays JSON-able."""
    return None if init_times is None else torch.as_tensor(init_times, dtype=torch.float64).tolist()


# ---- the network
class ResBlock(nn.Module):
    """Pre-norm residual block of two 3x3 convolutions at fixed resolution and width."""

    def __init__(self, channels):
        super().__init__()
        groups = math.gcd(32, channels)  # 32 groups where the width allows it
        self.norm1 = nn.GroupNorm(groups, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        return x + self.conv2(F.silu(self.norm2(h)))


class CrossAttentionBlock(nn.Module):
    """Noise tokens (queries) read the prompt tokens (keys and values, masked), then an MLP."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm_query = nn.LayerNorm(dim)
        self.norm_context = nn.LayerNorm(dim)
        self.query = nn.Linear(dim, dim)
        self.key_value = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, context, context_mask):
        # x (N, Q, D) noise tokens; context (N, S, D) prompt tokens; context_mask (N, S), True: use
        batch, queries, dim = x.shape
        heads, head_dim = self.heads, dim // self.heads
        q = self.query(self.norm_query(x)).view(batch, queries, heads, head_dim).transpose(1, 2)
        # one projection for keys and values: (N, S, 2D) -> (N, S, 2, H, Dh) -> (2, N, H, S, Dh)
        key_value = self.key_value(self.norm_context(context)).view(batch, -1, 2, heads, head_dim)
        k, v = key_value.permute(2, 0, 3, 1, 4)
        mask = context_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (N, H, Q, Dh)
        x = x + self.out(y.transpose(1, 2).reshape(batch, queries, dim))
        return x + self.mlp(self.norm_mlp(x))


class SchedulePolicy(nn.Module, PyTorchModelHubMixin, **HUB):
    """Instance-level policy: (x_T, prompt) -> Dirichlet concentrations alpha (N, L+1), float32.
    Keep it in float32; inputs may come in any float dtype (bf16 from the backbone) and are cast."""

    def __init__(
        self,
        steps,
        latent_channels,
        text_dim,
        pooled_dim=None,
        widths=(16, 32),
        dim=64,
        heads=4,
        depth=1,
        grid=2,
        head_hidden=128,
        init="uniform",
        init_times=None,
        concentration=100.0,
        stop_margin=5e-3,
        backbone=None,
        training_config=None,
        kind="instance",  # as config.json names it (the subclasses are the other kinds)
    ):
        super().__init__()
        # what it was trained for (None when unknown), which save_policy records with the weights
        self.backbone, self.training_config = backbone, training_config
        reads = dict(latent_channels=latent_channels, text_dim=text_dim, pooled_dim=pooled_dim)
        self.config = dict(kind="instance", steps=steps)
        self.config.update({name: reads[name] for name in self.backbone_inputs})  # a global: none
        self.config.update(widths=list(widths), dim=dim, heads=heads, depth=depth, grid=grid)
        self.config.update(head_hidden=head_hidden, init=init, init_times=json_times(init_times))
        self.config.update(concentration=concentration, stop_margin=stop_margin)
        self.steps, self.grid = steps, grid
        assert dim % heads == 0, f"dim {dim} must be a multiple of heads {heads}"

        # noise: a stem at full resolution, then one stage per width, each halving the resolution
        self.stem = nn.Conv2d(latent_channels, widths[0], 3, padding=1)
        self.downsample, self.stages = nn.ModuleList(), nn.ModuleList()
        for previous, width in zip([widths[0], *widths], widths):
            self.downsample.append(nn.Conv2d(previous, width, 3, stride=2, padding=1))
            self.stages.append(ResBlock(width))
        # every scale contributes to every token: pooled to the grid, projected to dim, summed
        self.to_tokens = nn.ModuleList(nn.Conv2d(width, dim, 1) for width in widths)
        # unit scale, as the features': else where a feature is would not survive the token mean
        self.position = nn.Parameter(torch.randn(grid * grid, dim))

        # prompt: T5 embeddings have large, uneven scales, so layer-norm them before projecting
        self.text_norm = nn.LayerNorm(text_dim)
        self.text_proj = nn.Linear(text_dim, dim)
        # a learned token every query may attend to: a prompt with every token masked is still valid
        self.null_token = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        film = (nn.LayerNorm(pooled_dim), nn.Linear(pooled_dim, 2 * dim)) if pooled_dim else None
        self.pooled_proj = nn.Sequential(*film) if film else None  # FiLM: a scale and a shift
        self.blocks = nn.ModuleList(CrossAttentionBlock(dim, heads) for _ in range(depth))

        hidden = (nn.LayerNorm(dim), nn.Linear(dim, head_hidden), nn.SiLU())
        self.head = nn.Sequential(*hidden, nn.Linear(head_hidden, steps + 1))
        bias = initial_logits(steps, init, init_times, concentration, stop_margin)
        with torch.no_grad():
            self.head[-1].weight.normal_(0.0, 0.01)  # alpha starts near one value for all inputs
            self.head[-1].bias.copy_(bias)

    def forward(self, latent, text, text_mask, pooled=None):
        return F.softplus(self.head(self.encode(latent, text, text_mask, pooled))) + ALPHA_MIN

    # What make_policy, train.py, evaluate.py and sample.py ask of every policy
    backbone_inputs = ("latent_channels", "text_dim", "pooled_dim")  # of Backbone.policy_dims
    described = ("learned (Dirichlet mean)", "learned (one Dirichlet draw)")  # mean, drawn
    pipeline_refusal = None  # a stock pipeline runs its times (backbones/pipeline.py)
    # rollouts(policy, ...): `policy`, this module or its DDP wrapper, gives log pi its gradients
    rollouts = DirichletRollouts

    def times(self, backbone, noise, cond, generator=None):
        """(N, L+1) the contexts' schedules: the Dirichlet mean, or one draw each by `generator`."""
        alpha = self(**backbone.policy_inputs(noise, cond))  # (N, L+1)
        if generator is None:
            return times_from_increments(mean_increments(alpha))
        return times_from_increments(sample_increments(alpha, 1, generator)[:, 0])

    schedule = times  # the sampler runs them (evaluate.run_method); TPDM's policy samples itself

    def encode(self, latent, text, text_mask, pooled=None):
        """The mean token (N, dim) that the head reads (a subclass may read other inputs)."""
        assert (pooled is None) == (self.pooled_proj is None), "pooled given iff built with it"
        # x_T as drawn, N(0, I) (Backbone.policy_inputs; SD-XL scales it later), not normalised per
        # sample: its norm and mean are information (on digits-noise the mean's sign is the signal)
        latent, text = latent.float(), text.float()

        features = self.stem(latent)
        tokens = 0  # (N, dim, grid, grid), summed over the scales
        for downsample, stage, to_tokens in zip(self.downsample, self.stages, self.to_tokens):
            features = stage(downsample(features))
            tokens = tokens + to_tokens(F.adaptive_avg_pool2d(features, self.grid))
        tokens = tokens.flatten(2).transpose(1, 2) + self.position  # (N, grid*grid, dim)

        if pooled is not None:
            scale, shift = self.pooled_proj(pooled.float())[:, None, :].chunk(2, dim=-1)
            tokens = tokens * (1 + scale) + shift

        context = self.text_proj(self.text_norm(text))  # (N, S, dim)
        null = self.null_token.expand(len(context), -1, -1)
        context = torch.cat([null, context], dim=1)  # (N, 1+S, dim)
        context_mask = F.pad(text_mask.bool(), (1, 0), value=True)  # the null token: always
        for block in self.blocks:
            tokens = block(tokens, context, context_mask)

        return tokens.mean(1)


class GlobalPolicy(SchedulePolicy):
    """One schedule for every context (the ablation): the instance-level network, at the same size
    and start, read on constant inputs (a zero latent on the token grid, an empty prompt): it learns
    with the same optimiser and learning rate, nothing but the context taken away."""

    backbone_inputs = ()  # it reads none: its sizes are the network's only

    def __init__(self, steps, **arguments):
        super().__init__(steps, latent_channels=1, text_dim=1, **arguments)
        self.config.update(kind="global")
        # the constant input: a latent the conv stages take down to the token grid exactly
        self.side = self.grid * 2 ** len(self.config["widths"])

    def forward(self, latent, text=None, text_mask=None, pooled=None):
        """The same concentrations (N, L+1) for the N contexts of `latent`, whatever they are."""
        zeros = torch.zeros(1, 1, 1, device=self.head[-1].bias.device)
        constant = zeros.expand(1, 1, self.side, self.side)  # a latent on the token grid
        alpha = super().forward(constant, zeros, zeros[0].bool())  # an empty prompt; (1, L+1)
        return alpha.expand(len(latent), -1)


# ---- a policy built for a backbone, and saved
# Network sizes, named in backbones.BACKBONES ("policy"): "real", the paper's "about 20M parameters,
# under 1% of the sampler"; "embedded", for the 8x8 embedded backbones and the miniatures.
NETWORKS = {
    "real": dict(widths=[64, 128, 256, 512], dim=512, heads=8, depth=3, grid=8, head_hidden=1024),
    "embedded": dict(widths=[16, 32], dim=64, heads=4, depth=1, grid=2, head_hidden=128),
}


def make_policy(policy_cls, backbone_dims, steps, init_times=None, network="embedded", **options):
    """A policy of class `policy_cls` (a value of evaluate.POLICIES) for a backbone (`backbone_dims`
    = Backbone.policy_dims), sized by NETWORKS[network]; it starts at the default schedule
    `init_times` (L+1,) when given, else at equal increments."""
    start = dict(init="uniform")
    if init_times is not None:  # a list: the Hub mixin records no tensor in a bare config.json
        start = dict(init="default", init_times=json_times(init_times))
    arguments = start | NETWORKS[network] | options  # options win: the comparator's init
    dims = {key: backbone_dims.get(key) for key in policy_cls.backbone_inputs}
    return policy_cls(steps, **dims, **arguments)


def save_policy(folder, policy, config):
    """The policy in the Hub format: config.json holds its constructor arguments, the backbone and
    train.py's configuration `config` (with the iteration); model.safetensors its weights;
    evaluate.load_policy loads it back."""
    arguments = dict(policy.config, backbone=config["backbone"], training_config=config)
    policy.save_pretrained(folder, config=arguments)
