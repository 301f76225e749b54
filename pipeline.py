"""
A trained schedule inside a stock diffusers pipeline.

    pipe = StableDiffusion3Pipeline.from_pretrained("stabilityai/stable-diffusion-3.5-medium", torch_dtype=torch.bfloat16).to("cuda")
    policy = checkpoints.load_policy("out/policy").to("cuda")   # what train.py saved, or a hub id
    images = generate(pipe, policy, "a red fox in fresh snow", generator=torch.Generator("cuda").manual_seed(0)).images

generate() draws the initial noise the way the pipeline draws it, asks the policy for that noise and
prompt's schedule (its Dirichlet mean), installs a scheduler that runs exactly those times and calls
the pipeline itself, with latents= and the prompt embeddings already computed for the policy. It
returns the pipeline's own output (PIL images by default), one pipeline call per image, since every
image has its own schedule.

The schedulers run the times as given: LearnedFlowMatchScheduler (SD3.5, Flux: sigma = t) and
LearnedEulerScheduler (SD-XL: sigma interpolated from the model's noise table at timestep t * 999)
apply no shift and append no final 0, so sampling ends at the learned stop margin t_L, as in
rollout.py's loop (tests/test_pipeline.py checks they give the same latents). A global policy's
schedule is one list of times for every context: schedule_json() writes it, with the sigmas, for other
tools.
"""
import torch
from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

import rollout
from policy import mean_increments, times_from_increments


class LearnedFlowMatchScheduler(FlowMatchEulerDiscreteScheduler):
    """Flow matching with given times (L+1,): the model runs at t_0..t_{L-1}, Euler steps go to
    t_1..t_L; whatever the pipeline asks set_timesteps for (steps, sigmas, a shift mu) is ignored."""

    def install(self, times):
        self.learned = torch.as_tensor(times, dtype=torch.float32).cpu()
        return self

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
        self.sigmas = self.learned.to(device)  # (L+1,): t_L is the stop margin, no 0 appended
        self.timesteps = self.sigmas[:-1] * self.config.num_train_timesteps
        self.num_inference_steps = len(self.timesteps)
        self._step_index, self._begin_index = None, None


class LearnedEulerScheduler(EulerDiscreteScheduler):
    """SD-XL's Euler sampler with given times (L+1,): timesteps t * 999 (continuous), sigmas from the
    noise table (rollout.SDXLBackbone.sigma), the last one sigma(t_L) instead of 0."""

    def install(self, times, sigmas):
        self.learned = torch.as_tensor(times, dtype=torch.float32).cpu(), torch.as_tensor(sigmas, dtype=torch.float32).cpu()
        return self

    def set_timesteps(self, num_inference_steps=None, device=None, timesteps=None, sigmas=None):
        times, sigmas = self.learned
        self.timesteps = (times[:-1] * (self.config.num_train_timesteps - 1)).to(device)
        self.sigmas = sigmas  # kept on the CPU, as the Euler scheduler keeps them
        self.num_inference_steps = len(self.timesteps)
        self._step_index, self._begin_index = None, None


def learned_scheduler(backbone, times):
    """A scheduler for backbone's pipeline that runs `times` (L+1,) exactly, from its own config."""
    config = backbone.pipe.scheduler.config
    if isinstance(backbone, rollout.SDXLBackbone):
        return LearnedEulerScheduler.from_config(config).install(times, backbone.sigma(times))
    return LearnedFlowMatchScheduler.from_config(config).install(times)


def pipeline_noise(backbone, count, generator=None):
    """(count, ...) initial noise drawn as the pipeline's prepare_latents draws it (randn_tensor, its
    shape and dtype), in the layout rollout.py and the pipeline's latents= take."""
    pipe = backbone.pipe
    channels, size = backbone.latent_shape[0], 2 * (backbone.resolution // (pipe.vae_scale_factor * 2))
    shape = (count, channels, size, size) if isinstance(backbone, rollout.FluxBackbone) else (count, *backbone.latent_shape)
    noise = randn_tensor(shape, generator=generator, device=backbone.device, dtype=backbone.dtype)
    return backbone.pack(noise) if isinstance(backbone, rollout.FluxBackbone) else noise


@torch.no_grad()
def generate(pipe, policy, prompt, generator=None, num_images_per_prompt=1, **pipe_kwargs):
    """The pipeline's own output for `prompt` (a string or a list), every image with the schedule the
    policy proposes for its noise and prompt. pipe_kwargs go to the pipeline (guidance_scale, height
    = width, output_type, ...); num_inference_steps is the policy's L."""
    height = pipe_kwargs.pop("height", None) or pipe.default_sample_size * pipe.vae_scale_factor
    if pipe_kwargs.pop("width", height) != height:
        raise ValueError("the learned schedules are trained on square images: pass height == width")
    backbone = rollout.from_pipeline(pipe, resolution=height, guidance=pipe_kwargs.get("guidance_scale"))
    dims = {key: policy.config.get(key) for key in backbone.policy_dims}
    if policy.config["kind"] == "instance" and dims != backbone.policy_dims:
        raise ValueError(f"this policy was built for {dims}, the pipeline has {backbone.policy_dims}: train one for this model")
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    prompts = [text for text in prompts for _ in range(num_images_per_prompt)]
    cond = backbone.encode_prompts(prompts)
    noise = pipeline_noise(backbone, len(prompts), generator)
    times = times_from_increments(mean_increments(policy(**backbone.policy_inputs(noise, cond))))  # (N, L+1)
    original, outputs = pipe.scheduler, []
    try:
        for index in range(len(prompts)):
            pipe.scheduler = learned_scheduler(backbone, times[index].cpu())
            embeddings = {key: value[index:index + 1] for key, value in cond.items() if key.endswith("prompt_embeds")}
            outputs.append(pipe(**embeddings, latents=noise[index:index + 1], num_inference_steps=policy.steps, height=height,
                                width=height, **pipe_kwargs))
    finally:
        pipe.scheduler = original
    images = [output.images for output in outputs]
    outputs[0].images = torch.cat(images) if torch.is_tensor(images[0]) else [image for batch in images for image in batch]
    return outputs[0]


def schedule_json(policy, backbone):
    """A global policy's schedule for other tools: its times (L+1,), the sigmas they stand for, and
    the timesteps the model sees (its Dirichlet mean)."""
    if policy.config["kind"] != "global":
        raise ValueError("an instance-level policy has a schedule per noise and prompt: use generate(); only a global one exports")
    times = times_from_increments(mean_increments(policy(torch.zeros(1))))[0].double()
    sigmas = backbone.sigma(times) if isinstance(backbone, rollout.SDXLBackbone) else times
    scale = 999 if isinstance(backbone, rollout.SDXLBackbone) else 1000
    return dict(backbone=backbone.name, steps=policy.steps, times=times.tolist(), sigmas=sigmas.tolist(),
                timesteps=(times[:-1] * scale).tolist(), note="run the times exactly: no shift, no final 0 (t_L is the stop margin)")
