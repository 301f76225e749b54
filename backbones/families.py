"""
The diffusers backbones (SD3 / 3.5, FLUX.1, SD-XL): a pipeline's frozen components driven by
rollout.run_schedule; with `default_times(L)` each reproduces its pipeline's latents
(tests/test_rollout_diffusers.py).
"""

import inspect
import warnings

import torch

from prompts import shown
from rollout import Backbone

# SD-XL's EulerDiscreteScheduler calls np.array on a tensor, which numpy 2 flags on every call:
# harmless, and fatal under python -W error
warnings.filterwarnings(
    "ignore", "__array__ implementation doesn't accept a copy", DeprecationWarning, "diffusers"
)

# the rewards that score named words of the prompt (the digit, the quoted text, the objects)
PROMPT_REWARDS = ("digit", "preference", "ocr", "geneval")
# host memory for a prompt set encoded once (keep_encoded): Flux-Dev's T5 rows are 4 MB per prompt
KEPT_BYTES = 8 * 2**30
NEGATIVES = ("negative_prompt_embeds", "negative_pooled_prompt_embeds")
# pixels per VAE decode call: four 1024^2 images, a whole batch of small ones
DECODE_PIXELS = 4 * 1024**2


class PipelineBackbone(Backbone):
    """What the three families share."""

    cfg = False  # true CFG: a [uncond; cond] batch per model call (SD3, SD-XL)
    kept = rows = None  # keep_encoded's encodings and each prompt's row in them

    def __init__(self, pipe, model, name, resolution, guidance, multiple):
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.eval().requires_grad_(False)
        pipe.set_progress_bar_config(disable=True)
        self.pipe, self.model, self.name, self.prompts = pipe, model, name, None
        # where the pipeline computes: the GPU also under enable_model_cpu_offload (weights on CPU)
        self.device, self.dtype = pipe._execution_device, model.dtype
        self.guidance = _call_default(pipe, "guidance_scale") if guidance is None else guidance
        self.resolution = side = resolution or pipe.default_sample_size * pipe.vae_scale_factor
        self.latent_size = side // pipe.vae_scale_factor  # the latents' side (Flux: unpacked)
        if side % multiple:
            raise ValueError(f"{name}: resolution must be a multiple of {multiple}, got {side}")

    def check_prompts(self, prompts, reward=None):
        """A prompt longer than every text encoder's window loses its end: ValueError when `reward`
        scores the prompt's words, else a note."""
        names, cut = ("tokenizer", "tokenizer_2", "tokenizer_3"), []
        tokenizers = [getattr(self.pipe, name, None) for name in names]
        tokenizers = [tokenizer for tokenizer in tokenizers if tokenizer is not None]
        for prompt in dict.fromkeys(prompts) if tokenizers else []:
            counts = []
            for tokenizer in tokenizers:
                window = tokenizer.model_max_length
                if "T5" in type(tokenizer).__name__:  # the pipeline's max_sequence_length
                    window = min(window, self.text_length)
                counts.append((len(tokenizer(prompt, verbose=False).input_ids), window))
            if all(count > window for count, window in counts):
                cut.append((prompt, *max(counts, key=lambda pair: pair[1])))
        if not cut:
            return
        prompt, count, window = cut[0]
        what = (
            f"{len(cut)} prompt(s) are longer than the text encoders' window, so their end is cut "
            f"(e.g. {shown(prompt)}: {count} tokens, the window {window})"
        )
        if reward in PROMPT_REWARDS:
            raise ValueError(
                f"{what}; the {reward} reward scores the words that are cut: shorten them"
            )
        print(f"note: {what}")

    @torch.no_grad()
    def encode_prompts(self, prompts, **options):
        """The pipeline's encode_prompt (`options` as its __call__ takes them), or the kept
        encodings of keep_encoded."""
        if self.kept is None or options:
            return self.encode_text(prompts, **options)
        missing = [prompt for prompt in prompts if prompt not in self.rows]
        if missing:
            raise ValueError(f"{shown(missing[0])} is not among the prompts keep_encoded encoded")
        picks = torch.tensor([self.rows[prompt] for prompt in prompts])
        return {  # the negative's one row, kept on the device, stands for every prompt's
            key: value[picks * 0 if key in NEGATIVES else picks].to(self.device)
            for key, value in self.kept.items()
        }

    @torch.no_grad()
    def keep_encoded(self, prompts):
        """Encode a prompt set once, kept on the CPU, where it fits in KEPT_BYTES (the shipped
        sets do; HPDv2's 10^5 prompts do not): encode_prompts then serves these prompts from it,
        the negative (empty) prompt is encoded once for all, and the text encoders are dropped
        (T5-XXL alone is 9.5 GB). Returns whether it did; if not, each batch is encoded as it
        comes, the encoders kept."""
        prompts = list(dict.fromkeys(prompts))
        if self.kept is not None and all(prompt in self.rows for prompt in prompts):
            return True  # kept already: a backbone that several runs share
        chunks, rows = [prompts[i : i + 64] for i in range(0, len(prompts), 64)], []
        # on the CPU, not page-locked: a batch's rows go to the GPU just before its model call
        for chunk in chunks:
            rows.append({key: value.cpu() for key, value in self.encode_text(chunk, False).items()})
            per_prompt = sum(value.nbytes for value in rows[-1].values()) / len(chunk)
            if per_prompt * len(prompts) > KEPT_BYTES:
                return False
        kept = {key: torch.cat([row[key] for row in rows]) for key in rows[0]}
        if self.cfg:  # the negative row that the pipeline encodes for every prompt, once
            negative = self.encode_text(prompts[:1])
            kept |= {key: value for key, value in negative.items() if key in NEGATIVES}
        self.kept, self.rows = kept, {prompt: row for row, prompt in enumerate(prompts)}
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            if getattr(self.pipe, name, None) is not None:
                setattr(self.pipe, name, None)
        return True

    def set_attention(self, name):
        """diffusers' attention backend `name` on this model's processors alone (Flux's: SD3's and
        SD-XL's call torch's SDPA themselves), not as every model's default; ValueError in one line
        where it cannot run: a package missing, a probe call failing on this device and dtype."""
        from diffusers.models import attention_dispatch as dispatch

        processors = self.model.attn_processors.values()
        processors = [p for p in processors if hasattr(p, "_attention_backend")]
        assert processors, f"{self.name}: --attention reaches Flux's attention only"
        head = self.model.config.attention_head_dim
        probe = torch.zeros(1, 8, 1, head, device=self.device, dtype=self.dtype)  # (N, S, H, D)
        try:  # the name, what set_attention_backend checks and fetches, then one call
            backend = dispatch.AttentionBackendName(name)
            dispatch._check_attention_backend_requirements(backend)
            dispatch._maybe_download_kernel_for_backend(backend)
            dispatch.dispatch_attention_fn(probe, probe, probe, backend=backend)
        except (OSError, ImportError, RuntimeError, ValueError) as error:
            raise ValueError(f"--attention {name}: {' '.join(str(error).split())}") from error
        for processor in processors:
            processor._attention_backend = backend

    def guide(self, prediction):
        """Classifier-free guidance over a batch stacked [uncond; cond], as the pipelines do."""
        if not self.cfg:
            return prediction
        uncond, cond = prediction.chunk(2)
        return uncond + self.guidance * (cond - uncond)

    def cfg_batch(self, cond, *keys):
        """The tensors `keys` of cond, stacked [negative; positive] under true CFG."""
        if not self.cfg:
            return [cond[key] for key in keys]
        return [torch.cat([cond["negative_" + key], cond[key]]) for key in keys]

    def text_cond(self, prompts, masks, embeds, uncond, pooled, uncond_pooled, **extra):
        """cond from encode_prompt's outputs; text_mask (N, S) True = a real token (all of them for
        precomputed embeddings, prompts None)."""
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool)
        if prompts is not None:
            mask = torch.cat([_token_mask(*part) for part in masks], dim=1)
        cond = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, **extra)
        cond["text_mask"] = mask.to(self.device)
        if uncond is not None:
            cond.update(negative_prompt_embeds=uncond, negative_pooled_prompt_embeds=uncond_pooled)
        return cond

    @torch.no_grad()
    def decode(self, latents):
        # VaeImageProcessor.denormalize
        return (self.decode_raw(latents).float() / 2 + 0.5).clamp(0, 1)

    def decode_raw(self, latents):
        """The VAE's output in [-1, 1] (N, 3, H, W), decoded as the pipeline does."""
        vae, parts = self.pipe.vae, latents.split(max(1, DECODE_PIXELS // self.resolution**2))
        decoded = [vae.decode(self.vae_input(p).to(vae.dtype), return_dict=False)[0] for p in parts]
        return torch.cat(decoded)

    def vae_input(self, latents):
        """What the VAE decodes: the flows' latents unscaled and unshifted (SD-XL has its own)."""
        config = self.pipe.vae.config
        return self.as_image(latents) / config.scaling_factor + config.shift_factor


def attention_backends():
    """The names --attention takes: diffusers' AttentionBackendName."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [backend.value for backend in AttentionBackendName]


def _call_default(pipe, argument):
    """The pipeline's own default for a __call__ argument."""
    return inspect.signature(type(pipe).__call__).parameters[argument].default


def _text_length(pipe, t5_tokenizer):
    """The pipeline's default max_sequence_length, or its T5 tokenizer's when shorter."""
    default = _call_default(pipe, "max_sequence_length")
    return min(default, t5_tokenizer.model_max_length) if t5_tokenizer is not None else default


def _token_mask(tokenizer, prompts, length):
    """(N, length) bool, True = a real token, exactly as the pipeline pads and truncates."""
    if tokenizer is None:
        return torch.zeros(len(prompts), length, dtype=torch.bool)
    tokens = tokenizer(
        prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
    )
    return tokens.attention_mask.bool()


def _transformer_dims(config, latent_channels):
    """policy_dims of an MMDiT (SD3, Flux)."""
    text_dim, pooled_dim = config.joint_attention_dim, config.pooled_projection_dim
    return dict(latent_channels=latent_channels, text_dim=text_dim, pooled_dim=pooled_dim)


class SD3Backbone(PipelineBackbone):
    """Stable Diffusion 3 / 3.5 (rectified flow, MMDiT); t is the flow sigma."""

    pipeline = "StableDiffusion3Pipeline"  # the diffusers pipeline it runs in

    def __init__(self, pipe, name="sd3", resolution=None, guidance=None):
        multiple = pipe.vae_scale_factor * pipe.transformer.config.patch_size
        super().__init__(pipe, pipe.transformer, name, resolution, guidance, multiple)
        self.cfg = self.guidance > 1  # the pipeline's do_classifier_free_guidance
        self.text_length = _text_length(pipe, pipe.tokenizer_3)
        config = self.model.config
        self.latent_shape = (config.in_channels, self.latent_size, self.latent_size)
        self.policy_dims = _transformer_dims(config, config.in_channels)

    @torch.no_grad()
    def encode_text(self, prompts, negatives=True, max_sequence_length=None, **options):
        pipe, length = self.pipe, max_sequence_length or self.text_length
        clip = (pipe.tokenizer, prompts, pipe.tokenizer_max_length)
        t5 = (pipe.tokenizer_3, options.get("prompt_3") or prompts, length)  # T5's own prompt
        options = dict(prompt_2=None, prompt_3=None) | options  # SD3's required arguments
        options.update(device=self.device, do_classifier_free_guidance=self.cfg and negatives)
        outputs = pipe.encode_prompt(prompt=prompts, max_sequence_length=length, **options)
        return self.text_cond(prompts, (clip, t5), *outputs)

    def default_times(self, steps):
        # SD3Pipeline passes no sigmas: the scheduler's spacing and static shift
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        scheduler.set_timesteps(steps)
        return scheduler.sigmas.float()

    def ode(self, noise, cond, start):
        text, pooled = self.cfg_batch(cond, "prompt_embeds", "pooled_prompt_embeds")
        copies = 2 if self.cfg else 1

        def velocity(state, t):
            prediction = self.model(
                hidden_states=state.to(self.dtype).repeat(copies, 1, 1, 1),
                timestep=(t * 1000).repeat(copies),  # the pipeline's timesteps = sigmas * 1000
                encoder_hidden_states=text,
                pooled_projections=pooled,
                return_dict=False,
            )[0]
            return self.guide(prediction)

        return velocity, noise.float(), None


class FluxBackbone(PipelineBackbone):
    """FLUX.1 dev / schnell (rectified flow, packed 2x2 latent tokens); t is the flow sigma.
    Flux-Dev takes the distilled guidance embedding, Flux-Schnell no guidance; no CFG batch."""

    pipeline = "FluxPipeline"

    def __init__(self, pipe, name="flux", resolution=None, guidance=None):
        multiple = pipe.vae_scale_factor * 2
        super().__init__(pipe, pipe.transformer, name, resolution, guidance, multiple)
        config = self.model.config
        if not config.guidance_embeds:  # schnell: no guidance input
            self.guidance = None
        self.text_length = _text_length(pipe, pipe.tokenizer_2)
        self.latent_channels = config.in_channels // 4
        self.latent_shape = (self.latent_channels, self.latent_size, self.latent_size)  # unpacked
        self.policy_dims = _transformer_dims(config, self.latent_channels)

    @torch.no_grad()
    def encode_text(self, prompts, negatives=True, max_sequence_length=None, **options):
        length = max_sequence_length or self.text_length
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=length, **options
        )
        t5 = (self.pipe.tokenizer_2, options.get("prompt_2") or prompts, length)
        return self.text_cond(prompts, (t5,), embeds, None, pooled, None)

    def pack(self, latents):
        size = self.latent_size
        return self.pipe._pack_latents(latents, latents.shape[0], self.latent_channels, size, size)

    def sample_noise(self, n, generator=None):
        return self.pack(super().sample_noise(n, generator))  # (N, tokens, 4 C)

    def as_image(self, tokens):
        side = self.resolution
        return self.pipe._unpack_latents(tokens, side, side, self.pipe.vae_scale_factor)

    def default_times(self, steps):
        # FluxPipeline: sigmas linspace(1, 1/N, N), shifted by mu(image tokens) with the config's
        # values or the pipeline's defaults below; schnell's config has no shift
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.pipe.scheduler.config
        tokens = (self.latent_size // 2) ** 2
        keys = dict(base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
        mu = calculate_shift(tokens, *[config.get(key, default) for key, default in keys.items()])
        scheduler = type(self.pipe.scheduler).from_config(config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        return scheduler.sigmas.float()

    def ode(self, noise, cond, start):
        count, patches = noise.shape[0], self.latent_size // 2
        device, dtype = self.device, self.dtype
        image_ids = self.pipe._prepare_latent_image_ids(count, patches, patches, device, dtype)
        text_ids = torch.zeros(cond["prompt_embeds"].shape[1], 3, device=device, dtype=dtype)
        guidance = None
        if self.guidance is not None:
            guidance = torch.full((count,), float(self.guidance), device=device)

        def velocity(state, t):
            return self.model(
                hidden_states=state.to(dtype),
                timestep=t.to(dtype),
                guidance=guidance,
                pooled_projections=cond["pooled_prompt_embeds"],
                encoder_hidden_states=cond["prompt_embeds"],
                txt_ids=text_ids,
                img_ids=image_ids,
                return_dict=False,
            )[0]

        return velocity, noise.float(), None


class SDXLBackbone(PipelineBackbone):
    """Stable Diffusion XL (epsilon prediction) integrated as the Euler sampler does: x = x_0 +
    sigma * noise, the model sees x / sqrt(sigma^2 + 1) at timestep t * 999, dx / dsigma = the
    predicted noise, sigma(t) interpolated in the noise table, sigma(0) = 0."""

    pipeline = "StableDiffusionXLPipeline"

    def __init__(self, pipe, name="sdxl", resolution=None, guidance=None):
        multiple = pipe.vae_scale_factor * 2 ** (len(pipe.unet.config.block_out_channels) - 1)
        super().__init__(pipe, pipe.unet, name, resolution, guidance, multiple)
        self.cfg = self.guidance > 1
        config = pipe.scheduler.config
        linear = config.interpolation_type == "linear" and not config.get("use_karras_sigmas")
        discrete = config.get("timestep_type", "discrete") == "discrete"
        if config.prediction_type != "epsilon" or not linear or not discrete:
            raise ValueError(
                f"{name}: only epsilon prediction with linear sigma interpolation on "
                "discrete timesteps is supported"
            )
        alphas = type(pipe.scheduler).from_config(config).alphas_cumprod.to(self.device)  # once
        self.noise_table = ((1 - alphas) / alphas).double() ** 0.5  # (1000,) sigmas, on the device
        unet = self.model.config
        self.latent_shape = (unet.in_channels, self.latent_size, self.latent_size)
        self.policy_dims = dict(
            latent_channels=unet.in_channels,
            text_dim=unet.cross_attention_dim,
            pooled_dim=pipe.text_encoder_2.config.projection_dim,
        )

    def sigma(self, times):
        """sigma(t): linear interpolation of the noise table at timestep t * 999; t = 0 -> 0."""
        last = len(self.noise_table) - 1
        # the product in float32: integer timesteps stay exact
        timestep = (times.float() * last).double().clamp(0, last)
        low = timestep.floor().long().clamp(max=last - 1)
        weight = timestep - low
        table = self.noise_table.to(times.device)  # a copy only for times on another device
        sigma = table[low] * (1 - weight) + table[low + 1] * weight
        return torch.where(times > 0, sigma, torch.zeros_like(sigma)).float()

    @torch.no_grad()
    def encode_text(self, prompts, negatives=True, **options):
        pipe, cfg = self.pipe, self.cfg and negatives
        outputs = pipe.encode_prompt(
            prompt=prompts, device=self.device, do_classifier_free_guidance=cfg, **options
        )
        size, embeds = (self.resolution, self.resolution), outputs[0]
        projection = pipe.text_encoder_2.config.projection_dim
        time_ids = pipe._get_add_time_ids(
            size, (0, 0), size, dtype=embeds.dtype, text_encoder_projection_dim=projection
        )
        time_ids = time_ids.to(self.device).repeat(len(embeds), 1)  # (N, 6)
        clip = (pipe.tokenizer, prompts, pipe.tokenizer.model_max_length)
        return self.text_cond(prompts, (clip,), *outputs, time_ids=time_ids)

    def default_times(self, steps):
        # the pipeline's EulerDiscreteScheduler spacing ("leading" for SD-XL: t_0 < 1), then 0
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        scheduler.set_timesteps(steps)
        last = scheduler.config.num_train_timesteps - 1
        return torch.cat([scheduler.timesteps.float() / last, torch.zeros(1)])

    def ode(self, noise, cond, start):
        text, pooled = self.cfg_batch(cond, "prompt_embeds", "pooled_prompt_embeds")
        copies = 2 if self.cfg else 1
        time_ids = cond["time_ids"].repeat(copies, 1)
        view = (-1, 1, 1, 1)

        def epsilon(state, t):
            sigma = self.sigma(t).view(view)
            model_input = (state / (sigma**2 + 1) ** 0.5).to(self.dtype)  # scale_model_input
            prediction = self.model(
                model_input.repeat(copies, 1, 1, 1),
                (t * 999).repeat(copies),
                encoder_hidden_states=text,
                return_dict=False,
                added_cond_kwargs=dict(text_embeds=pooled, time_ids=time_ids),
            )[0]
            return self.guide(prediction)

        # the pipeline's init_noise_sigma: sqrt(sigma_0^2 + 1) ("leading" spacing) or sigma_0
        first = self.sigma(start).to(noise.device).view(view)
        leading = self.pipe.scheduler.config.timestep_spacing == "leading"
        scale = (first**2 + 1) ** 0.5 if leading else first
        return epsilon, noise.float() * scale, self.sigma

    def decode_raw(self, latents):
        """As the pipeline decodes: a float16 VAE that asks for it (SD-XL's overflows to NaN) is
        upcast to float32 for the decode, then cast back."""
        vae = self.pipe.vae
        if not (vae.dtype == torch.float16 and vae.config.force_upcast):
            return super().decode_raw(latents)
        vae.to(torch.float32)
        try:
            return super().decode_raw(latents)
        finally:
            vae.to(torch.float16)

    def vae_input(self, latents):
        config = self.pipe.vae.config  # SD-XL's pipeline scales, and shifts by no shift_factor
        assert getattr(config, "latents_mean", None) is None, "a VAE with latents_mean: not SD-XL's"
        return latents / config.scaling_factor
