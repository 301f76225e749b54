"""
Pipelines in the real diffusers families' layouts at any size, built offline (no hub ids):
`family_pipeline` lays out each family (its denoiser's class and fixed settings, its real scheduler,
its pipeline class) around the sizes and components given. miniatures/build.py trains its
miniatures in these layouts; `tiny_pipeline` is a randomly initialised one small enough for a CPU,
which the tests check the backbone code on and evidence/bench.py times ("-tiny").
"""

import torch

TINY_RESOLUTION = 32  # pixels; the tiny VAEs downsample 2x, so latents are 16x16
# the real models' values
TINY_GUIDANCE = {"sd3": 4.5, "flux-dev": 3.5, "flux-schnell": None, "sdxl": 5.0}
# the tiny denoisers' sizes; the rest of their configuration is the family's (family_pipeline)
TINY_DENOISERS = {
    "sd3": dict(
        sample_size=16,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=16,
        pooled_projection_dim=32,
        pos_embed_max_size=16,
    ),
    # latent_channels=1 packs 2x2 to in_channels=4; sum(axes_dims_rope) = attention_head_dim
    "flux": dict(
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        axes_dims_rope=[4, 4, 8],
    ),
    "sdxl": dict(
        block_out_channels=(8, 16),
        sample_size=16,
        in_channels=4,
        out_channels=4,
        transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=6 * 8 + 16,  # 6 time ids x 8 + the pooled text
        cross_attention_dim=32,
        norm_num_groups=4,
    ),
}


def family_pipeline(family, denoiser, vae, text, seed):
    """A pipeline of `family` ("sd3", "flux-dev", "flux-schnell" or "sdxl") in the real layout: the
    family's denoiser class with the sizes `denoiser` (a dict of its arguments) and the family's
    fixed settings, initialised from `seed`; SD3.5's scheduler with static shift 3, Flux-Dev's with
    dynamic shift (and a guidance embedding), Flux-Schnell's without shift (and without guidance),
    SD-XL's Euler scheduler with leading spacing (and the text-time UNet). vae() and text() build
    the VAE and the text components (a dict of the pipeline's keyword arguments), in this order,
    after the denoiser."""
    from diffusers import (
        EulerDiscreteScheduler,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )

    torch.manual_seed(seed)
    if family == "sd3":
        transformer = SD3Transformer2DModel(
            patch_size=2, out_channels=denoiser["in_channels"], **denoiser
        )
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # SD3.5's static shift
        return StableDiffusion3Pipeline(
            transformer=transformer, scheduler=scheduler, vae=vae(), **text()
        )
    if family in ("flux-dev", "flux-schnell"):
        dev = family == "flux-dev"
        transformer = FluxTransformer2DModel(patch_size=1, guidance_embeds=dev, **denoiser)
        scheduler = (
            FlowMatchEulerDiscreteScheduler(
                shift=3.0,
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=1.15,
                base_image_seq_len=256,
                max_image_seq_len=4096,
            )
            if dev
            else FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
        )
        return FluxPipeline(transformer=transformer, scheduler=scheduler, vae=vae(), **text())
    unet = UNet2DConditionModel(
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        **denoiser,
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )
    return StableDiffusionXLPipeline(
        unet=unet, scheduler=scheduler, vae=vae(), add_watermarker=False, **text()
    )


def autoencoder(channels, widths, groups, side, **factors):
    """An AutoencoderKL of two stages, 3 image channels <-> `channels` latent ones at half the
    side; `factors`: its scaling (and shift) factor."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=channels,
        block_out_channels=widths,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        norm_num_groups=groups,
        sample_size=side,
        **factors,
    )


def tiny_text(family):
    """The tiny text components of `family`: CLIP encoders on a byte-level CLIP BPE without merges
    (a token per character), and a T5 encoder for SD3 and Flux."""
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
        T5Tokenizer,
    )
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    characters = list(bytes_to_unicode().values())
    vocab = {
        **{c: i for i, c in enumerate(characters)},
        **{c + "</w>": i + 256 for i, c in enumerate(characters)},
        "<|startoftext|>": 512,
        "<|endoftext|>": 513,
    }

    def clip_tokenizer():
        return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)

    clip_config = CLIPTextConfig(
        vocab_size=514,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=16,
        bos_token_id=512,
        eos_token_id=513,
        pad_token_id=513,
        hidden_act="gelu",
    )
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)] + [
        (c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?"
    ]

    def t5():
        return T5EncoderModel(
            T5Config(
                vocab_size=44,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=2,
                relative_attention_num_buckets=8,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            )
        )

    if family == "sd3":
        return dict(
            text_encoder=CLIPTextModelWithProjection(clip_config),
            tokenizer=clip_tokenizer(),
            text_encoder_2=CLIPTextModelWithProjection(clip_config),
            tokenizer_2=clip_tokenizer(),
            text_encoder_3=t5(),
            tokenizer_3=T5Tokenizer(vocab=pieces, extra_ids=0),
        )
    if family in ("flux-dev", "flux-schnell"):
        return dict(
            text_encoder=CLIPTextModel(clip_config),
            tokenizer=clip_tokenizer(),
            text_encoder_2=t5(),
            tokenizer_2=T5Tokenizer(vocab=pieces, extra_ids=0),
        )
    return dict(
        text_encoder=CLIPTextModel(clip_config),
        tokenizer=clip_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(clip_config),
        tokenizer_2=clip_tokenizer(),
    )


def tiny_vae(channels):
    return autoencoder(
        channels, (8, 16), 4, TINY_RESOLUTION, shift_factor=0.0609, scaling_factor=1.5035
    )


def tiny_pipeline(family):
    """A randomly initialised pipeline of the real layout, small enough for a CPU test: "sd3" (two
    CLIP encoders + T5, MMDiT, SD3.5's scheduler with static shift 3), "flux-dev" (dynamic shift,
    guidance embedding), "flux-schnell" (no shift, no guidance), "sdxl" (two CLIP encoders,
    text-time UNet, SD-XL's Euler scheduler with leading spacing). Seeded: the same weights every
    time."""
    channels = 1 if family.startswith("flux") else 4
    denoiser = TINY_DENOISERS[family.split("-")[0]]
    vae, text = (lambda: tiny_vae(channels)), (lambda: tiny_text(family))
    return family_pipeline(family, denoiser, vae, text, seed=0)
