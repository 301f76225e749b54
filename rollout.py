"""
The frozen backbone's interface and the one sampling loop that executes a schedule exactly; the
backbones themselves are the diffusers families (backbones/families.py) and the embedded mixtures
(backbones/mixture.py).

A schedule for L steps is a tensor `times` of shape (N, L+1), 1 >= t_0 > t_1 > ... > t_L >= 0, in
the backbone's own noise level: the flow-matching sigma for SD3.5, Flux and the embedded backbones;
for SD-XL a continuous timestep t * 999 whose sigma is interpolated from the model's noise table
(sigma(0) = 0). The frozen model is called at t_0 .. t_{L-1}; first-order steps go to t_1 .. t_L:

    x <- x + (s(t_{l+1}) - s(t_l)) * derivative(x, t_l)      s = sigma (identity for flows)

No scheduler shift is applied on top of the given times. `default_times(L)` returns exactly what the
diffusers pipeline runs with num_inference_steps=L, and with those times `sample` reproduces the
pipeline's own latents (tests/test_rollout_diffusers.py).

    backbone = backbones.load_backbone("digits")        # or any name in backbones.BACKBONES
    cond = backbone.encode_prompts(backbone.prompts)    # once per prompt, then repeat_interleave
    noise = backbone.sample_noise(10, torch.Generator().manual_seed(0))
    latents = backbone.sample(noise, cond, backbone.default_times(4).expand(10, -1))
    images = backbone.decode(latents)                   # (N, 3, H, W) in [0, 1]
"""

import torch


class Backbone:
    """What every backbone offers; train.py, evaluate.py and the rewards use nothing else.

    Attributes: name, device, dtype (of the frozen model), resolution (image side), guidance,
    prompts (the built-in prompt list, or None: real models take any prompt), latent_shape, and
    policy_dims (latent_channels, text_dim, pooled_dim: what policy.make_policy needs).
    Methods:
      check_prompts(prompts): a one-line ValueError for a prompt it cannot take, before any work
      encode_prompts(prompts) -> cond: a dict of batch-first tensors (prompt_embeds (N, S, D),
          pooled_prompt_embeds (N, P), text_mask (N, S) True = a real token, and what the model
          needs); keep_encoded(prompts): encode a set once, for encode_prompts to serve, and
          say whether it did (backbones/families.py does; the embedded ones look a digit up)
      sample_noise(n, generator) -> the initial noise x_T, drawn as the pipeline draws it
      policy_inputs(noise, cond) -> the keyword arguments of the policy's forward, float32
      as_image(latents) -> latents in the (N, C, H, W) layout the policy reads (Flux unpacks)
      default_times(L) -> (L+1,) the schedule the pipeline runs with num_inference_steps=L
      ode(noise, cond, start) -> (derivative, state, level): the ODE run_schedule integrates
          from noise at the times `start` (N,)
      sample(noise, cond, times) -> final latents; times (N, L+1), each row run exactly
      reference(noise, cond) -> an accurate solution from the same noise: the teacher
      decode(latents) -> images (N, 3, H, W) in [0, 1]
    """

    reference_steps = 50  # the diffusers backbones' teacher: the default schedule at 50 steps

    def check_prompts(self, prompts, reward=None):
        """A one-line ValueError for a prompt this backbone cannot take (none here)."""

    def keep_encoded(self, prompts):
        return False

    def sample_noise(self, n, generator=None):
        return torch.randn((n,) + self.latent_shape, generator=generator).to(self.device)

    def as_image(self, latents):
        return latents

    def policy_inputs(self, noise, cond):
        return dict(
            latent=self.as_image(noise).float(),
            text=cond["prompt_embeds"].float(),
            text_mask=cond["text_mask"],
            pooled=cond["pooled_prompt_embeds"].float(),
        )

    def sample(self, noise, cond, times):
        """The final latents of each context sampled with its schedule, times (N, L+1): L model
        calls. Differentiable in the times and the noise (the model's weights are frozen)."""
        shaped = times.dim() == 2 and times.shape[0] == noise.shape[0] and times.shape[1] >= 2
        assert shaped, f"times must have shape (N={noise.shape[0]}, L+1 >= 2), got {times.shape}"
        derivative, state, level = self.ode(noise, cond, times[:, 0])
        return run_schedule(derivative, state, times, level)

    def reference(self, noise, cond):
        times = self.default_times(self.reference_steps).expand(noise.shape[0], -1)
        return self.sample(noise, cond, times)


def run_schedule(derivative, state, times, level=None):
    """The one sampling loop: L first-order steps, exactly L calls of `derivative`.

    derivative(state, t) -> d state / d level at per-sample times t (N,); times (N, L+1);
    level(t) -> the integration variable s (sigma for SD-XL; None: the times themselves).
    """
    level = level or (lambda t: t)
    times = times.to(state.device)
    view = (-1,) + (1,) * (state.dim() - 1)
    for t, t_next in zip(times[:, :-1].T, times[:, 1:].T):  # (N,) each
        slope = derivative(state, t).float()
        s = level(t).to(torch.float32).view(view)
        state = state + (level(t_next).to(torch.float32).view(view) - s) * slope
    return state
