"""The trained miniatures (miniatures/build.py): the shipped folders load with the stock diffusers
classes, their images are digits the classifier reads, the digit reward scores pixels, and train.py
runs them on a CPU in float32 and bfloat16. Nothing here trains a miniature: the tests read the
shipped ones."""

import json
import os
import subprocess
import sys

import diffusers
import pytest
import torch
from conftest import ROOT, train_in_process
from test_rewards import ImageBackbone  # a backbone whose "latents" are already images

import backbones
import train
from miniatures import build as miniature
from miniatures import data, mix
from prompts import context_noise, heldout_contexts
from rewards import load_reward
from rewards.digits import ClassReward, PreferenceReward, digit_of, load_classifier

STOCK = {  # the pipeline, the denoiser, the VAE's latent channels
    "mini-sd3": (diffusers.StableDiffusion3Pipeline, diffusers.SD3Transformer2DModel, 16),
    "mini-flux": (diffusers.FluxPipeline, diffusers.FluxTransformer2DModel, 16),
    "mini-sdxl": (diffusers.StableDiffusionXLPipeline, diffusers.UNet2DConditionModel, 4),
    "mini-flux-schnell": (diffusers.FluxPipeline, diffusers.FluxTransformer2DModel, 16),
    "mini-mix": (diffusers.StableDiffusion3Pipeline, diffusers.SD3Transformer2DModel, 16),
}
# mini-flux-schnell's vae, text encoders and tokenizers are links to mini-flux's (FLUX.1-schnell
# ships the same ones as FLUX.1-dev)
SHARED = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
BF16_GAP = 0.05  # mean |digit reward difference| per context, bfloat16 against float32


@pytest.fixture(scope="module", params=[name for name in STOCK if name != "mini-mix"])
def mini(request):
    return backbones.load_backbone(request.param)


def test_the_shipped_folders_load_with_the_stock_classes_and_fit_in_19_mib():
    """19 MiB in all (mini-mix 7): mini-flux-schnell's own transformer is stored in float16 (it
    loads as float32), and it links to mini-flux's other components instead of copies."""
    folder = os.path.join(ROOT, "miniatures")
    files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
    assert sum(os.path.getsize(path) for path in files) <= 19 * 2**20  # links are not followed
    links = [
        os.path.join(root, name)
        for root, names, _ in os.walk(folder)
        for name in names
        if os.path.islink(os.path.join(root, name))
    ]
    assert sorted(os.path.basename(link) for link in links) == sorted(SHARED)
    for link in links:  # relative, and inside miniatures/: a checkout anywhere resolves them
        assert not os.path.isabs(os.readlink(link))
        assert os.path.realpath(link).startswith(os.path.realpath(folder) + os.sep)
    weights = [
        path for path in files if path.endswith((".safetensors", ".bin", ".pt", ".pth", ".ckpt"))
    ]
    assert weights and all(path.endswith(".safetensors") for path in weights)  # no pickle anywhere
    for name, (pipeline_class, denoiser_class, channels) in STOCK.items():
        pipe = pipeline_class.from_pretrained(os.path.join(folder, name))
        denoiser = pipe.transformer if hasattr(pipe, "transformer") else pipe.unet
        assert type(denoiser) is denoiser_class and type(pipe.vae) is diffusers.AutoencoderKL
        assert pipe.vae.config.latent_channels == channels


@pytest.mark.parametrize("paraphrases, least", [("training", 0.9), ("held-out", 0.75)])
def test_fifty_step_samples_are_digits_the_classifier_recognises(mini, paraphrases, least):
    """Fresh noise (seeds training never drew) with the training paraphrases: at least 90%
    recognised at 50 default steps; with the paraphrases no training saw, at least 75% (the floor
    is mini-flux's, which reads prompts through T5 alone; python -m evidence.miniatures --check
    measures 200 contexts). 80 contexts each here."""
    prompts = data.prompt_lists()[paraphrases == "held-out"]
    prompts, seeds = heldout_contexts(prompts, 80)
    reward = load_reward("digit", mini)
    noise = context_noise(mini, seeds)
    cond = mini.encode_prompts(prompts)
    latents = mini.sample(noise, cond, mini.default_times(50).expand(len(prompts), -1))
    _, correct = reward.details(latents, prompts)
    assert correct.mean().item() >= least


def test_mini_flux_schnell_is_mini_flux_distilled_without_guidance_at_4_steps(tmp_path):
    """As FLUX.1-schnell: the stock FluxPipeline loads it, its transformer has no guidance input,
    its scheduler no resolution shift (the default 4 steps are 1, 0.75, 0.5, 0.25), it trains at
    4 steps by default and refuses --guidance, its vae and text encoders are mini-flux's (the links
    tested above). At 4 steps through the stock pipeline, any guidance_scale gives the same images,
    and the classifier reads the prompted digit in at least 90% of 40 held-out contexts (`python -m
    evidence.miniatures --check` measures 200)."""
    pipe = diffusers.FluxPipeline.from_pretrained(f"{ROOT}/miniatures/mini-flux-schnell")
    assert not pipe.transformer.config.guidance_embeds
    assert pipe.transformer.dtype == torch.float32  # stored in float16, loaded as float32
    config = pipe.scheduler.config
    assert not config.use_dynamic_shifting and config.shift == 1.0
    schnell = backbones.load_backbone("mini-flux-schnell")
    assert schnell.guidance is None and train.PRESETS["mini-flux-schnell"]["steps"] == 4
    args = "--backbone mini-flux-schnell --guidance 2 --out-dir".split()
    guided = train.parse_config([*args, str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="mini-flux-schnell runs no --guidance"):
        train.check(guided, world_size=1)
    assert torch.allclose(schnell.default_times(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    prompts, seeds = heldout_contexts(data.prompt_lists()[1], 40)
    options = dict(height=16, width=16, num_inference_steps=4, max_sequence_length=12)
    images = {}
    for guidance in (0.0, 3.5):
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        images[guidance] = pipe(
            prompts, guidance_scale=guidance, generator=generators, output_type="pt", **options
        ).images
    assert torch.equal(images[0.0], images[3.5])
    with torch.no_grad():
        digits = torch.tensor([digit_of(prompt) for prompt in prompts])
        correct = load_classifier()(images[0.0]).argmax(1) == digits
    assert correct.float().mean().item() >= 0.9


def test_the_classifier_reads_digits_it_never_saw():
    (images, labels), (own_images, _) = data.split()
    assert len(images) + len(own_images) == 1797
    classifier = load_classifier()
    with torch.no_grad():
        accuracy = (classifier(images).argmax(1) == labels).float().mean().item()
    assert accuracy >= 0.97  # held out: the classifier trained on the other half only


def test_the_digit_reward_is_the_log_probability_of_the_prompted_digit():
    (images, labels), _ = data.split()
    reward = ClassReward(ImageBackbone())
    picked = images[:20]
    right = [f"a handwritten {d}" for d in labels[:20].tolist()]
    wrong = [f"the digit {(d + 5) % 10}" for d in labels[:20].tolist()]
    scores, correct = reward.details(picked, right)
    with torch.no_grad():
        expected = torch.log_softmax(reward.model(picked), 1)[torch.arange(20), labels[:20]]
    # 8-bit quantisation of already 8-bit images changes nothing
    assert torch.allclose(scores, expected, atol=1e-5)
    assert (scores <= 0).all() and correct.mean() >= 0.9
    assert (reward(picked, wrong, None, None) < scores).float().mean() >= 0.9
    with pytest.raises(ValueError, match="must name exactly one of 0, 1, 2"):
        reward.details(picked[:1], ["a red fox"])


def test_the_preference_reward_ranks_real_digits_above_their_degradations():
    """On digits it never saw (the realism reference: no miniature and neither reward model saw
    them), each real digit scores above the same digit blurred, averaged with others of its class,
    noised, erased, and above a real digit of another class: these are the judgements it was
    trained to make, measured on new digits (every pair is one draw)."""
    images, labels = data.digit_splits()["reference"]
    generator = torch.Generator().manual_seed(0)
    reward = PreferenceReward(ImageBackbone())
    prompts = [f"a handwritten {d}" for d in labels.tolist()]
    real, correct = reward.details(images, prompts)
    assert correct.mean() >= 0.97  # its accuracy column: the classifier's
    count = len(images)
    kinds = {
        "blurred": miniature.blurred(images, torch.full((count,), 1.0, dtype=images.dtype)),
        "class mean": torch.stack([images[labels == label].mean(0) for label in labels]),
        "noised": (images + 0.15 * torch.randn(images.shape, generator=generator)).clamp(0, 1),
        "other digit": miniature.of_class(
            images, labels, miniature.wrong_class(labels, generator), generator
        ),
    }
    erased = images.clone()
    erased[:, :, 4:12, 3:13] = 0
    kinds["erased"] = erased
    for kind, worse in kinds.items():
        wins = (real > reward.details(worse, prompts)[0]).float().mean().item()
        assert wins >= 0.9, f"{kind}: the real digit wins {wins:.2f} of pairs"


def test_miniature_defaults_run_on_a_cpu_with_their_paraphrases(tmp_path):
    for name in STOCK:
        config = train.parse_config(["--backbone", name, "--out-dir", str(tmp_path / "out")])
        train.check(config, world_size=1)  # no "--device cpu to insist"
        assert config.reward == "preference" and config.device is None and config.threads == 1
        prompt_files = (config.prompts, config.eval_prompts)
        assert prompt_files == backbones.BACKBONES[name]["prompts"]
    train_prompts, heldout = data.prompt_lists()
    assert not set(train_prompts) & set(heldout)
    assert {digit_of(prompt) for prompt in heldout} == set(range(10))


def test_bfloat16_rewards_are_finite_and_close_to_float32(mini):
    """The bf16 path a GPU run takes, on each miniature: the same contexts and schedule, the
    backbone in bfloat16 (the reward stays float32). BF16_GAP is set from `python -m
    evidence.miniatures --check`, whose largest per-context gap at 3 steps over 200 contexts it
    bounds with room for other contexts."""
    _, heldout = data.prompt_lists()
    prompts, seeds = heldout_contexts(heldout, 32)
    scores = {}
    for dtype in (torch.float32, torch.bfloat16):
        backbone = backbones.load_backbone(mini.name, dtype=dtype) if dtype != mini.dtype else mini
        assert backbone.dtype == dtype
        noise = context_noise(backbone, seeds)
        cond = backbone.encode_prompts(prompts)
        latents = backbone.sample(noise, cond, backbone.default_times(3).expand(len(prompts), -1))
        scores[dtype] = load_reward("digit", backbone)(latents, prompts, noise, cond)
    assert torch.isfinite(scores[torch.bfloat16]).all()
    assert (scores[torch.bfloat16] - scores[torch.float32]).abs().mean() < BF16_GAP


@pytest.mark.parametrize(
    "backbone, dtype, steps",
    [("mini-flux-schnell", None, 4), ("mini-sd3", "bfloat16", 2), ("mini-mix", None, 3)],
)
def test_train_runs_a_miniature(tmp_path, backbone, dtype, steps):
    """mini-flux-schnell at its own 4 default steps; mini-sd3 in bfloat16, as on a GPU; mini-mix
    on its own prompts, reward models and realism."""
    out = train_in_process(
        tmp_path / "out",
        *("--backbone", backbone, "--iterations", "2", "--contexts", "4", "--eval-contexts", "8"),
        *(["--steps", "2", "--dtype", dtype] if dtype else []),
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(row["reward"])) for row in rows)
    config = torch.load(out / "ckpt.pt", weights_only=True)["config"]
    assert config["dtype"] == dtype
    report = json.loads((out / "eval.json").read_text())
    assert report["steps"] == steps and {"default", "learned (mean)"} <= set(report["realism"])
    assert (out / "policy" / "model.safetensors").is_file()


def test_mini_sdxl_runs_under_warnings_as_errors():
    """diffusers' EulerDiscreteScheduler calls np.array on a tensor, which numpy 2 flags with a
    DeprecationWarning: under python -W error it must not end a mini-sdxl run."""
    code = (
        "import backbones; b = backbones.load_backbone('mini-sdxl', device='cpu');"
        "print(b.default_times(3).tolist())"
    )
    command = [sys.executable, "-W", "error", "-c", code]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(json.loads(done.stdout)) == 4


@pytest.mark.parametrize(
    "family, pinned",
    [("sd3", 24688.452073084776), ("flux", 26670.516074388885), ("sdxl", 26387.344564961135)],
)
def test_the_digit_miniatures_build_as_before_mini_mix(tmp_path, monkeypatch, family, pinned):
    """Two VAE and two denoiser updates (batches of 8) of each digit miniature's build give the
    weights they gave before mini-mix shared the build: the sum of the denoiser's |weights|."""
    monkeypatch.setattr(miniature, "VAE_UPDATES", 2)
    monkeypatch.setitem(miniature.DENOISER, family, (2, 8, 1e-3))
    pipe = STOCK[f"mini-{family}"][0].from_pretrained(
        miniature.train_family(family, out=str(tmp_path))
    )
    denoiser = pipe.transformer if hasattr(pipe, "transformer") else pipe.unet
    total = sum(weight.double().abs().sum().item() for weight in denoiser.parameters())
    assert total == pytest.approx(pinned, rel=1e-6)  # summation order aside


def test_mini_mix_draws_the_kind_and_class_its_prompts_name():
    """mini-mix (miniatures/mix.py): held-out paraphrases, fresh noise, 50 default steps at its
    guidance: its classifier reads the prompted kind in at least 80% and the prompted class in at
    least 70% of 40 contexts per kind (`python -m evidence.mix --gates` holds 200 to 90% and 80%;
    here each bound sits about 2 binomial standard errors below its gate); its class reward is
    that classifier's log-probability of the prompted class; its prompt files are mix.prompts()."""
    assert mix.prompts() == train.load_prompt_file("prompts/mix_train.txt")
    assert mix.prompts(held_out=True) == train.load_prompt_file("prompts/mix_heldout.txt")
    backbone = backbones.load_backbone("mini-mix")
    reward = load_reward("class", backbone)
    for k, kind in enumerate(mix.KINDS):
        prompts = [p for p in mix.prompts(held_out=True) if mix.KIND_OF[mix.class_of(p)] == k]
        prompts, seeds = heldout_contexts(prompts, 40)
        noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
        latents = backbone.sample(noise, cond, backbone.default_times(50).expand(40, -1))
        scores, correct = reward.details(latents, prompts)
        with torch.no_grad():
            log_probs = torch.log_softmax(reward.model(reward.pixels(latents)), 1)
        wanted = torch.tensor([mix.class_of(prompt) for prompt in prompts])
        torch.testing.assert_close(scores, log_probs[torch.arange(40), wanted])
        assert (mix.KIND_OF[log_probs.argmax(1)] == k).float().mean() >= 0.8, kind
        assert correct.mean() >= 0.7, kind
