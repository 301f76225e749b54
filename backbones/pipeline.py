"""
A trained schedule inside a stock diffusers pipeline.

    model = "stabilityai/stable-diffusion-3.5-medium"
    pipe = StableDiffusion3Pipeline.from_pretrained(model, torch_dtype=torch.bfloat16).to("cuda")
    policy = load_policy("out/sd35m-L10-instance-s0/policy")[0].to("cuda")  # or a hub id
    generator = torch.Generator("cuda").manual_seed(0)
    images = generate(pipe, policy, "a red fox in fresh snow", generator=generator).images

generate() samples every noise and prompt with the policy's schedule in one batch (rollout.py's
loop) and returns the pipeline's own output. learned_scheduler(backbone, times), installed as
pipe.scheduler, runs the times in the pipeline itself (no shift, no final 0: sampling ends at the
stop margin t_L). schedule_json() exports a global policy's schedule for other tools.
"""

import contextlib
import sys

import torch
from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

import backbones
from backbones import families
from policy import mean_increments, times_from_increments


class LearnedFlowMatchScheduler(FlowMatchEulerDiscreteScheduler):
    """Flow matching with given times (L+1,); what the pipeline asks set_timesteps for (steps,
    sigmas, a shift mu) is ignored."""

    def set_timesteps(
        self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None
    ):
        self.sigmas = self.learned.to(device)  # (L+1,): t_L is the stop margin, no 0 appended
        self.timesteps = self.sigmas[:-1] * self.config.num_train_timesteps
        self.num_inference_steps = len(self.timesteps)
        self._step_index, self._begin_index = None, None


class LearnedEulerScheduler(EulerDiscreteScheduler):
    """SD-XL's Euler sampler with given times (L+1,): timesteps t * 999 (continuous), sigmas from
    the noise table (families.SDXLBackbone.sigma), the last one sigma(t_L) instead of 0."""

    def set_timesteps(self, num_inference_steps=None, device=None, timesteps=None, sigmas=None):
        times, sigmas = self.learned
        self.timesteps = (times[:-1] * (self.config.num_train_timesteps - 1)).to(device)
        self.sigmas = sigmas  # kept on the CPU, as the Euler scheduler keeps them
        self.num_inference_steps = len(self.timesteps)
        self._step_index, self._begin_index = None, None


# scheduler options that would change the update rule or the times: off in a learned scheduler
EXACT = dict(shift_terminal=None) | dict.fromkeys(
    ("stochastic_sampling", "invert_sigmas", "use_dynamic_shifting")
    + ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas"),
    False,
)


def learned_scheduler(backbone, times):
    """A scheduler for backbone's pipeline that runs `times` (L+1,) exactly."""
    config = backbone.pipe.scheduler.config
    overrides = {key: value for key, value in EXACT.items() if key in config}
    times = torch.as_tensor(times, dtype=torch.float32).cpu()
    sdxl = isinstance(backbone, families.SDXLBackbone)  # whose config SDXLBackbone has checked
    kind = LearnedEulerScheduler if sdxl else LearnedFlowMatchScheduler
    scheduler = kind.from_config(config, **overrides)
    scheduler.learned = (times, backbone.sigma(times).cpu()) if sdxl else times
    return scheduler


def pipeline_noise(backbone, count, generator=None):
    """(count, ...) initial noise drawn as the pipeline's prepare_latents draws it, in the layout
    the pipeline's latents= takes (Flux: packed)."""
    shape, device, dtype = (count, *backbone.latent_shape), backbone.device, backbone.dtype
    noise = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
    return backbone.pack(noise) if isinstance(backbone, families.FluxBackbone) else noise


# the pipeline's text arguments, encoded by its encode_prompt for the model and the policy alike
TEXT = ("prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3")
TEXT += ("clip_skip", "max_sequence_length")
EMBEDS = ("prompt_embeds", "pooled_prompt_embeds") + families.NEGATIVES


@contextlib.contextmanager
def _left_as_found(pipe):
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    state = [(m, m.training, [p.requires_grad for p in m.parameters()]) for m in modules]
    progress = dict(getattr(pipe, "_progress_bar_config", {}))
    try:
        yield
    finally:
        for module, training, grads in state:
            module.train(training)
            for parameter, flag in zip(module.parameters(), grads):
                parameter.requires_grad_(flag)
        pipe._progress_bar_config = progress


def trained_guidance(policy):
    """The guidance a policy's schedule was learned at: its training --guidance, else its
    backbone's default, else None."""
    guidance = (policy.training_config or {}).get("guidance")
    default = backbones.BACKBONES.get(policy.backbone, {}).get("guidance")
    return default if guidance is None else guidance


@torch.no_grad()
def generate(
    pipe, policy, prompt=None, num_images_per_prompt=1, generator=None, latents=None, **pipe_kwargs
):
    """What pipe(prompt, ...) returns, each image sampled with the policy's schedule (the
    Dirichlet mean) for its noise and prompt. pipe_kwargs: TEXT, EMBEDS, height = width,
    output_type, return_dict, num_inference_steps, guidance_scale (default: trained_guidance).
    The pipeline is left as found (modules' modes, grad flags, progress bar)."""
    if policy.pipeline_refusal:
        raise ValueError(policy.pipeline_refusal)
    steps = pipe_kwargs.pop("num_inference_steps", policy.steps)
    if steps != policy.steps:
        raise ValueError(
            f"this policy was trained for L={policy.steps} steps, not num_inference_steps={steps}"
        )
    guidance = pipe_kwargs.pop("guidance_scale", None)  # default: not the pipeline's
    guidance = trained_guidance(policy) if guidance is None else guidance
    height = pipe_kwargs.pop("height", None) or pipe.default_sample_size * pipe.vae_scale_factor
    if pipe_kwargs.pop("width", height) != height:
        raise ValueError("the learned schedules are trained on square images: pass height == width")
    output_type = pipe_kwargs.pop("output_type", "pil")
    return_dict = pipe_kwargs.pop("return_dict", True)
    others = sorted(set(pipe_kwargs) - set(TEXT + EMBEDS))  # e.g. sigmas=: the policy's are used
    if others:
        raise ValueError(
            f"generate() samples every image in one batch with this repository's loop and takes "
            f"no {', '.join(others)}; install learned_scheduler(backbone, times) as pipe.scheduler "
            "and call the pipeline yourself"
        )
    family = backbones.BACKBONES.get(policy.backbone, {}).get("family")
    with _left_as_found(pipe):
        backbone = backbones.from_pipeline(pipe, resolution=height, guidance=guidance)
        # a policy of another family, or of an embedded backbone that no pipeline runs
        if family and backbones.FAMILIES.get(family) is not type(backbone):
            raise ValueError(
                f"this policy was trained on {policy.backbone} ({family}), "
                f"not for a {type(pipe).__name__}"
            )
        dims = backbone.policy_dims  # a global policy's config has none of them
        built = {key: policy.config.get(key, value) for key, value in dims.items()}
        if built != dims:
            raise ValueError(f"this policy was built for {built}, not this pipeline's {dims}")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        given = None if "prompt_embeds" in pipe_kwargs else list(prompts)  # or the embeddings
        cond = backbone.encode_prompts(given, **pipe_kwargs)
        count = len(cond["prompt_embeds"])
        index = torch.arange(count).repeat_interleave(num_images_per_prompt)  # each image's prompt
        cond = {key: value[index.to(value.device)] for key, value in cond.items()}
        noise = pipeline_noise(backbone, len(index), generator) if latents is None else latents
        times = policy.times(backbone, noise, cond)  # (N, L+1), the Dirichlet mean
        images = backbone.sample(noise, cond, times)  # L model calls for the whole batch
        if output_type != "latent":  # decoded and post-processed as the pipeline does
            decoded = backbone.decode_raw(images)
            images = pipe.image_processor.postprocess(decoded, output_type=output_type)
    if not return_dict:
        return (images,)
    # the pipeline's output class, which its module imports: e.g. FluxPipelineOutput
    output = getattr(sys.modules[type(pipe).__module__], f"{type(pipe).__name__}Output")
    return output(images=images)


def schedule_json(policy, backbone):
    """A global policy's schedule (its Dirichlet mean) for other tools: times (L+1,), sigmas and
    the timesteps the model sees."""
    if policy.config["kind"] != "global":  # an instance-level or a step-wise policy
        raise ValueError("this policy has a schedule per context: only a global one exports")
    times = times_from_increments(mean_increments(policy(torch.zeros(1))))[0].double()
    sdxl = isinstance(backbone, families.SDXLBackbone)
    sigmas, scale = (backbone.sigma(times), 999) if sdxl else (times, 1000)
    return dict(
        backbone=backbone.name,
        steps=policy.steps,
        times=times.tolist(),
        sigmas=sigmas.tolist(),
        timesteps=(times[:-1] * scale).tolist(),
        note="run the times exactly: no shift, no final 0 (t_L is the stop margin)",
    )
