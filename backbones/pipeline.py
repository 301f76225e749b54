"""
A trained schedule inside a stock diffusers pipeline.

    model = "stabilityai/stable-diffusion-3.5-medium"
    pipe = StableDiffusion3Pipeline.from_pretrained(model, torch_dtype=torch.bfloat16).to("cuda")
    policy = load_policy("out/sd35m-L10-instance-s0/policy").to("cuda")  # or a hub id
    generator = torch.Generator("cuda").manual_seed(0)
    images = generate(pipe, policy, "a red fox in fresh snow", generator=generator).images

generate() draws the initial noise the way the pipeline draws it, asks the policy for that noise and
prompt's schedule (its Dirichlet mean), installs a scheduler that runs exactly those times and calls
the pipeline itself, with latents= and the prompt embeddings already computed for the policy, at the
guidance the policy was trained with unless guidance_scale= says otherwise. It returns the
pipeline's own output (PIL images by default), one pipeline call per image, since every image has
its own schedule.

The schedulers run the times as given: LearnedFlowMatchScheduler (SD3.5, Flux: sigma = t) and
LearnedEulerScheduler (SD-XL: sigma interpolated from the model's noise table at timestep t * 999)
apply no shift and append no final 0, so sampling ends at the learned stop margin t_L, as in
rollout.py's loop (tests/test_pipeline.py checks they give the same latents). A global policy's
schedule is one list of times for every context: schedule_json() writes it, with the sigmas, for
other tools.
"""

import importlib
import inspect

import torch
from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

import backbones
from backbones import families
from policy import mean_increments, times_from_increments


class LearnedFlowMatchScheduler(FlowMatchEulerDiscreteScheduler):
    """Flow matching with given times (L+1,): the model runs at t_0..t_{L-1}, Euler steps go to
    t_1..t_L; what the pipeline asks set_timesteps for (steps, sigmas, a shift mu) is ignored."""

    def install(self, times):
        self.learned = torch.as_tensor(times, dtype=torch.float32).cpu()
        return self

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

    def install(self, times, sigmas):
        self.learned = (
            torch.as_tensor(times, dtype=torch.float32).cpu(),
            torch.as_tensor(sigmas, dtype=torch.float32).cpu(),
        )
        return self

    def set_timesteps(self, num_inference_steps=None, device=None, timesteps=None, sigmas=None):
        times, sigmas = self.learned
        self.timesteps = (times[:-1] * (self.config.num_train_timesteps - 1)).to(device)
        self.sigmas = sigmas  # kept on the CPU, as the Euler scheduler keeps them
        self.num_inference_steps = len(self.timesteps)
        self._step_index, self._begin_index = None, None


# Scheduler options that would change the update rule or the times: always off in a learned
# scheduler (set_timesteps is replaced, so the sigma-spacing ones matter only for a later
# set_timesteps call; stochastic_sampling would re-noise at every step instead of an Euler step)
EXACT = {
    "stochastic_sampling": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "use_dynamic_shifting": False,
    "shift_terminal": None,
    "invert_sigmas": False,
}


def learned_scheduler(backbone, times):
    """A scheduler for backbone's pipeline that runs `times` (L+1,) exactly, from its own config
    with every option of EXACT off."""
    config = backbone.pipe.scheduler.config
    overrides = {key: value for key, value in EXACT.items() if key in config}
    if isinstance(backbone, families.SDXLBackbone):  # whose config SDXLBackbone has checked
        scheduler = LearnedEulerScheduler.from_config(config, **overrides)
        return scheduler.install(times, backbone.sigma(times))
    return LearnedFlowMatchScheduler.from_config(config, **overrides).install(times)


def pipeline_noise(backbone, count, generator=None):
    """(count, ...) initial noise drawn as the pipeline's prepare_latents draws it (randn_tensor,
    its shape and dtype), in the layout families.py and the pipeline's latents= take."""
    flux = isinstance(backbone, families.FluxBackbone)
    size = 2 * (backbone.resolution // (backbone.pipe.vae_scale_factor * 2))
    channels = backbone.latent_shape[0]
    shape = (count, channels, size, size) if flux else (count, *backbone.latent_shape)
    noise = randn_tensor(shape, generator=generator, device=backbone.device, dtype=backbone.dtype)
    return backbone.pack(noise) if flux else noise


# The pipeline's text arguments: encoded by the pipeline's own encode_prompt, for the model and
# for the policy alike. A list holds one entry per prompt.
TEXT = (
    "prompt_2",
    "prompt_3",
    "negative_prompt",
    "negative_prompt_2",
    "negative_prompt_3",
    "clip_skip",
    "max_sequence_length",
)
EMBEDS = (
    "prompt_embeds",
    "pooled_prompt_embeds",
    "negative_prompt_embeds",
    "negative_pooled_prompt_embeds",
)
REFUSED = ("timesteps", "sigmas")  # the schedule is the policy's
# What each family's pipeline returns, as its __call__ does
OUTPUTS = {
    "sd3": ("stable_diffusion_3.pipeline_output", "StableDiffusion3PipelineOutput"),
    "flux": ("flux.pipeline_output", "FluxPipelineOutput"),
    "sdxl": ("stable_diffusion_xl.pipeline_output", "StableDiffusionXLPipelineOutput"),
}


def _module_state(pipe):
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    return [(m, m.training, [p.requires_grad for p in m.parameters()]) for m in modules]


def _restore(state, pipe, progress):
    for module, training, grads in state:
        module.train(training)
        for parameter, flag in zip(module.parameters(), grads):
            parameter.requires_grad_(flag)
    pipe._progress_bar_config = progress


def trained_guidance(policy):
    """The guidance scale a policy was trained at: its training configuration's --guidance, else its
    backbone's default (backbones.BACKBONES); None when neither is known or the model has no
    guidance input (FLUX.1-schnell). A schedule is learned for one guidance: the pipeline's own
    default (7.0 for SD3 and SD-XL) is another."""
    guidance = (policy.training_config or {}).get("guidance")
    if guidance is None:
        guidance = backbones.BACKBONES.get(policy.backbone, {}).get("guidance")
    return guidance


@torch.no_grad()
def generate(
    pipe, policy, prompt=None, num_images_per_prompt=1, generator=None, latents=None, **pipe_kwargs
):
    """What pipe(prompt, ...) returns (its output class, images as output_type asks), every image
    sampled with the schedule the policy proposes for its noise and prompt (the Dirichlet mean).
    The prompts are encoded once, by the pipeline's encode_prompt, and every image of the call is
    sampled in one batch by the backbone's loop (rollout.run_schedule, per-image times), which
    equals the pipeline with the learned scheduler installed (tests/test_pipeline.py). pipe_kwargs:
    the text arguments (prompt_2, negative_prompt, max_sequence_length, clip_skip, precomputed
    prompt_embeds, ...), height = width, output_type, return_dict; guidance_scale defaults to the
    policy's own (trained_guidance). num_inference_steps is the policy's L. Refused in one line
    (ValueError): timesteps and sigmas, any other pipeline argument, a policy of an embedded
    backbone or of another family, an empty prompt, num_images_per_prompt < 1. The pipeline is
    left as it was found (its modules' modes, grad flags, progress bar)."""
    if policy.pipeline_refusal:
        raise ValueError(policy.pipeline_refusal)
    family = backbones.BACKBONES.get(policy.backbone, {}).get("family")
    if family not in (None, *backbones.FAMILIES):
        raise ValueError(
            f"this policy was trained on the embedded {policy.backbone} backbone, which no "
            "diffusers pipeline runs: sample it with sample.py"
        )
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if "prompt_embeds" not in pipe_kwargs and (
        not isinstance(prompts, (list, tuple))
        or not prompts
        or not all(isinstance(text, str) for text in prompts)
    ):
        raise ValueError(f"prompt takes a string or a non-empty list of strings, got {prompt!r}")
    if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
        raise ValueError(f"num_images_per_prompt must be at least 1, got {num_images_per_prompt!r}")
    for key in REFUSED:
        if key in pipe_kwargs:
            raise ValueError(f"generate() runs the policy's own schedule: drop {key}=")
    steps = pipe_kwargs.pop("num_inference_steps", policy.steps)
    if steps != policy.steps:
        raise ValueError(
            f"this policy was trained for L={policy.steps} steps, not num_inference_steps={steps}"
        )
    guidance = pipe_kwargs.pop("guidance_scale", None)
    if guidance is None:  # the guidance it was trained with, not the pipeline's default
        guidance = trained_guidance(policy)
    height = pipe_kwargs.pop("height", None) or pipe.default_sample_size * pipe.vae_scale_factor
    if pipe_kwargs.pop("width", height) != height:
        raise ValueError("the learned schedules are trained on square images: pass height == width")
    output_type = pipe_kwargs.pop("output_type", "pil")
    return_dict = pipe_kwargs.pop("return_dict", True)
    others = sorted(set(pipe_kwargs) - set(TEXT + EMBEDS))
    if others:
        raise ValueError(
            f"generate() samples every image in one batch with this repository's loop and takes "
            f"no {', '.join(others)}; install learned_scheduler(backbone, times) as pipe.scheduler "
            "and call the pipeline yourself"
        )
    state, progress = _module_state(pipe), dict(getattr(pipe, "_progress_bar_config", {}))
    try:
        backbone = backbones.from_pipeline(pipe, resolution=height, guidance=guidance)
        if family and not isinstance(backbone, backbones.FAMILIES[family]):
            raise ValueError(
                f"this policy was trained on {policy.backbone} ({family}), "
                f"not for a {type(pipe).__name__}"
            )
        keys = ("latent_channels", "text_dim", "pooled_dim")  # what an instance policy reads
        dims = {key: policy.config.get(key) for key in keys}
        wanted = {key: backbone.policy_dims[key] for key in keys}
        if policy.config["kind"] == "instance" and dims != wanted:
            raise ValueError(
                f"this policy was built for {dims}, the pipeline has {wanted}: "
                "train one for this model"
            )
        accepted = inspect.signature(pipe.encode_prompt).parameters
        refused = sorted(key for key in pipe_kwargs if key not in accepted)
        if refused:  # e.g. a negative prompt for Flux, which runs no CFG
            raise ValueError(f"{type(pipe).__name__} takes no {', '.join(refused)}")
        cond = backbone.encode_prompts(
            None if "prompt_embeds" in pipe_kwargs else list(prompts), **pipe_kwargs
        )
        count = len(cond["prompt_embeds"])
        index = torch.arange(count).repeat_interleave(num_images_per_prompt)  # each image's prompt
        cond = {key: value[index.to(value.device)] for key, value in cond.items()}
        noise = pipeline_noise(backbone, len(index), generator) if latents is None else latents
        times = policy.times(backbone, noise, cond)  # (N, L+1), the Dirichlet mean
        sampled = backbone.sample(noise, cond, times)  # L model calls for the whole batch
        images = sampled
        if output_type != "latent":  # decoded and post-processed as the pipeline does
            images = pipe.image_processor.postprocess(
                backbone.decode_raw(sampled), output_type=output_type
            )
    finally:
        _restore(state, pipe, progress)
    if not return_dict:
        return (images,)
    module, name = OUTPUTS[backbones.PIPELINE_FAMILIES[type(pipe).__name__]]
    output = getattr(importlib.import_module(f"diffusers.pipelines.{module}"), name)
    return output(images=images)


def schedule_json(policy, backbone):
    """A global policy's schedule for other tools: its times (L+1,), the sigmas they stand for, and
    the timesteps the model sees (its Dirichlet mean)."""
    if policy.pipeline_refusal:
        raise ValueError(policy.pipeline_refusal)
    if policy.config["kind"] != "global":
        raise ValueError(
            "an instance-level policy has a schedule per noise and prompt: use generate(); "
            "only a global one exports"
        )
    times = times_from_increments(mean_increments(policy(torch.zeros(1))))[0].double()
    sigmas = backbone.sigma(times) if isinstance(backbone, families.SDXLBackbone) else times
    scale = 999 if isinstance(backbone, families.SDXLBackbone) else 1000
    return dict(
        backbone=backbone.name,
        steps=policy.steps,
        times=times.tolist(),
        sigmas=sigmas.tolist(),
        timesteps=(times[:-1] * scale).tolist(),
        note="run the times exactly: no shift, no final 0 (t_L is the stop margin)",
    )
