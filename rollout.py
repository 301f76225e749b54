"""
Frozen backbones and the one sampling loop that executes a schedule exactly.

A schedule for L steps is a tensor `times` of shape (N, L+1), 1 >= t_0 > t_1 > ... > t_L >= 0, in
the backbone's own noise level: the flow-matching sigma for SD3.5, Flux and the embedded backbones;
for SD-XL a continuous timestep t * 999 whose sigma is interpolated from the model's noise table
(t = 0 is sigma 0). The frozen model is called at t_0 .. t_{L-1}; first-order steps go to t_1 .. t_L:

    x <- x + (s(t_{l+1}) - s(t_l)) * derivative(x, t_l)      s = sigma (identity for flows)

No scheduler shift is applied on top of the given times. `default_times(L)` returns exactly what the
diffusers pipeline runs with num_inference_steps=L, and with those times `sample` reproduces the
pipeline's own latents (tests/test_rollout_diffusers.py).

    backbone = load_backbone("digits")                  # or any name in BACKBONES
    cond = backbone.encode_prompts(backbone.prompts)    # once per prompt, then repeat_interleave
    noise = backbone.sample_noise(10, torch.Generator().manual_seed(0))
    latents = backbone.sample(noise, cond, backbone.default_times(4).expand(10, -1))
    images = backbone.decode(latents)                   # (N, 3, H, W) in [0, 1]
"""
import inspect
import os
import socket
import urllib.parse

import torch

REPOSITORY = os.path.dirname(os.path.abspath(__file__))
# Every per-backbone model fact (train.py's TRAINING holds the training defaults). family: the class
# that runs it; hub_id: its diffusers weights; resolution: the image side; guidance: the true-CFG
# scale (SD3.5, SD-XL), the distilled guidance embedding (Flux-Dev) or None (no guidance input):
# the values recommended by the SD3.5 model cards (Medium 4.5, Large 3.5) and the SD-XL and Flux-Dev
# pipelines' defaults (5.0, 3.5). policy: the size in policy.PRESETS. threads: CPU threads (None:
# torch's default; the small backbones' tensors are tiny, so a second thread only adds contention).
REAL = dict(resolution=1024, policy="real", threads=None)
EMBEDDED = dict(family="mixture", hub_id=None, resolution=8, guidance=None, policy="embedded", threads=1)
MINIATURE = dict(hub_id=None, resolution=16, policy="embedded", threads=1,
                 prompts=("prompts/digit_train.txt", "prompts/digit_heldout.txt"))
BACKBONES = {
    "sd35m": dict(REAL, family="sd3", hub_id="stabilityai/stable-diffusion-3.5-medium", guidance=4.5),
    "sd35l": dict(REAL, family="sd3", hub_id="stabilityai/stable-diffusion-3.5-large", guidance=3.5),
    "sdxl": dict(REAL, family="sdxl", hub_id="stabilityai/stable-diffusion-xl-base-1.0", guidance=5.0),
    "flux-dev": dict(REAL, family="flux", hub_id="black-forest-labs/FLUX.1-dev", guidance=3.5),
    "flux-schnell": dict(REAL, family="flux", hub_id="black-forest-labs/FLUX.1-schnell", guidance=None),
    # The embedded backbones: (spread, std, shift) of each sub-population of a digit class, see MixtureBackbone.
    # digits: one population per class; the best schedule is nearly the same for every context.
    "digits": dict(EMBEDDED, populations=[[(1.0, 0.1, 0.0)]] * 10),
    # digits-prompt: sharp, spread-out digits 0-4 and blurred ones 5-9 want opposite schedules: the prompt says which.
    "digits-prompt": dict(EMBEDDED, populations=[[(1.5, 0.02, 0.0)]] * 5 + [[(1.0, 0.5, 0.0)]] * 5),
    # digits-noise: every class is a bright sharp half and a dark blurred half; the initial noise says which
    # (a weaker signal than the prompt).
    "digits-noise": dict(EMBEDDED, populations=[[(1.5, 0.02, 0.5), (1.0, 0.5, -0.5)]] * 10),
    # The trained miniatures (miniature.py): the real families' classes with shipped 16x16 digit
    # weights instead of a hub id; they run on a CPU. folder: their save_pretrained folder in this
    # repository; prompts: (training, held-out) paraphrase files; the reward reads their pixels.
    "mini-sd3": dict(MINIATURE, family="sd3", folder="miniatures/mini-sd3", guidance=4.0),
    "mini-flux": dict(MINIATURE, family="flux", folder="miniatures/mini-flux", guidance=3.5),
    "mini-sdxl": dict(MINIATURE, family="sdxl", folder="miniatures/mini-sdxl", guidance=5.0),
}


def update_cost(name, contexts, rollouts, steps, guidance=None):
    """One REINFORCE update in model evaluations and reward calls, as a line to print."""
    spec, samples = BACKBONES[name], contexts * rollouts
    guidance = spec["guidance"] if guidance is None else guidance
    cfg = spec["family"] in ("sd3", "sdxl") and guidance is not None and guidance > 1  # true CFG doubles each batch
    return (f"one update: B x K x L = {contexts} x {rollouts} x {steps} = {samples * steps:,} model evaluations"
            f"{' (each a CFG pair)' if cfg else ''}, {samples} reward calls")


class Backbone:
    """What every backbone offers; train.py, evaluate.py and the rewards use nothing else.

    Attributes: name, device, dtype (of the frozen model), resolution (image side), guidance,
    prompts (the built-in prompt list, or None: real models take any prompt), latent_shape, and
    policy_dims (latent_channels, text_dim, pooled_dim: what policy.make_policy needs).
    Methods:
      check_prompts(prompts): a one-line ValueError for a prompt it cannot take, before any work
      encode_prompts(prompts) -> cond: a dict of batch-first tensors (prompt_embeds (N, S, D),
          pooled_prompt_embeds (N, P), text_mask (N, S) True = a real token, and what the model needs)
      sample_noise(n, generator) -> the initial noise x_T, drawn as the pipeline draws it
      policy_inputs(noise, cond) -> the keyword arguments of the policy's forward, float32
      default_times(L) -> (L+1,) the schedule the pipeline runs with num_inference_steps=L
      sample(noise, cond, times) -> final latents; times (N, L+1), each row run exactly
      reference(noise, cond) -> an accurate solution from the same noise: the teacher
      decode(latents) -> images (N, 3, H, W) in [0, 1]
    """

    reference_steps = 50  # the teacher of the diffusers backbones: the default schedule at this many steps

    def check_prompts(self, prompts):
        pass  # a text encoder takes any prompt

    def sample_noise(self, n, generator=None):
        return torch.randn((n,) + self.latent_shape, generator=generator).to(self.device)

    def policy_inputs(self, noise, cond):
        """The noise as an image-shaped latent (N, C, H, W), the prompt's token embeddings with their
        mask, and the pooled embedding."""
        return dict(latent=noise.float(), text=cond["prompt_embeds"].float(), text_mask=cond["text_mask"],
                    pooled=cond["pooled_prompt_embeds"].float())

    def reference(self, noise, cond):
        return self.sample(noise, cond, self.default_times(self.reference_steps).expand(noise.shape[0], -1))


def run_schedule(derivative, state, times, level=None):
    """The one sampling loop: L first-order steps, exactly L calls of `derivative`.

    derivative(state, t) -> d state / d level at per-sample times t (N,); times (N, L+1);
    level(times) -> the integration variable (sigma for SD-XL; None = the times themselves).
    """
    levels = times if level is None else level(times)  # (N, L+1)
    levels = levels.to(state.device, torch.float32)
    times = times.to(state.device)
    view = (-1,) + (1,) * (state.dim() - 1)
    for step in range(times.shape[1] - 1):
        slope = derivative(state, times[:, step])
        state = state + (levels[:, step + 1] - levels[:, step]).view(view) * slope.float()
    return state


def _check_times(times, batch):
    if times.dim() != 2 or times.shape[0] != batch or times.shape[1] < 2:
        raise ValueError(f"times must have shape (N={batch}, L+1 >= 2), got {tuple(times.shape)}")


# ----------------------------------------------------------------------------------------------
# embedded backbones: exact flow-matching samplers for Gaussian mixtures over scikit-learn's 8x8 digits

DIGIT_TOKENS = 4  # prompt tokens: "a", "handwritten", the digit, one padding token (masked out)
DIGIT_WIDTH = 32  # width of the token embeddings
DIGIT_VOCAB = ["<pad>", "a", "handwritten"] + [str(d) for d in range(10)]


class MixtureBackbone(Backbone):
    """An embedded backbone: a class-conditional Gaussian mixture whose flow is known in closed form.

    Why it exists: it runs the same code path as the real models (prompts -> token embeddings,
    noise -> `run_schedule` -> latents -> decode -> reward), its optimum is known (the exact ODE
    solution, `reference`), and a whole training run takes a minute on a laptop CPU.

    Data: the 1,797 8x8 handwritten digits shipped with scikit-learn, pixels 0..16 rescaled to
    [-1, 1]. For "a handwritten d", with y_i the images of class d and m_d their mean, each
    sub-population (spread k, std s, shift b) of `populations[d]` puts one component N(mu_i, s^2 I)
    at mu_i = m_d + k (y_i - m_d) + b for every y_i; all components of a class weigh the same.
    With x_t = (1 - t) x_0 + t noise the marginal given component m is N((1 - t) mu_m, v_m I),
    v_m = (1 - t)^2 s_m^2 + t^2, and the velocity E[noise - x_0 | x_t] is

        v(x, t) = sum_m w_m [c_m (x - (1 - t) mu_m) - mu_m],    c_m = (t - (1 - t) s_m^2) / v_m,

    with posterior weights w = softmax_m(-|x - (1 - t) mu_m|^2 / (2 v_m) - (d/2) log v_m), d = 64.
    """

    reference_steps = 64  # RK4 steps of the teacher solve

    def __init__(self, name="digits", populations=BACKBONES["digits"]["populations"], device=None):
        from sklearn.datasets import load_digits  # the data ships inside scikit-learn, no download

        digits = load_digits()
        self.name, self.device, self.dtype = name, torch.device(device or "cpu"), torch.float32
        self.resolution, self.guidance, self.latent_shape = 8, None, (1, 8, 8)
        self.prompts = [f"a handwritten {d}" for d in range(10)]
        self.policy_dims = dict(latent_channels=1, text_dim=DIGIT_WIDTH, pooled_dim=DIGIT_WIDTH)
        pixels = torch.tensor(digits.images.reshape(-1, 64), dtype=torch.float64) / 8.0 - 1.0
        labels = torch.tensor(digits.target)
        classes = []  # per class: centres (M_d, 64) and stds (M_d,)
        for digit in range(10):
            members = pixels[labels == digit]
            mean = members.mean(0)
            classes.append((torch.cat([mean + spread * (members - mean) + shift for spread, _, shift in populations[digit]]),
                            torch.cat([torch.full((len(members),), float(std)) for _, std, _ in populations[digit]])))
        # Grouped by class and padded to the largest, so one batched matmul gives every sample the
        # logits of its own class only; padding has log-weight -1e30 (and a harmless std of 1).
        size = max(len(centres) for centres, _ in classes)
        self.centres = torch.zeros(10, size, 64, dtype=torch.float64)
        self.variances = torch.ones(10, size, dtype=torch.float64)  # s_m^2
        self.log_weights = torch.full((10, size), -1e30, dtype=torch.float64)
        for digit, (centres, stds) in enumerate(classes):
            self.centres[digit, : len(centres)] = centres
            self.variances[digit, : len(centres)] = stds**2
            self.log_weights[digit, : len(centres)] = 0.0
        # A fixed tiny text encoder: seeded word and position embeddings, so prompts are token
        # sequences that the policy cross-attends to, as with the real models.
        generator = torch.Generator().manual_seed(0)
        self.word_embeddings = torch.randn(len(DIGIT_VOCAB), DIGIT_WIDTH, generator=generator)
        self.position_embeddings = 0.1 * torch.randn(DIGIT_TOKENS, DIGIT_WIDTH, generator=generator)

    def check_prompts(self, prompts):
        unknown = [prompt for prompt in prompts if prompt not in self.prompts]
        if unknown:
            raise ValueError(f"{self.name} knows only the prompts 'a handwritten 0' .. 'a handwritten 9', got {unknown[0]!r}")

    def encode_prompts(self, prompts):
        self.check_prompts(prompts)
        ids = torch.tensor([[DIGIT_VOCAB.index(word) for word in prompt.split()] + [0] for prompt in prompts])  # (N, S)
        text_mask = ids != 0  # (N, S) True = token
        text = self.word_embeddings[ids] + self.position_embeddings  # (N, S, D)
        pooled = (text * text_mask[..., None]).sum(1) / text_mask.sum(1, keepdim=True)
        label = torch.tensor([self.prompts.index(prompt) for prompt in prompts])
        return dict(prompt_embeds=text.to(self.device), text_mask=text_mask.to(self.device),
                    pooled_prompt_embeds=pooled.to(self.device), label=label.to(self.device))

    def default_times(self, steps):
        return torch.linspace(1.0, 0.0, steps + 1)

    def mixture(self, label):
        """The components of each sample's class, float64: centres (N, M, 64), their squared norms,
        variances s_m^2 and log-weights (N, M) (padding: -1e30)."""
        centres = self.centres.to(label.device)[label]
        return (centres, centres.square().sum(2), self.variances.to(label.device)[label],
                self.log_weights.to(label.device)[label])

    def velocity(self, state, t, mixture):
        """Exact E[noise - x_0 | x_t = state] at per-sample times t (N,), in float64 (float32 logits
        would be off by about 1e-4); differentiable in state and t."""
        centres, norms, variances, log_weights = mixture
        x = state.reshape(state.shape[0], 64).double()
        t = t.double()[:, None]  # (N, 1)
        scale = 1.0 - t
        total = scale**2 * variances + t**2  # (N, M) v_m
        distance = x.square().sum(1, keepdim=True) - 2 * scale * torch.bmm(centres, x[:, :, None]).squeeze(2) + scale**2 * norms
        weights = torch.softmax(log_weights - distance / (2 * total) - 32 * total.log(), dim=1)  # (N, M) posterior
        coefficient = weights * (t - scale * variances) / total  # (N, M) w_m c_m
        mixed = torch.bmm(torch.stack([coefficient, weights], 1), centres)  # (N, 2, 64)
        velocity = coefficient.sum(1, keepdim=True) * x - scale * mixed[:, 0] - mixed[:, 1]
        return velocity.reshape(state.shape)

    def sample(self, noise, cond, times):
        """Differentiable in the times when they require grad (the oracle schedules of ablation.py)."""
        _check_times(times, noise.shape[0])
        mixture = self.mixture(cond["label"])
        return run_schedule(lambda x, t: self.velocity(x, t, mixture), noise.float(), times)

    @torch.no_grad()
    def reference(self, noise, cond):
        """Classical RK4 in float64 from t = 1 to 0 on a uniform grid. On digits its RMS error against
        a solve with 4096 steps is about 1e-6, far below any L-step sampler's; grids denser near t = 0
        did worse at equal cost."""
        steps = self.reference_steps
        grid = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64, device=self.device)
        state, mixture = noise.double(), self.mixture(cond["label"])
        field = lambda x, t: self.velocity(x, t.expand(x.shape[0]), mixture)
        for step in range(steps):
            t, h = grid[step], grid[step + 1] - grid[step]
            k1 = field(state, t)
            k2 = field(state + h / 2 * k1, t + h / 2)
            k3 = field(state + h / 2 * k2, t + h / 2)
            k4 = field(state + h * k3, t + h)
            state = state + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return state.float()

    def decode(self, latents):
        images = ((latents.detach().float() + 1.0) / 2.0).clamp(0.0, 1.0)
        return images.expand(-1, 3, -1, -1).contiguous()


# ----------------------------------------------------------------------------------------------
# diffusers backbones: the pipeline's own components, driven by `run_schedule`

DECODE_CHUNK = 4  # images per VAE decode call (a 1024^2 decode is memory-hungry)


class PipelineBackbone(Backbone):
    """What the three diffusers families share: the frozen pipeline, its model's device and dtype, the
    guidance (the pipeline's own default unless given), the resolution (the model's native one) and
    the chunked VAE decode; `vae_input(latents)` is each family's latent -> VAE input."""

    def __init__(self, pipe, model, name, resolution, guidance, multiple):
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.eval().requires_grad_(False)
        pipe.set_progress_bar_config(disable=True)
        self.pipe, self.model, self.name, self.prompts = pipe, model, name, None
        self.device, self.dtype = model.device, model.dtype
        self.guidance = _call_default(pipe, "guidance_scale") if guidance is None else guidance
        self.resolution = resolution or pipe.default_sample_size * pipe.vae_scale_factor
        if self.resolution % multiple:
            raise ValueError(f"{name}: resolution must be a multiple of {multiple}, got {self.resolution}")

    @torch.no_grad()
    def decode(self, latents):
        images = []
        for chunk in latents.split(DECODE_CHUNK):  # a 1024^2 decode is memory-hungry
            pixels = self.pipe.vae.decode(self.vae_input(chunk).to(self.pipe.vae.dtype), return_dict=False)[0]
            images.append((pixels.float() / 2 + 0.5).clamp(0, 1))  # as VaeImageProcessor.denormalize
        return torch.cat(images)


def _call_default(pipe, argument):
    """The pipeline's own default for a __call__ argument (guidance_scale, max_sequence_length)."""
    return inspect.signature(type(pipe).__call__).parameters[argument].default


def _text_length(pipe, t5_tokenizer):
    """The T5 sequence length: the pipeline's default max_sequence_length (256 for SD3.5, 512 for
    Flux), or its T5 tokenizer's model_max_length when that is shorter (the miniatures' 12; the real
    T5 tokenizers take 512)."""
    default = _call_default(pipe, "max_sequence_length")
    return min(default, t5_tokenizer.model_max_length) if t5_tokenizer is not None else default


def _token_mask(tokenizer, prompts, length):
    """(N, length) bool, True = a real token, exactly as the pipeline pads and truncates."""
    if tokenizer is None:
        return torch.zeros(len(prompts), length, dtype=torch.bool)
    tokens = tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    return tokens.attention_mask.bool()


def _cfg_batch(cond, *keys):
    """The tensors `keys` of cond stacked [negative; positive], as the pipelines batch true CFG."""
    return [torch.cat([cond["negative_" + key], cond[key]]) for key in keys]


def _guided(prediction, guidance):
    """Classifier-free guidance over a batch stacked [uncond; cond], as the pipelines write it."""
    uncond, cond = prediction.chunk(2)
    return uncond + guidance * (cond - uncond)


class SD3Backbone(PipelineBackbone):
    """Stable Diffusion 3 / 3.5 (rectified flow, MMDiT); t is the flow sigma, true CFG in one batch."""

    def __init__(self, pipe, name="sd3", resolution=None, guidance=None):
        multiple = pipe.vae_scale_factor * pipe.transformer.config.patch_size
        super().__init__(pipe, pipe.transformer, name, resolution, guidance, multiple)
        self.cfg = self.guidance > 1  # the pipeline's do_classifier_free_guidance
        self.text_length = _text_length(pipe, pipe.tokenizer_3)
        config = self.model.config
        self.latent_shape = (config.in_channels,) + (self.resolution // pipe.vae_scale_factor,) * 2
        self.policy_dims = dict(latent_channels=config.in_channels, text_dim=config.joint_attention_dim,
                                pooled_dim=config.pooled_projection_dim)

    @torch.no_grad()
    def encode_prompts(self, prompts, prompt_2=None, prompt_3=None, clip_skip=None, max_sequence_length=None):
        """The pipeline's encode_prompt; the options as its __call__ takes them (pipeline.generate)."""
        pipe, length = self.pipe, max_sequence_length or self.text_length
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=prompts, prompt_2=prompt_2, prompt_3=prompt_3, device=self.device, clip_skip=clip_skip,
            do_classifier_free_guidance=self.cfg, max_sequence_length=length)
        clip_mask = _token_mask(pipe.tokenizer, prompts, pipe.tokenizer_max_length)
        t5_mask = _token_mask(pipe.tokenizer_3, prompt_3 or prompts, length)
        cond = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled,
                    text_mask=torch.cat([clip_mask, t5_mask], dim=1).to(self.device))  # (N, 77 + T5 length)
        if self.cfg:
            cond.update(negative_prompt_embeds=negative, negative_pooled_prompt_embeds=negative_pooled)
        return cond

    def default_times(self, steps):
        # SD3Pipeline passes no sigmas: the scheduler's own spacing and its static shift (3.0 for SD3.5)
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        scheduler.set_timesteps(steps)
        return scheduler.sigmas.float()

    @torch.no_grad()
    def sample(self, noise, cond, times):
        _check_times(times, noise.shape[0])
        text, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if self.cfg:
            text, pooled = _cfg_batch(cond, "prompt_embeds", "pooled_prompt_embeds")
        copies = 2 if self.cfg else 1

        def velocity(state, t):
            prediction = self.model(
                hidden_states=state.to(self.dtype).repeat(copies, 1, 1, 1),
                timestep=(t * 1000).repeat(copies),  # the pipeline's timesteps = sigmas * 1000
                encoder_hidden_states=text, pooled_projections=pooled, return_dict=False)[0]
            return _guided(prediction, self.guidance) if self.cfg else prediction

        return run_schedule(velocity, noise.float(), times)

    def vae_input(self, latents):
        config = self.pipe.vae.config
        return latents / config.scaling_factor + config.shift_factor


class FluxBackbone(PipelineBackbone):
    """FLUX.1 dev / schnell (rectified flow, packed 2x2 latent tokens); t is the flow sigma.
    Flux-Dev takes the distilled guidance embedding, Flux-Schnell no guidance; no CFG batch."""

    def __init__(self, pipe, name="flux", resolution=None, guidance=None):
        super().__init__(pipe, pipe.transformer, name, resolution, guidance, pipe.vae_scale_factor * 2)
        config = self.model.config
        if not config.guidance_embeds:  # schnell: no guidance input, any value is ignored
            self.guidance = None
        self.text_length = _text_length(pipe, pipe.tokenizer_2)
        self.latent_size = self.resolution // pipe.vae_scale_factor  # unpacked latent height = width
        self.latent_channels = config.in_channels // 4
        self.latent_shape = (self.latent_channels, self.latent_size, self.latent_size)  # as the policy sees it
        self.policy_dims = dict(latent_channels=self.latent_channels, text_dim=config.joint_attention_dim,
                                pooled_dim=config.pooled_projection_dim)

    @torch.no_grad()
    def encode_prompts(self, prompts, prompt_2=None, max_sequence_length=None):
        """The pipeline's encode_prompt; the options as its __call__ takes them (pipeline.generate)."""
        length = max_sequence_length or self.text_length
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=prompt_2, device=self.device,
                                                    max_sequence_length=length)
        mask = _token_mask(self.pipe.tokenizer_2, prompt_2 or prompts, length)  # the T5 tokens
        return dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, text_mask=mask.to(self.device))

    def pack(self, latents):
        size = self.latent_size
        return self.pipe._pack_latents(latents, latents.shape[0], self.latent_channels, size, size)

    def unpack(self, tokens):
        return self.pipe._unpack_latents(tokens, self.resolution, self.resolution, self.pipe.vae_scale_factor)

    def sample_noise(self, n, generator=None):
        return self.pack(torch.randn((n,) + self.latent_shape, generator=generator)).to(self.device)  # (N, tokens, 4 C)

    def policy_inputs(self, noise, cond):
        return super().policy_inputs(self.unpack(noise), cond)  # the policy sees tokens unpacked to an image

    def default_times(self, steps):
        # FluxPipeline: sigmas linspace(1, 1/N, N), shifted by mu(image tokens); schnell's config has no shift
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.pipe.scheduler.config
        tokens = (self.latent_size // 2) ** 2
        mu = calculate_shift(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        scheduler = type(self.pipe.scheduler).from_config(config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        return scheduler.sigmas.float()

    @torch.no_grad()
    def sample(self, noise, cond, times):
        _check_times(times, noise.shape[0])
        count = noise.shape[0]
        patches = self.latent_size // 2
        image_ids = self.pipe._prepare_latent_image_ids(count, patches, patches, self.device, self.dtype)
        text_ids = torch.zeros(cond["prompt_embeds"].shape[1], 3, device=self.device, dtype=self.dtype)
        guidance = None if self.guidance is None else torch.full((count,), float(self.guidance), device=self.device)

        def velocity(state, t):
            return self.model(
                hidden_states=state.to(self.dtype), timestep=t.to(self.dtype), guidance=guidance,
                pooled_projections=cond["pooled_prompt_embeds"], encoder_hidden_states=cond["prompt_embeds"],
                txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0]

        return run_schedule(velocity, noise.float(), times)

    def vae_input(self, latents):
        config = self.pipe.vae.config
        return self.unpack(latents) / config.scaling_factor + config.shift_factor


class SDXLBackbone(PipelineBackbone):
    """Stable Diffusion XL (discrete-time, epsilon prediction) integrated as the Euler sampler does:
    the state is x = x_0 + sigma * noise, the model sees x / sqrt(sigma^2 + 1) at timestep t * 999,
    dx / dsigma = predicted noise, sigma(t) interpolated linearly in the model's noise table,
    sigma(0) = 0. True CFG in one batch; add_time_ids (size, crop, target size) ride in cond."""

    def __init__(self, pipe, name="sdxl", resolution=None, guidance=None):
        multiple = pipe.vae_scale_factor * 2 ** (len(pipe.unet.config.block_out_channels) - 1)
        super().__init__(pipe, pipe.unet, name, resolution, guidance, multiple)
        self.cfg = self.guidance > 1
        config = pipe.scheduler.config
        linear = config.interpolation_type == "linear" and not config.get("use_karras_sigmas")
        if config.prediction_type != "epsilon" or not linear:
            raise ValueError(f"{name}: only epsilon prediction with linear sigma interpolation is supported")
        alphas_cumprod = type(pipe.scheduler).from_config(config).alphas_cumprod
        self.noise_table = ((1 - alphas_cumprod) / alphas_cumprod).double() ** 0.5  # (1000,) sigma per timestep
        self.latent_shape = (self.model.config.in_channels,) + (self.resolution // pipe.vae_scale_factor,) * 2
        self.policy_dims = dict(latent_channels=self.model.config.in_channels,
                                text_dim=self.model.config.cross_attention_dim,
                                pooled_dim=pipe.text_encoder_2.config.projection_dim)

    def sigma(self, times):
        """sigma(t): linear interpolation of the noise table at timestep t * 999; t = 0 -> 0."""
        last = len(self.noise_table) - 1
        timestep = (times.float() * last).double().clamp(0, last)  # float32 product: integer timesteps stay exact
        low = timestep.floor().long().clamp(max=last - 1)
        weight = timestep - low
        table = self.noise_table.to(times.device)
        sigma = table[low] * (1 - weight) + table[low + 1] * weight
        return torch.where(times > 0, sigma, torch.zeros_like(sigma)).float()

    @torch.no_grad()
    def encode_prompts(self, prompts, prompt_2=None, clip_skip=None):
        """The pipeline's encode_prompt; the options as its __call__ takes them (pipeline.generate)."""
        pipe = self.pipe
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=prompts, prompt_2=prompt_2, device=self.device, do_classifier_free_guidance=self.cfg,
            clip_skip=clip_skip)
        size = (self.resolution, self.resolution)
        time_ids = pipe._get_add_time_ids(size, (0, 0), size, dtype=embeds.dtype,
                                          text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim)
        cond = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled,
                    time_ids=time_ids.to(self.device).repeat(len(prompts), 1),  # (N, 6)
                    text_mask=_token_mask(pipe.tokenizer, prompts, pipe.tokenizer.model_max_length).to(self.device))
        if self.cfg:
            cond.update(negative_prompt_embeds=negative, negative_pooled_prompt_embeds=negative_pooled)
        return cond

    def default_times(self, steps):
        # the pipeline's EulerDiscreteScheduler spacing ("leading" for SD-XL: 981, 961, ..., 1 at 50
        # steps, so t_0 < 1), then the final sigma 0
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        scheduler.set_timesteps(steps)
        last = scheduler.config.num_train_timesteps - 1
        return torch.cat([scheduler.timesteps.float() / last, torch.zeros(1)])

    @torch.no_grad()
    def sample(self, noise, cond, times):
        _check_times(times, noise.shape[0])
        text, pooled, time_ids = cond["prompt_embeds"], cond["pooled_prompt_embeds"], cond["time_ids"]
        if self.cfg:
            text, pooled = _cfg_batch(cond, "prompt_embeds", "pooled_prompt_embeds")
            time_ids = torch.cat([time_ids, time_ids])
        copies = 2 if self.cfg else 1
        view = (-1, 1, 1, 1)

        def epsilon(state, t):
            sigma = self.sigma(t).view(view)
            model_input = (state / (sigma**2 + 1) ** 0.5).to(self.dtype)  # scheduler.scale_model_input
            prediction = self.model(
                model_input.repeat(copies, 1, 1, 1), (t * 999).repeat(copies), encoder_hidden_states=text,
                added_cond_kwargs=dict(text_embeds=pooled, time_ids=time_ids), return_dict=False)[0]
            return _guided(prediction, self.guidance) if self.cfg else prediction

        # the pipeline's init_noise_sigma: sqrt(sigma_0^2 + 1) ("leading" spacing) or sigma_0
        first = self.sigma(times[:, 0]).to(noise.device).view(view)
        scale = (first**2 + 1) ** 0.5 if self.pipe.scheduler.config.timestep_spacing == "leading" else first
        return run_schedule(epsilon, noise.float() * scale, times, level=self.sigma)

    def vae_input(self, latents):
        config = self.pipe.vae.config
        if getattr(config, "latents_mean", None) is not None and getattr(config, "latents_std", None) is not None:
            mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1).to(latents.device)
            std = torch.tensor(config.latents_std).view(1, -1, 1, 1).to(latents.device)
            return latents * std / config.scaling_factor + mean
        return latents / config.scaling_factor


FAMILIES = {"sd3": SD3Backbone, "flux": FluxBackbone, "sdxl": SDXLBackbone}
PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline", "sdxl": "StableDiffusionXLPipeline"}


def from_pipeline(pipe, family=None, name=None, resolution=None, guidance=None):
    """Wrap an already built diffusers pipeline (how the tests inject tiny random ones)."""
    family = family or {pipeline: key for key, pipeline in PIPELINES.items()}.get(type(pipe).__name__)
    if family not in FAMILIES:
        raise ValueError(f"cannot tell the family of {type(pipe).__name__}; pass family= one of {', '.join(FAMILIES)}")
    return FAMILIES[family](pipe, name=name or family, resolution=resolution, guidance=guidance)


# ----------------------------------------------------------------------------------------------
# loading


def hub_file(repo, filename, missing, repo_type=None):
    """A file of a hub repository from the local cache, else downloaded. When it is neither cached nor
    reachable: ValueError(`missing` + why) at once, not after the hub client's retries."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo, filename, repo_type=repo_type)
    except ValueError:  # not a repository id at all: a local path that does not exist, say
        raise ValueError(f"{missing} (no such folder, and not a hub repository id)") from None
    if isinstance(cached, str):
        return cached
    host = urllib.parse.urlparse(constants.ENDPOINT).hostname
    try:
        if constants.HF_HUB_OFFLINE:
            raise OSError("HF_HUB_OFFLINE is set")
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as error:
        raise ValueError(f"{missing} (not in the local cache, and {host} is unreachable: {error})") from None
    try:
        return hf_hub_download(repo, filename, repo_type=repo_type)
    except Exception as error:  # gated, missing or refused: all mean "not available"
        raise ValueError(f"{missing} ({type(error).__name__})") from None


def locate_weights(name, path=None):
    """Where from_pretrained loads backbone `name` from: the local diffusers folder `path`, or its hub
    id once its files are cached or reachable. ValueError in one line saying how to get them."""
    hub_id, folder = BACKBONES[name]["hub_id"], BACKBONES[name].get("folder")
    if path is None and folder is not None:  # a miniature shipped in this repository
        path = os.path.join(REPOSITORY, folder)
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            family = BACKBONES[name]["family"]
            raise ValueError(f"{name}: {folder} is missing from this checkout; restore it with "
                             f"git, or retrain it with `python miniature.py --family {family}`")
    if path is not None:
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            raise ValueError(f"{name}: {path} is not a diffusers folder (no model_index.json); pass the folder "
                             f"that holds model_index.json, or drop --model-path to use {hub_id} from the hub")
        return path
    if hub_id is not None:
        hub_file(hub_id, "model_index.json", f"{name}: the weights of {hub_id} are not available; run `hf auth login` and "
                 f"accept the licence on https://huggingface.co/{hub_id}, or pass a local diffusers folder with --model-path")
    return hub_id


def load_backbone(name, path=None, device=None, dtype=None, resolution=None, guidance=None):
    """Build a backbone by name; `path` is a local diffusers folder replacing the hub id.
    Real models load in bfloat16 on CUDA (float32 on CPU), frozen, in eval mode."""
    spec = BACKBONES[name]
    if spec["family"] == "mixture":
        return MixtureBackbone(name, spec["populations"], device=device)
    location = locate_weights(name, path)
    import diffusers

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    pipeline_class = getattr(diffusers, PIPELINES[spec["family"]])
    try:
        pipe = pipeline_class.from_pretrained(location, dtype=dtype)
    except OSError as error:  # a partial download or a file the hub refuses
        raise ValueError(f"{name}: the weights at {location} are incomplete ({type(error).__name__}); run `hf auth login`, "
                         f"accept the licence on https://huggingface.co/{spec['hub_id']} and download again, or pass "
                         "--model-path") from None
    return from_pipeline(pipe.to(device), spec["family"], name=name, resolution=resolution or spec["resolution"],
                         guidance=spec["guidance"] if guidance is None else guidance)
