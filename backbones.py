"""
Every backbone by name: its model facts (BACKBONES) and where its weights come from (the hub, a
local folder, or a miniature shipped in this repository), and load_backbone(name), which builds
the frozen backbone: a diffusers pipeline of families.py or an embedded mixture of mixture.py.
Missing, gated or incomplete weights end in one line that says how to get them. make_policy
builds a policy (policy.py's, or stepwise.py's) at the size each backbone gets (PRESETS);
build_policy rebuilds one from its `.config`; from_pipeline wraps an already built diffusers
pipeline (the tests' tiny random ones).
"""

import os

import torch

from families import FluxBackbone, SD3Backbone, SDXLBackbone
from hub import hub_file
from mixture import MixtureBackbone
from policy import GlobalPolicy, SchedulePolicy, json_times
from stepwise import StepwisePolicy

# +0.5 on the top four rows of an 8x8 digit, -0.5 on the bottom four (digits-xor)
TOP = torch.tensor([0.5] * 32 + [-0.5] * 32, dtype=torch.float64)
REPOSITORY = os.path.dirname(os.path.abspath(__file__))

# the diffusers families (families.py), and the pipeline class each loads
FAMILIES = {"sd3": SD3Backbone, "flux": FluxBackbone, "sdxl": SDXLBackbone}
PIPELINES = {
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
    "sdxl": "StableDiffusionXLPipeline",
}


def from_pipeline(pipe, family=None, name=None, resolution=None, guidance=None):
    """Wrap an already built diffusers pipeline (how the tests inject tiny random ones)."""
    family = family or {cls: key for key, cls in PIPELINES.items()}.get(type(pipe).__name__)
    if family not in FAMILIES:
        raise ValueError(
            f"cannot tell the family of {type(pipe).__name__}; pass family= one of "
            f"{', '.join(FAMILIES)}"
        )
    return FAMILIES[family](pipe, name=name or family, resolution=resolution, guidance=guidance)


# Model facts per backbone (train.py's TRAINING holds the training defaults). family: the class that
# runs it; hub_id: its diffusers weights; resolution: the image side; guidance: the true-CFG scale
# (SD3.5, SD-XL), the distilled guidance embedding (Flux-Dev) or None (no guidance input): the
# values recommended by the SD3.5 model cards (Medium 4.5, Large 3.5) and the SD-XL and Flux-Dev
# pipelines' defaults (5.0, 3.5). policy: the size in PRESETS. threads: CPU threads (None: torch's
# default; the small backbones' tensors are tiny, so a second thread only adds contention).
REAL = dict(resolution=1024, policy="real", threads=None)
EMBEDDED = dict(
    family="mixture", hub_id=None, resolution=8, guidance=None, policy="embedded", threads=1
)
MINIATURE = dict(
    hub_id=None,
    resolution=16,
    policy="embedded",
    threads=1,
    prompts=("prompts/digit_train.txt", "prompts/digit_heldout.txt"),
)
BACKBONES = {
    "sd35m": dict(
        REAL, family="sd3", hub_id="stabilityai/stable-diffusion-3.5-medium", guidance=4.5
    ),
    "sd35l": dict(
        REAL, family="sd3", hub_id="stabilityai/stable-diffusion-3.5-large", guidance=3.5
    ),
    "sdxl": dict(
        REAL, family="sdxl", hub_id="stabilityai/stable-diffusion-xl-base-1.0", guidance=5.0
    ),
    "flux-dev": dict(REAL, family="flux", hub_id="black-forest-labs/FLUX.1-dev", guidance=3.5),
    "flux-schnell": dict(
        REAL, family="flux", hub_id="black-forest-labs/FLUX.1-schnell", guidance=None
    ),
    # The embedded backbones (MixtureBackbone): (spread, std, shift) per sub-population of a digit
    # class. digits: one population per class; the best schedule is about the same for all contexts.
    "digits": dict(EMBEDDED, populations=[[(1.0, 0.1, 0.0)]] * 10),
    # digits-prompt: sharp, spread-out digits 0-4 and blurred ones 5-9 want opposite schedules: the
    # prompt says which.
    "digits-prompt": dict(EMBEDDED, populations=[[(1.5, 0.02, 0.0)]] * 5 + [[(1.0, 0.5, 0.0)]] * 5),
    # digits-noise: every class is a bright sharp half and a dark blurred half; the initial noise
    # says which (a weaker signal than the prompt).
    "digits-noise": dict(EMBEDDED, populations=[[(1.5, 0.02, 0.5), (1.0, 0.5, -0.5)]] * 10),
    # digits-xor: every class is two halves, one brighter in the top rows (shift +TOP) and one in
    # the bottom rows (-TOP); the noise's top-bottom contrast says which a trajectory reaches, the
    # digit's parity says which half is sharp (even: the top-bright one). Neither input alone
    # predicts the schedule; only the two together do.
    "digits-xor": dict(
        EMBEDDED,
        populations=[[(1.5, 0.02, TOP), (1.0, 0.5, -TOP)], [(1.0, 0.5, TOP), (1.5, 0.02, -TOP)]]
        * 5,
    ),
    # The trained miniatures (miniature.py): the real families' classes with shipped 16x16 digit
    # weights instead of a hub id; they run on a CPU. folder: their save_pretrained folder in this
    # repository; prompts: (training, held-out) paraphrase files; the reward reads their pixels.
    # guidance: as a real model's default is chosen, the most realistic 50-step samples of which at
    # least 95% show the prompted digit (`python miniature.py --guidance-sweep`, docs/RESULTS.md).
    "mini-sd3": dict(MINIATURE, family="sd3", folder="miniatures/mini-sd3", guidance=1.25),
    "mini-flux": dict(MINIATURE, family="flux", folder="miniatures/mini-flux", guidance=1.5),
    "mini-sdxl": dict(MINIATURE, family="sdxl", folder="miniatures/mini-sdxl", guidance=1.25),
    # mini-flux distilled for few steps, as FLUX.1-schnell: no guidance input, 4 steps by default
    # (train.py), no resolution shift (its scheduler's); `python miniature.py --family flux-schnell`
    "mini-flux-schnell": dict(
        MINIATURE, family="flux", folder="miniatures/mini-flux-schnell", guidance=None
    ),
}

# the step-distilled model of each backbone that has one: evaluate.py --schnell compares with it
DISTILLED = {"flux-dev": "flux-schnell", "mini-flux": "mini-flux-schnell"}


def update_cost(name, contexts, rollouts, steps, guidance=None):
    """One REINFORCE update in model evaluations and reward calls, as a line to print."""
    spec, samples = BACKBONES[name], contexts * rollouts
    guidance = spec["guidance"] if guidance is None else guidance
    # true CFG doubles each batch
    cfg = spec["family"] in ("sd3", "sdxl") and guidance is not None and guidance > 1
    return (
        f"one update: B x K x L = {contexts} x {rollouts} x {steps} = {samples * steps:,} "
        f"model evaluations{' (each a CFG pair)' if cfg else ''}, {samples} reward calls"
    )


def retrain_command(name):
    """The command that retrains the miniature `name` (mini-flux-schnell: --family flux-schnell)."""
    return f"python miniature.py --family {name[len('mini-') :]}"


def locate_weights(name, path=None):
    """Where from_pretrained loads backbone `name` from: the local diffusers folder `path`, or its
    hub id once its files are cached or reachable. ValueError in one line saying how to get them."""
    hub_id, folder = BACKBONES[name]["hub_id"], BACKBONES[name].get("folder")
    if path is None and folder is not None:  # a miniature shipped in this repository
        path = os.path.join(REPOSITORY, folder)
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            raise ValueError(
                f"{name}: {folder} is missing from this checkout; restore it with "
                f"git, or retrain it with `{retrain_command(name)}`"
            )
    if path is not None:
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            raise ValueError(
                f"{name}: {path} is not a diffusers folder (no model_index.json); pass the folder "
                f"that holds model_index.json, or drop --model-path to use {hub_id} from the hub"
            )
        return path
    if hub_id is not None:
        hub_file(
            hub_id,
            "model_index.json",
            f"{name}: the weights of {hub_id} are not available; run `hf auth login` and "
            f"accept the licence on https://huggingface.co/{hub_id}, or pass a local diffusers "
            "folder with --model-path",
        )
    return hub_id


def load_backbone(name, path=None, device=None, dtype=None, resolution=None, guidance=None):
    """Build a backbone by name; `path` is a local diffusers folder replacing the hub id.
    Real models load in bfloat16 on CUDA (float32 on CPU), frozen, in eval mode."""
    spec = BACKBONES[name]
    if spec["family"] == "mixture":
        return MixtureBackbone(name, spec["populations"], device=device)
    location = locate_weights(name, path)
    import diffusers

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    pipeline_class = getattr(diffusers, PIPELINES[spec["family"]])
    try:
        pipe = pipeline_class.from_pretrained(location, dtype=dtype)
    except OSError as error:  # a partial download or a file the hub refuses
        if os.path.isdir(location):  # a local folder: no licence involved
            reason = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            raise ValueError(
                f"{name}: the files at {location} are incomplete or damaged ({reason}); download "
                "them again, retrain a miniature with `python miniature.py`, or pass another "
                "--model-path"
            ) from None
        raise ValueError(
            f"{name}: the weights at {location} are incomplete ({type(error).__name__}); run "
            f"`hf auth login`, accept the licence on https://huggingface.co/{spec['hub_id']} and "
            "download again, or pass --model-path"
        ) from None
    return from_pipeline(
        pipe.to(device),
        spec["family"],
        name=name,
        resolution=resolution or spec["resolution"],
        guidance=spec["guidance"] if guidance is None else guidance,
    )


# -----------------------------------------------------------------------------
# the policy for a backbone

# Network sizes, named in BACKBONES above. "real": about 20M parameters for the real models'
# latents and text widths (the paper: "about 20M parameters, under 1% of the sampler"; bench.py
# counts them); "embedded": about 100k for the 8x8 embedded backbones. `widths` are the conv
# stages, each halving the resolution; their outputs are pooled to a `grid` x `grid` token grid of
# width `dim`.
PRESETS = {
    "real": dict(widths=[64, 128, 256, 512], dim=512, heads=8, depth=3, grid=8, head_hidden=1024),
    "embedded": dict(widths=[16, 32], dim=64, heads=4, depth=1, grid=2, head_hidden=128),
}


def make_policy(kind, backbone_dims, steps, init_times=None, preset="embedded", **options):
    """A policy for a backbone: `backbone_dims` = Backbone.policy_dims, widths from PRESETS[preset].

    Starts at the default schedule when `init_times` (L+1,) is given, else at equal increments;
    `options` (concentration, stop_margin, any width; for the step-wise policy init="tpdm",
    inputs="hidden", inference) override the preset.
    """
    start = dict(init="uniform")
    if init_times is not None:
        start = dict(init="default", init_times=json_times(init_times))
    if kind in ("instance", "stepwise"):
        dims = dict(
            latent_channels=backbone_dims["latent_channels"],
            text_dim=backbone_dims["text_dim"],
            pooled_dim=backbone_dims.get("pooled_dim"),
        )
        if options.get("inputs") == "hidden":  # the denoiser's hidden states (families.py)
            if "feature_channels" not in backbone_dims:
                raise ValueError("this backbone has no hidden states a policy could read")
            dims.update(
                feature_channels=backbone_dims["feature_channels"],
                time_dim=backbone_dims["time_dim"],
            )
        options = {**PRESETS[preset], **options, **dims}
    return POLICIES[kind](steps, **{**start, **options})


POLICIES = {"instance": SchedulePolicy, "global": GlobalPolicy, "stepwise": StepwisePolicy}


def build_policy(config):
    """Rebuild a policy from its `.config` (then load_state_dict for its weights)."""
    config = dict(config)
    return POLICIES[config.pop("kind")](**config)
