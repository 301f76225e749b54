"""The real backbones' code on tiny random diffusers pipelines: with the default times the loop
reproduces each pipeline's own latents; any other schedule runs exactly as given."""

import contextlib
import math

import pytest
import torch
from diffusers import EulerDiscreteScheduler, FluxPipeline, StableDiffusionXLPipeline

import train
from backbones import from_pipeline, load_backbone
from miniatures.layouts import TINY_GUIDANCE, tiny_pipeline
from miniatures.layouts import TINY_RESOLUTION as RESOLUTION

PROMPTS = ["a cat", "a red house on a hill"]


@pytest.fixture(scope="module", params=list(TINY_GUIDANCE))
def tiny(request):
    """(pipeline, backbone) of one family, sharing the same modules."""
    pipe = tiny_pipeline(request.param)
    return pipe, from_pipeline(pipe, resolution=RESOLUTION, guidance=TINY_GUIDANCE[request.param])


def relative_error(ours, theirs):
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


# ----------------------------------------------------------------------------------------------
# equivalence with the pipelines


@pytest.mark.parametrize("steps", [2, 4])
def test_default_times_reproduce_the_pipeline(tiny, steps):
    pipe, backbone = tiny
    noise = backbone.sample_noise(len(PROMPTS), torch.Generator().manual_seed(steps))
    cond = backbone.encode_prompts(PROMPTS)
    calls = []
    handle = backbone.model.register_forward_hook(lambda *_: calls.append(1))
    ours = backbone.sample(noise, cond, backbone.default_times(steps).expand(len(PROMPTS), -1))
    assert len(calls) == steps  # CFG rides in the same forward
    options = dict(num_inference_steps=steps, guidance_scale=backbone.guidance or 0.0)
    options |= dict(height=RESOLUTION, width=RESOLUTION, output_type="latent")
    theirs = pipe(prompt=PROMPTS, latents=noise.clone(), **options).images
    handle.remove()
    assert ours.shape == theirs.shape
    # float32 on CPU: the loop does the same arithmetic; what remains is rounding
    assert relative_error(ours, theirs) < 1e-5


def test_learned_schedules_run_exactly_as_given_per_sample(tiny):
    _, backbone = tiny
    noise = backbone.sample_noise(2, torch.Generator().manual_seed(1))
    cond = backbone.encode_prompts(PROMPTS)
    default = backbone.sample(noise, cond, backbone.default_times(3).expand(2, -1))
    times = torch.tensor([1.0, 0.7, 0.3, 0.02]).expand(2, -1)
    seen = []

    def record_timestep(module, args, kwargs):
        # the UNet takes it positionally
        seen.append(kwargs["timestep"] if "timestep" in kwargs else args[1])

    handle = backbone.model.register_forward_pre_hook(record_timestep, with_kwargs=True)
    custom = backbone.sample(noise, cond, times)
    handle.remove()
    assert len(seen) == 3
    assert relative_error(custom, default) > 1e-3
    # the model sees the given times, unshifted: t * 1000 (SD3), t (Flux), t * 999 (SD-XL)
    scales = {"SD3Backbone": 1000.0, "FluxBackbone": 1.0, "SDXLBackbone": 999.0}
    scale = scales[type(backbone).__name__]
    assert torch.allclose(seen[1].float().unique(), torch.tensor([0.7 * scale]))
    # per-sample schedules in one batch equal each sample alone
    times = torch.tensor([[1.0, 0.8, 0.4, 0.05], [1.0, 0.5, 0.2, 0.1]])
    batched = backbone.sample(noise, cond, times)
    for one in (slice(0, 1), slice(1, 2)):
        single = backbone.sample(noise[one], {k: v[one] for k, v in cond.items()}, times[one])
        assert relative_error(single, batched[one]) < 1e-5


def test_decode_matches_the_pipeline(tiny):
    pipe, backbone = tiny
    latents = backbone.sample_noise(3, torch.Generator().manual_seed(4))
    images = backbone.decode(latents)
    assert images.shape == (3, 3, RESOLUTION, RESOLUTION) and images.dtype == torch.float32
    # chunked decode equals the pipeline's own decode
    raw = pipe.vae.decode(_pipeline_vae_input(pipe, latents), return_dict=False)[0]
    decoded = pipe.image_processor.postprocess(raw, output_type="pt")
    assert torch.allclose(images, decoded, atol=1e-5)


def test_a_float16_sdxl_vae_decodes_in_float32_as_the_pipeline_does():
    """SD-XL's VAE overflows in float16: upcast for the decode (force_upcast), then cast back."""
    pipe = tiny_pipeline("sdxl")
    pipe.vae.to(torch.float16)
    backbone, seen = from_pipeline(pipe, resolution=RESOLUTION), []
    pipe.vae.decoder.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    latents = backbone.sample_noise(2, torch.Generator().manual_seed(4))
    images = backbone.decode(latents)
    assert seen == [torch.float32] and pipe.vae.dtype == torch.float16
    pipe.vae.to(torch.float32)  # the same (rounded) weights in float32
    torch.testing.assert_close(images, backbone.decode(latents), rtol=0, atol=0)


def _pipeline_vae_input(pipe, latents):
    config = pipe.vae.config
    if isinstance(pipe, FluxPipeline):
        latents = pipe._unpack_latents(latents, RESOLUTION, RESOLUTION, pipe.vae_scale_factor)
    shift = 0.0 if isinstance(pipe, StableDiffusionXLPipeline) else config.shift_factor
    return latents / config.scaling_factor + shift


# ----------------------------------------------------------------------------------------------
# default schedules: the values diffusers itself is known to produce


def test_default_times_match_the_library_facts():
    sd3 = from_pipeline(tiny_pipeline("sd3"), resolution=RESOLUTION)
    # shift 3, no sigmas
    assert torch.allclose(sd3.default_times(2), torch.tensor([1.0, 0.0089, 0.0]), atol=1e-4)
    # the tiny VAE downsamples 2x (the real one 8x): 256 px here has the 4096 image tokens of
    # 1024 px, mu = 1.15
    flux = from_pipeline(tiny_pipeline("flux-dev"), resolution=256)
    assert torch.allclose(flux.default_times(2), torch.tensor([1.0, 0.7595, 0.0]), atol=1e-4)
    # 1024 tokens (512 px on the real model): 0.63
    mu = 0.5 + (1024 - 256) * (1.15 - 0.5) / (4096 - 256)
    half = math.exp(mu) / (math.exp(mu) + 1.0)  # time_shift(mu, 1, 0.5)
    smaller = from_pipeline(tiny_pipeline("flux-dev"), resolution=128)
    assert torch.allclose(smaller.default_times(2), torch.tensor([1.0, half, 0.0]))
    # no shift: linspace(1, 1/N, N), then 0
    schnell = from_pipeline(tiny_pipeline("flux-schnell"), resolution=256)
    assert torch.allclose(schnell.default_times(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    sdxl = from_pipeline(tiny_pipeline("sdxl"), resolution=RESOLUTION)
    assert torch.allclose(sdxl.default_times(2), torch.tensor([501 / 999, 1 / 999, 0.0]))
    scheduler = EulerDiscreteScheduler.from_config(sdxl.pipe.scheduler.config)
    scheduler.set_timesteps(50)
    assert torch.allclose(sdxl.sigma(sdxl.default_times(50)), scheduler.sigmas, rtol=1e-6)
    assert sdxl.sigma(torch.tensor([1.0])).item() == pytest.approx(14.6146, abs=1e-3)
    assert sdxl.sigma(torch.tensor([0.0])).item() == 0.0


@pytest.mark.parametrize("family", list(TINY_GUIDANCE))
def test_kept_encodings_are_the_rows_encode_prompt_gives_in_the_policys_dims(family):
    """keep_encoded: a prompt set encoded once (the negative row once), the text encoders dropped;
    encode_prompts then gives each prompt's rows as encode_prompt does, read in policy_dims."""
    pipe, guidance = tiny_pipeline(family), TINY_GUIDANCE[family]
    backbone = from_pipeline(pipe, resolution=RESOLUTION, guidance=guidance)
    expected = backbone.encode_prompts(PROMPTS[::-1])
    assert backbone.keep_encoded(["a dog", *PROMPTS]) and pipe.text_encoder is None
    kept = backbone.encode_prompts(PROMPTS[::-1])
    for key, value in expected.items():
        torch.testing.assert_close(kept[key], value, rtol=1e-6, atol=1e-6)
    inputs, dims = backbone.policy_inputs(backbone.sample_noise(2), kept), backbone.policy_dims
    assert inputs["latent"].shape == (2, dims["latent_channels"], 16, 16)
    assert inputs["text"].shape[2] == dims["text_dim"]
    assert inputs["pooled"].shape == (2, dims["pooled_dim"])
    assert inputs["text_mask"][0].sum() > inputs["text_mask"][1].sum() > 0  # the long prompt's


def test_the_backbone_computes_on_the_pipelines_execution_device(monkeypatch):
    """Under enable_model_cpu_offload the model's weights wait on the CPU and the pipeline computes
    on the GPU, its _execution_device: the backbone's tensors go there, SD-XL's noise table once."""
    monkeypatch.setattr(StableDiffusionXLPipeline, "_execution_device", torch.device("meta"))
    backbone = from_pipeline(tiny_pipeline("sdxl"), resolution=RESOLUTION)
    assert backbone.model.device.type == "cpu" and backbone.device.type == "meta"
    assert backbone.noise_table.device.type == "meta"


@pytest.mark.parametrize(
    "name, refused",
    [
        ("_native_math", None),
        ("bogus", "--attention bogus: "),
        ("_native_cudnn", "--attention _native_cudnn: "),  # not on a CPU
    ],
)
def test_attention_goes_to_fluxs_processors_alone_else_one_line(name, refused):
    """--attention (Flux's: SD3's and SD-XL's processors call torch's SDPA, the door refuses them)
    is set on this model's processors alone, diffusers' default stays; else one line."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    backbone = from_pipeline(tiny_pipeline("flux-dev"), resolution=RESOLUTION)
    default = registry._active_backend
    if refused:
        with pytest.raises(ValueError, match=refused) as error:
            backbone.set_attention(name)
        assert "\n" not in str(error.value)
        return
    backbone.set_attention(name)
    processors = backbone.model.attn_processors.values()
    assert all(processor._attention_backend == name for processor in processors)
    assert registry._active_backend == default


# ----------------------------------------------------------------------------------------------
# the door


def test_a_prompt_past_the_window_is_refused_where_the_reward_reads_it_else_noted(capsys):
    backbone = load_backbone("mini-sd3", device="cpu")  # text encoders of 12 tokens
    short = "an image of a handwritten 7"
    long = "an image of a handwritten digit drawn slowly with a thick black marker, the digit 7"
    backbone.check_prompts([short] * 3, "digit")
    with pytest.raises(ValueError, match="the digit reward scores the words that are cut"):
        backbone.check_prompts([short, long], "digit")
    capsys.readouterr()
    backbone.check_prompts([long] * 3, "teacher")  # the same prompt: one note, one line
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("note: 1 prompt(s) are longer") and "\n" not in printed


@pytest.mark.parametrize(
    "arguments, refused",
    [
        (("--backbone", "mini-sd3", "--dtype", "float16"), "float16"),  # the flows overflow in it
        (("--backbone", "mini-flux", "--dtype", "float16"), "float16"),
        (("--backbone", "mini-sdxl", "--dtype", "float16"), None),  # SD-XL's pipeline runs in it
        (("--backbone", "mini-sdxl", "--attention", "native"), "Flux's attention only"),
        (("--backbone", "mini-flux", "--attention", "bogus"), "--attention: one of flash, "),
    ],
)
def test_the_door_refuses_float16_flows_and_attention_it_cannot_apply(tmp_path, arguments, refused):
    config = train.parse_config(["--out-dir", str(tmp_path / "out"), *arguments])
    with pytest.raises(SystemExit, match=refused) if refused else contextlib.nullcontext():
        train.check(config, 1)
