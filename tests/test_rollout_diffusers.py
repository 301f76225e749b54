"""The real backbones' code on tiny random diffusers pipelines: with the default times the loop reproduces
each pipeline's own latents; any other schedule runs exactly as given."""
import math
import time

import pytest
import torch
from diffusers import (AutoencoderKL, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                       FluxTransformer2DModel, SD3Transformer2DModel, StableDiffusion3Pipeline,
                       StableDiffusionXLPipeline, UNet2DConditionModel)
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer, T5Config,
                          T5EncoderModel, T5Tokenizer)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from rollout import from_pipeline, load_backbone

RESOLUTION = 32  # pixels; the tiny VAEs downsample 2x, so latents are 16x16
PROMPTS = ["a cat", "a red house on a hill"]

# ----------------------------------------------------------------------------------------------
# tiny components, built offline (no hub ids)


def clip_tokenizer():
    """Byte-level CLIP BPE without merges: every character is a token."""
    characters = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(characters)}
    vocab.update({c + "</w>": i + 256 for i, c in enumerate(characters)})
    vocab.update({"<|startoftext|>": 512, "<|endoftext|>": 513})
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer():
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?"]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def clip_config(width):
    return CLIPTextConfig(vocab_size=514, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                          num_attention_heads=2, projection_dim=width, bos_token_id=512, eos_token_id=513,
                          pad_token_id=513, hidden_act="gelu")


def t5_encoder(width):
    config = T5Config(vocab_size=44, d_model=width, d_kv=8, d_ff=2 * width, num_layers=2, num_heads=2,
                      relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5EncoderModel(config)


def vae(latent_channels):
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 16),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         layers_per_block=1, norm_num_groups=4, sample_size=RESOLUTION,
                         shift_factor=0.0609, scaling_factor=1.5035)


def tiny_sd3():
    """SD3.5 layout: two CLIP encoders + T5, MMDiT, the SD3.5 scheduler config (static shift 3)."""
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                        caption_projection_dim=16, pooled_projection_dim=32, pos_embed_max_size=16)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae(4),
        text_encoder=CLIPTextModelWithProjection(clip_config(16)), tokenizer=clip_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(clip_config(16)), tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5_encoder(32), tokenizer_3=t5_tokenizer())


def tiny_flux(guidance_embeds=True):
    """FLUX.1 layout; guidance_embeds=True with the dev scheduler config (dynamic shift), False = schnell."""
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=16, axes_dims_rope=[4, 4, 8],
                                         guidance_embeds=guidance_embeds)
    if guidance_embeds:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    return FluxPipeline(transformer=transformer, scheduler=scheduler, vae=vae(1),
                        text_encoder=CLIPTextModel(clip_config(16)), tokenizer=clip_tokenizer(),
                        text_encoder_2=t5_encoder(32), tokenizer_2=t5_tokenizer())


def tiny_sdxl():
    """SD-XL layout: two CLIP encoders, text-time conditioned UNet, the SD-XL Euler scheduler config."""
    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=16, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
                                use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                                transformer_layers_per_block=(1, 1), projection_class_embeddings_input_dim=6 * 8 + 16,
                                cross_attention_dim=32, norm_num_groups=4)
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       steps_offset=1, timestep_spacing="leading")
    return StableDiffusionXLPipeline(
        unet=unet, scheduler=scheduler, vae=vae(4), text_encoder=CLIPTextModel(clip_config(16)),
        tokenizer=clip_tokenizer(), text_encoder_2=CLIPTextModelWithProjection(clip_config(16)),
        tokenizer_2=clip_tokenizer(), add_watermarker=False)


BUILDERS = {"sd3": tiny_sd3, "flux-dev": tiny_flux, "flux-schnell": lambda: tiny_flux(False), "sdxl": tiny_sdxl}
GUIDANCE = {"sd3": 4.5, "flux-dev": 3.5, "flux-schnell": None, "sdxl": 5.0}


@pytest.fixture(scope="module", params=list(BUILDERS))
def tiny(request):
    """(pipeline, backbone) of one family, sharing the same modules."""
    pipe = BUILDERS[request.param]()
    return pipe, from_pipeline(pipe, resolution=RESOLUTION, guidance=GUIDANCE[request.param])


def model_of(backbone):
    return backbone.unet if hasattr(backbone, "unet") else backbone.transformer


def count_calls(module):
    calls = []
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


def relative_error(ours, theirs):
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


# ----------------------------------------------------------------------------------------------
# equivalence with the pipelines


@pytest.mark.parametrize("steps", [2, 4])
def test_default_times_reproduce_the_pipeline(tiny, steps):
    pipe, backbone = tiny
    noise = backbone.sample_noise(len(PROMPTS), torch.Generator().manual_seed(steps))
    cond = backbone.encode_prompts(PROMPTS)
    calls, handle = count_calls(model_of(backbone))
    ours = backbone.sample(noise, cond, backbone.default_times(steps).expand(len(PROMPTS), -1))
    assert len(calls) == steps  # CFG rides in the same forward
    theirs = pipe(prompt=PROMPTS, num_inference_steps=steps, guidance_scale=backbone.guidance or 0.0,
                  height=RESOLUTION, width=RESOLUTION, latents=noise.clone(), output_type="latent").images
    handle.remove()
    assert ours.shape == theirs.shape
    # float32 on CPU: the loop does the same arithmetic; what remains is rounding
    assert relative_error(ours, theirs) < 1e-5


def test_guidance_is_used_as_each_model_expects(tiny):
    pipe, backbone = tiny
    noise = backbone.sample_noise(2, torch.Generator().manual_seed(0))
    cond = backbone.encode_prompts(PROMPTS)
    times = backbone.default_times(2).expand(2, -1)
    if backbone.guidance is None:  # schnell: no guidance input at all
        assert not pipe.transformer.config.guidance_embeds and "negative_prompt_embeds" not in cond
        return
    guided = backbone.sample(noise, cond, times)
    other = from_pipeline(pipe, resolution=RESOLUTION, guidance=backbone.guidance + 2.0)
    assert relative_error(other.sample(noise, other.encode_prompts(PROMPTS), times), guided) > 1e-3


def test_a_learned_schedule_runs_exactly_as_given(tiny):
    _, backbone = tiny
    noise = backbone.sample_noise(2, torch.Generator().manual_seed(1))
    cond = backbone.encode_prompts(PROMPTS)
    default = backbone.sample(noise, cond, backbone.default_times(3).expand(2, -1))
    times = torch.tensor([1.0, 0.7, 0.3, 0.02]).expand(2, -1)
    seen = []
    model = model_of(backbone)
    def record_timestep(module, args, kwargs):
        seen.append(kwargs["timestep"] if "timestep" in kwargs else args[1])  # the UNet takes it positionally

    handle = model.register_forward_pre_hook(record_timestep, with_kwargs=True)
    custom = backbone.sample(noise, cond, times)
    handle.remove()
    assert len(seen) == 3
    assert relative_error(custom, default) > 1e-3
    # the model sees the given times, unshifted: t * 1000 (SD3), t (Flux), t * 999 (SD-XL)
    scale = {"SD3Backbone": 1000.0, "FluxBackbone": 1.0, "SDXLBackbone": 999.0}[type(backbone).__name__]
    assert torch.allclose(seen[1].float().unique(), torch.tensor([0.7 * scale]))


def test_per_sample_schedules_equal_one_by_one(tiny):
    _, backbone = tiny
    noise = backbone.sample_noise(2, torch.Generator().manual_seed(2))
    cond = backbone.encode_prompts(PROMPTS)
    times = torch.tensor([[1.0, 0.8, 0.4, 0.05], [1.0, 0.5, 0.2, 0.1]])
    batched = backbone.sample(noise, cond, times)
    for i in range(2):
        single = backbone.sample(noise[i : i + 1], {k: v[i : i + 1] for k, v in cond.items()}, times[i : i + 1])
        assert relative_error(single, batched[i : i + 1]) < 1e-5


def test_contexts_repeat_and_policy_inputs(tiny):
    _, backbone = tiny
    cond = backbone.encode_prompts(PROMPTS)
    assert all(v.shape[0] == 2 for v in cond.values())
    repeated = {k: v.repeat_interleave(3, 0) for k, v in cond.items()}
    noise = backbone.sample_noise(6, torch.Generator().manual_seed(3))
    inputs = backbone.policy_inputs(noise, repeated)
    dims = backbone.policy_dims
    assert inputs["latent"].shape == (6, dims["latent_channels"], 16, 16) and inputs["latent"].dtype == torch.float32
    assert inputs["text"].shape[0] == 6 and inputs["text"].shape[2] == dims["text_dim"]
    assert inputs["text_mask"].shape == inputs["text"].shape[:2] and inputs["text_mask"].dtype == torch.bool
    assert inputs["pooled"].shape == (6, dims["pooled_dim"])
    # the mask marks the real tokens: the long prompt has more of them
    assert inputs["text_mask"][3].sum() > inputs["text_mask"][0].sum() > 0
    assert torch.equal(inputs["text"][0], inputs["text"][2]) and not torch.equal(inputs["text"][0], inputs["text"][3])


def test_noise_is_reproducible_and_decode_matches_the_pipeline(tiny):
    pipe, backbone = tiny
    a = backbone.sample_noise(3, torch.Generator().manual_seed(4))
    b = backbone.sample_noise(3, torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    images = backbone.decode(a)
    assert images.shape == (3, 3, RESOLUTION, RESOLUTION) and images.dtype == torch.float32
    assert 0.0 <= images.min() and images.max() <= 1.0
    # chunked decode equals the pipeline's own decode
    decoded = pipe.image_processor.postprocess(
        pipe.vae.decode(_pipeline_vae_input(pipe, backbone, a), return_dict=False)[0], output_type="pt")
    assert torch.allclose(images, decoded, atol=1e-5)


def _pipeline_vae_input(pipe, backbone, latents):
    config = pipe.vae.config
    if isinstance(pipe, FluxPipeline):
        latents = pipe._unpack_latents(latents, RESOLUTION, RESOLUTION, pipe.vae_scale_factor)
    if isinstance(pipe, StableDiffusionXLPipeline):
        return latents / config.scaling_factor
    return latents / config.scaling_factor + config.shift_factor


# ----------------------------------------------------------------------------------------------
# default schedules: the values diffusers itself is known to produce


def test_default_times_match_the_library_facts():
    sd3 = from_pipeline(tiny_sd3(), resolution=RESOLUTION)
    assert torch.allclose(sd3.default_times(2), torch.tensor([1.0, 0.0089, 0.0]), atol=1e-4)  # shift 3, no sigmas
    # the tiny VAE downsamples 2x (the real one 8x): 256 px here has the 4096 image tokens of 1024 px, mu = 1.15
    flux = from_pipeline(tiny_flux(), resolution=256)
    assert torch.allclose(flux.default_times(2), torch.tensor([1.0, 0.7595, 0.0]), atol=1e-4)
    mu = 0.5 + (1024 - 256) * (1.15 - 0.5) / (4096 - 256)  # 1024 tokens (512 px on the real model): 0.63
    half = math.exp(mu) / (math.exp(mu) + 1.0)  # time_shift(mu, 1, 0.5)
    assert torch.allclose(from_pipeline(tiny_flux(), resolution=128).default_times(2), torch.tensor([1.0, half, 0.0]))
    schnell = from_pipeline(tiny_flux(False), resolution=256)  # no shift: linspace(1, 1/N, N), then 0
    assert torch.allclose(schnell.default_times(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    sdxl = from_pipeline(tiny_sdxl(), resolution=RESOLUTION)
    assert torch.allclose(sdxl.default_times(2), torch.tensor([501 / 999, 1 / 999, 0.0]))
    scheduler = EulerDiscreteScheduler.from_config(sdxl.pipe.scheduler.config)
    scheduler.set_timesteps(50)
    assert torch.allclose(sdxl.sigma(sdxl.default_times(50)), scheduler.sigmas, rtol=1e-6)
    assert sdxl.sigma(torch.tensor([1.0])).item() == pytest.approx(14.6146, abs=1e-3)
    assert sdxl.sigma(torch.tensor([0.0])).item() == 0.0


def test_reference_is_the_default_schedule_at_50_steps(tiny):
    _, backbone = tiny
    noise = backbone.sample_noise(2, torch.Generator().manual_seed(5))
    cond = backbone.encode_prompts(PROMPTS)
    schedules = []
    backbone.sample = lambda noise, cond, times: schedules.append(times) or noise
    try:
        backbone.reference(noise, cond)
    finally:
        del backbone.sample
    assert len(schedules) == 1 and torch.equal(schedules[0], backbone.default_times(50).expand(2, -1))


# ----------------------------------------------------------------------------------------------
# errors


def test_missing_weights_fail_fast_with_one_line(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache, offline
    for name, repository in [("sd35m", "stable-diffusion-3.5-medium"), ("flux-dev", "FLUX.1-dev")]:
        started = time.perf_counter()
        with pytest.raises(ValueError) as error:
            load_backbone(name)
        assert time.perf_counter() - started < 1.0
        message = str(error.value)
        assert "\n" not in message and repository in message
        assert "hf auth login" in message and "licence" in message and "--model-path" in message


def test_load_from_a_local_folder(tmp_path):
    tiny_sdxl().save_pretrained(tmp_path)
    backbone = load_backbone("sdxl", path=str(tmp_path), resolution=RESOLUTION)
    assert backbone.name == "sdxl" and backbone.guidance == 5.0 and backbone.dtype == torch.float32
    assert not backbone.unet.training and not any(p.requires_grad for p in backbone.pipe.text_encoder_2.parameters())
    assert backbone.default_times(50)[0].item() == pytest.approx(981 / 999)
    noise = backbone.sample_noise(1, torch.Generator().manual_seed(6))
    latents = backbone.sample(noise, backbone.encode_prompts(PROMPTS[:1]), backbone.default_times(2)[None])
    assert latents.shape == noise.shape


def test_bad_local_path_and_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="model_index.json"):
        load_backbone("sdxl", path=str(tmp_path))
    with pytest.raises(ValueError, match="known: sd35m, sd35l, sdxl, flux-dev, flux-schnell, digits"):
        load_backbone("sd2")
    with pytest.raises(ValueError, match="family"):
        from_pipeline(object())
