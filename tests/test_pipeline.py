"""A trained schedule in a stock diffusers pipeline (pipeline.py); the policy in the Hub format."""

import json

import numpy as np
import pytest
import torch

import backbones
from backbones import families, pipeline
from evaluate import POLICIES, load_policy
from miniatures.layouts import TINY_GUIDANCE, TINY_RESOLUTION, tiny_pipeline
from policy import make_policy, mean_increments, save_policy, times_from_increments


def learned_policy(backbone, steps, seed=0, kind="instance"):
    """A policy whose schedules differ per context and end at a stop margin > 0 (the head's last
    layer, zero at initialisation, gets random weights)."""
    torch.manual_seed(seed)
    start = dict(init_times=backbone.default_times(steps), stop_margin=0.02)
    policy = make_policy(POLICIES[kind], backbone.policy_dims, steps, **start)
    with torch.no_grad():
        if kind == "global":  # one schedule for every context, away from the default
            policy.head[-1].bias.add_(0.5 * torch.randn(steps + 1))
        else:
            policy.head[-1].weight.normal_(0.0, 0.3)
    return policy.eval()


def mean_times(policy, backbone, noise, cond):
    """(N, L+1): the schedules generate() must sample with, the policy's Dirichlet mean."""
    with torch.no_grad():
        return times_from_increments(mean_increments(policy(**backbone.policy_inputs(noise, cond))))


def call_with_times(pipe, backbone, times, **arguments):
    """The pipeline's own call with the learned scheduler for `times` (L+1,) installed by hand."""
    original, pipe.scheduler = pipe.scheduler, pipeline.learned_scheduler(backbone, times)
    try:
        return pipe(num_inference_steps=len(times) - 1, width=TINY_RESOLUTION, **arguments).images
    finally:
        pipe.scheduler = original


@pytest.fixture(
    scope="module",
    params=["sd3", "flux-dev", "sdxl", "mini-sd3", "mini-flux", "mini-sdxl", "mini-flux-schnell"],
)
def tiny(request):
    """A tiny random pipeline of each family and the shipped trained miniatures
    (miniatures/build.py)."""
    if request.param.startswith("mini-"):
        backbone = backbones.load_backbone(request.param)
        return backbone.pipe, backbone
    pipe, guidance = tiny_pipeline(request.param), TINY_GUIDANCE[request.param]
    return pipe, backbones.from_pipeline(pipe, resolution=TINY_RESOLUTION, guidance=guidance)


@pytest.mark.parametrize("steps", [1, 4, 9])
def test_generate_in_the_stock_pipeline_equals_the_sampling_loop(tiny, steps):
    pipe, backbone = tiny
    policy = learned_policy(backbone, steps)
    prompts = ["a cat", "a red house on a hill"]
    generator, guidance = torch.Generator().manual_seed(5), backbone.guidance or 0.0
    options = dict(output_type="latent", height=backbone.resolution, guidance_scale=guidance)
    latents = pipeline.generate(pipe, policy, prompts, generator=generator, **options).images
    noise = pipeline.pipeline_noise(backbone, 2, torch.Generator().manual_seed(5))
    cond = backbone.encode_prompts(prompts)
    times = mean_times(policy, backbone, noise, cond)
    # per-context schedules, a stop margin
    assert (times[0] - times[1]).abs().max() > 1e-4 and (times[:, -1] > 1e-3).all()
    expected = backbone.sample(noise, cond, times)
    assert latents.shape == expected.shape
    # float32 rounding is relative to the largest state on the way: the output, or SD-XL's start
    # noise * sqrt(sigma(t_0)^2 + 1), ~15x the noise at t_0 = 1 (a trained UNet's steps are large)
    start = (
        (backbone.sigma(times[:, :1]) ** 2 + 1).sqrt().view(-1, 1, 1, 1)
        if isinstance(backbone, families.SDXLBackbone)
        else 1.0
    )
    scale = max(expected.abs().max().item(), (noise.float() * start).abs().max().item())
    # the same operations in another order: float32 rounding (1.2e-7) grown by the trained network
    # over L steps; at most 1.02e-5 of the scale seen (mini-sd3, L = 4)
    assert (latents - expected).abs().max().item() / scale < 3e-5


def test_the_pipeline_draws_the_same_noise_as_its_own_call(tiny):
    pipe, backbone = tiny
    seen = []
    handle = backbone.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(
            kwargs.get("hidden_states", args[0] if args else kwargs.get("sample"))
        ),
        with_kwargs=True,
    )
    size, guidance = backbone.resolution, backbone.guidance or 0.0
    options = dict(height=size, width=size, output_type="latent", guidance_scale=guidance)
    try:
        pipe("a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(3), **options)
    finally:
        handle.remove()
    noise = pipeline.pipeline_noise(backbone, 1, torch.Generator().manual_seed(3))
    # the first model input is the noise itself (SD-XL: scaled by init_noise_sigma =
    # sqrt(sigma_0^2 + 1), then by 1 / sqrt(sigma_0^2 + 1)); the last row is the conditional half
    # of a CFG batch
    assert torch.allclose(seen[0][-1:].float(), noise.float(), atol=1e-5)


def test_a_global_schedule_exports_as_json(tiny):
    _, backbone = tiny
    policy = learned_policy(backbone, 3, kind="global")
    exported = json.loads(json.dumps(pipeline.schedule_json(policy, backbone)))
    times = times_from_increments(mean_increments(policy(torch.zeros(1))))[0]
    exported_times = torch.tensor(exported["times"], dtype=torch.float64)
    assert exported["steps"] == 3 and torch.allclose(exported_times, times.double(), atol=1e-7)
    assert exported["times"][0] == 1.0 and exported["times"][-1] > 0  # the stop margin, not 0
    sigmas = backbone.sigma(times) if isinstance(backbone, families.SDXLBackbone) else times
    assert torch.allclose(torch.tensor(exported["sigmas"]).float(), sigmas, rtol=1e-6)
    with pytest.raises(ValueError, match="only a global one exports"):
        pipeline.schedule_json(learned_policy(backbone, 3), backbone)


@pytest.mark.parametrize("kind", ["instance", "global", "stepwise"])
def test_a_policy_goes_to_the_hub_and_back_without_pickle(tmp_path, capsys, kind):
    """save_policy writes a Hub folder; load_policy(...)[0].save_pretrained(folder) is what
    push_to_hub uploads: load_policy of either, from a policy folder or a checkpoint, gives the same
    policy (its class, configuration and weights, in eval mode), its backbone, L and training
    configuration, and prints nothing."""
    backbone = backbones.load_backbone("digits")
    policy = learned_policy(backbone, 4, kind=kind)
    config = dict(backbone="digits", steps=4, seed=3)
    save_policy(tmp_path / "policy", policy, dict(config, iteration=9))
    files = sorted(path.name for path in (tmp_path / "policy").iterdir())
    assert files == ["README.md", "config.json", "model.safetensors"]
    state = dict(policy=policy.state_dict(), policy_config=policy.config, optimizer={})
    torch.save(dict(state, iteration=9, config=config), tmp_path / "ckpt.pt")
    for source in ("policy", "ckpt.pt"):
        capsys.readouterr()
        shared = tmp_path / f"shared-{source}"
        load_policy(str(tmp_path / source))[0].save_pretrained(shared)
        for folder in (tmp_path / source, shared):  # the README's call
            loaded, loaded_config = load_policy(str(folder))
            assert loaded_config == dict(config, iteration=9)
            assert type(loaded) is type(policy) and loaded.config == policy.config
            assert loaded.backbone == "digits" and loaded.steps == 4 and not loaded.training
            torch.testing.assert_close(loaded.state_dict(), policy.state_dict(), rtol=0, atol=0)
        assert capsys.readouterr().out == ""
    bare = tmp_path / "bare"  # a policy built by hand: no training configuration, no backbone
    make_policy(POLICIES["global"], backbone.policy_dims, 4).save_pretrained(bare)
    loaded, _ = load_policy(str(bare))
    assert loaded.steps == 4 and loaded.backbone is None


def pipe_and_policy(family="sd3", steps=3):
    pipe, guidance = tiny_pipeline(family), TINY_GUIDANCE[family]
    backbone = backbones.from_pipeline(pipe, resolution=TINY_RESOLUTION, guidance=guidance)
    policy = learned_policy(backbone, steps)
    policy.backbone = {"sd3": "sd35m", "flux-dev": "flux-dev", "sdxl": "sdxl"}[family]
    return pipe, backbone, policy


TEXT_OPTIONS = {  # per family, text arguments that change the output
    "sd3": dict(negative_prompt="blurry", max_sequence_length=20, guidance_scale=4.5),
    "flux-dev": dict(max_sequence_length=20, guidance_scale=3.5),
    "sdxl": dict(negative_prompt="blurry", clip_skip=1, guidance_scale=5.0),
}


@pytest.mark.parametrize("family", ["sd3", "flux-dev", "sdxl"])
def test_generate_passes_the_pipelines_text_arguments_through(family):
    """The text arguments reach the pipeline: generate gives what the pipeline gives with the
    learned times (its own call, the learned scheduler installed by hand), and not what it gives
    without them. The flows' scheduler samples stochastically here: learned_scheduler turns off
    what would change the update (EXACT) and leaves the user's scheduler untouched."""
    pipe, backbone, policy = pipe_and_policy(family)
    stochastic = "stochastic_sampling" in pipe.scheduler.config
    if stochastic:
        config = pipe.scheduler.config
        pipe.scheduler = type(pipe.scheduler).from_config(config, stochastic_sampling=True)
    options = dict(TEXT_OPTIONS[family], height=TINY_RESOLUTION, output_type="latent")
    latents = pipeline.generate(
        pipe, policy, "a cat", generator=torch.Generator().manual_seed(2), **options
    ).images
    noise = pipeline.pipeline_noise(backbone, 1, torch.Generator().manual_seed(2))
    text = {key: value for key, value in options.items() if key in pipeline.TEXT}
    cond = backbone.encode_prompts(["a cat"], **text)
    times = mean_times(policy, backbone, noise, cond)
    expected = call_with_times(pipe, backbone, times[0], prompt="a cat", latents=noise, **options)
    assert (latents - expected).abs().max().item() < 1e-5 * max(1.0, expected.abs().max().item())
    assert pipe.scheduler.config.get("stochastic_sampling", False) == stochastic
    plain = {key: value for key, value in options.items() if key not in text}
    without = pipeline.generate(
        pipe, policy, "a cat", generator=torch.Generator().manual_seed(2), **plain
    ).images
    assert (without - latents).abs().max().item() > 1e-4  # the arguments are not ignored


@pytest.mark.parametrize("family", ["sd3", "flux-dev", "sdxl"])
def test_generate_outputs_are_the_pipelines_and_the_pipeline_is_left_as_found(family):
    pipe, _, policy = pipe_and_policy(family)
    model = pipe.transformer if hasattr(pipe, "transformer") else pipe.unet
    model.train()
    pipe.set_progress_bar_config(disable=False, leave=False)
    grads = [p.requires_grad for p in model.parameters()]
    options = dict(num_images_per_prompt=2, height=TINY_RESOLUTION, output_type="np")
    arrays = pipeline.generate(pipe, policy, ["a cat", "a dog"], **options).images
    assert isinstance(arrays, np.ndarray)
    assert arrays.shape == (4, TINY_RESOLUTION, TINY_RESOLUTION, 3)
    images = pipeline.generate(pipe, policy, "a cat", height=TINY_RESOLUTION, return_dict=False)
    assert isinstance(images, tuple) and len(images[0]) == 1
    assert model.training and grads == [p.requires_grad for p in model.parameters()]
    assert pipe._progress_bar_config == dict(disable=False, leave=False)


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("sd3", dict(num_inference_steps=7), "trained for L=3 steps, not num_inference_steps=7"),
        ("sd3", dict(sigmas=[1.0, 0.5, 0.0]), "takes no sigmas"),
        ("sd3", dict(timesteps=[999, 500]), "takes no timesteps"),
        ("sd3", dict(callback_on_step_end=print), "no callback_on_step_end; install learned_sched"),
        ("sd3", dict(backbone="flux-dev"), r"trained on flux-dev \(flux\), not for a StableDiff"),
        ("sd3", dict(backbone="digits"), r"digits \(mixture\), not for a StableDiffusion3Pipeline"),
        ("sdxl", dict(config=dict(text_dim=4096)), r"built for \{.*'text_dim': 4096.*not this pip"),
        ("flux-dev", dict(kind="stepwise"), "step-wise policy .* sample.py without --pipeline"),
        ("sdxl", dict(prediction_type="v_prediction"), "only epsilon prediction with linear sigma"),
    ],
)
def test_generate_refuses_what_it_cannot_honour_in_one_line(family, change, message):
    """Arguments generate() cannot honour, a policy trained on another backbone or built for other
    inputs, a scheduler config the loop cannot run: each refused in one line."""
    pipe, backbone, policy = pipe_and_policy(family)
    arguments = dict(change)
    if arguments.pop("kind", None):  # TPDM's: its times are chosen inside the loop
        policy = learned_policy(backbone, 3, kind="stepwise")
    policy.backbone = arguments.pop("backbone", policy.backbone)
    policy.config.update(arguments.pop("config", {}))  # e.g. SD3's T5 width, not SD-XL's CLIPs'
    config = {key: arguments.pop(key) for key in ["prediction_type"] if key in arguments}
    pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, **config)
    with pytest.raises(ValueError, match=message) as error:
        pipeline.generate(pipe, policy, "a cat", height=TINY_RESOLUTION, **arguments)
    assert "\n" not in str(error.value)


def test_generate_samples_at_the_guidance_the_policy_was_trained_with():
    dims = dict(latent_channels=16, text_dim=32, pooled_dim=64)
    policy = make_policy(POLICIES["instance"], dims, 3, backbone="mini-sd3")
    assert pipeline.trained_guidance(policy) == 1.25  # the miniature's, not the SD3 pipeline's 7.0
    policy.training_config = dict(backbone="mini-sd3", guidance=2.0)
    assert pipeline.trained_guidance(policy) == 2.0
    schnell = make_policy(POLICIES["instance"], dims, 3, backbone="flux-schnell")
    assert pipeline.trained_guidance(schnell) is None


def test_generate_with_precomputed_embeddings_equals_the_pipeline_with_them():
    """Embeddings given instead of a prompt reach the model as given (the policy reads every token
    of them): generate equals the pipeline's own call on them with the learned times."""
    pipe, backbone, policy = pipe_and_policy()
    embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
        "a cat", None, None, do_classifier_free_guidance=True, max_sequence_length=77
    )
    given = dict(zip(pipeline.EMBEDS, (embeds, pooled, negative, negative_pooled)))
    options = dict(height=TINY_RESOLUTION, output_type="latent", guidance_scale=4.5)
    latents = pipeline.generate(
        pipe, policy, generator=torch.Generator().manual_seed(1), **given, **options
    ).images
    noise = pipeline.pipeline_noise(backbone, 1, torch.Generator().manual_seed(1))
    mask = torch.ones(embeds.shape[:2], dtype=torch.bool)
    times = mean_times(policy, backbone, noise, dict(given, text_mask=mask))
    expected = call_with_times(pipe, backbone, times[0], latents=noise, **given, **options)
    scale = max(1.0, expected.abs().max().item())
    assert (latents - expected).abs().max().item() < 1e-5 * scale
