"""
Every backbone by name (BACKBONES) and load_backbone(name), which builds it frozen: a diffusers
pipeline of families.py or an embedded mixture of mixture.py.
"""

import os

import torch

from backbones.families import FluxBackbone, SD3Backbone, SDXLBackbone
from backbones.mixture import MixtureBackbone

# the checkout's root: the shipped miniatures' folders are relative to it
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# +0.5 on the top four rows of an 8x8 digit, -0.5 on the bottom four; digits-xor's (even, odd)
TOP = torch.tensor([0.5] * 32 + [-0.5] * 32, dtype=torch.float64)
XOR_CLASSES = [[(1.5, 0.02, TOP), (1.0, 0.5, -TOP)], [(1.0, 0.5, TOP), (1.5, 0.02, -TOP)]]

# the diffusers families (families.py); each names the pipeline class it runs
FAMILIES = {"sd3": SD3Backbone, "flux": FluxBackbone, "sdxl": SDXLBackbone}


def from_pipeline(pipe, name=None, resolution=None, guidance=None):
    """Wrap an already built diffusers pipeline (the tests' tiny random ones)."""
    family = {value.pipeline: key for key, value in FAMILIES.items()}.get(type(pipe).__name__)
    if family is None:
        pipelines = ", ".join(value.pipeline for value in FAMILIES.values())
        raise ValueError(f"cannot tell the family of {type(pipe).__name__}: not a {pipelines}")
    return FAMILIES[family](pipe, name or family, resolution, guidance)


def _real(family, hub_id, guidance):
    return dict(resolution=1024, policy="real", family=family, hub_id=hub_id, guidance=guidance)


# Model facts per backbone (train.py's PRESETS hold the training configurations). guidance: the
# true-CFG scale (SD3.5, SD-XL: their model cards' and pipeline's values), Flux-Dev's distilled
# guidance embedding, or None (no guidance input). policy: the size in policy.NETWORKS. variant: the
# half-precision files on the Hub, loaded for a half-precision run.
EMBEDDED = dict(family="mixture", hub_id=None, resolution=8, guidance=None, policy="embedded")
DIGIT_PROMPTS = ("prompts/digit_train.txt", "prompts/digit_heldout.txt")
MINIATURE = dict(hub_id=None, resolution=16, policy="embedded", prompts=DIGIT_PROMPTS)
MIX_PROMPTS = ("prompts/mix_train.txt", "prompts/mix_heldout.txt")
BACKBONES = {
    "sd35m": _real("sd3", "stabilityai/stable-diffusion-3.5-medium", 4.5),
    "sd35l": _real("sd3", "stabilityai/stable-diffusion-3.5-large", 3.5),
    "sdxl": dict(_real("sdxl", "stabilityai/stable-diffusion-xl-base-1.0", 5.0), variant="fp16"),
    "flux-dev": _real("flux", "black-forest-labs/FLUX.1-dev", 3.5),
    "flux-schnell": _real("flux", "black-forest-labs/FLUX.1-schnell", None),
    # The embedded backbones (MixtureBackbone): (spread, std, shift) per sub-population of a digit
    # class. digits: one population per class, about one best schedule for all contexts; its
    # teacher (mixture.MixtureBackbone.reference) takes large RK4 steps near t = 1, in float32.
    "digits": dict(
        EMBEDDED,
        populations=[[(1.0, 0.1, 0.0)]] * 10,
        teacher=dict(steps=20, power=0.7, dtype="float32"),
    ),
    # digits-prompt: sharp, spread-out digits 0-4 and blurred ones 5-9 want opposite schedules: the
    # prompt says which.
    "digits-prompt": dict(EMBEDDED, populations=[[(1.5, 0.02, 0.0)]] * 5 + [[(1.0, 0.5, 0.0)]] * 5),
    # digits-noise: every class is a bright sharp half and a dark blurred half; the initial noise
    # says which (a weaker signal than the prompt).
    "digits-noise": dict(EMBEDDED, populations=[[(1.5, 0.02, 0.5), (1.0, 0.5, -0.5)]] * 10),
    # digits-xor: every class is a top-bright half (+TOP) and a bottom-bright one (-TOP); the noise
    # says which a trajectory reaches, the digit's parity which half is sharp (even: top-bright).
    # Only the two inputs together predict the schedule.
    "digits-xor": dict(EMBEDDED, populations=XOR_CLASSES * 5),
    # The trained miniatures (miniatures/build.py): the real families with shipped 16x16 digit
    # weights in `folder`, run on a CPU. guidance: the most realistic 50-step samples of which at
    # least 95% show the prompted digit (`python -m evidence.miniatures --guidance-sweep`).
    "mini-sd3": dict(MINIATURE, family="sd3", folder="miniatures/mini-sd3", guidance=1.25),
    "mini-flux": dict(MINIATURE, family="flux", folder="miniatures/mini-flux", guidance=1.5),
    "mini-sdxl": dict(MINIATURE, family="sdxl", folder="miniatures/mini-sdxl", guidance=1.25),
    # mini-mix: the SD3 family on digits, letters, colour blobs and photo crops (miniatures/mix.py)
    "mini-mix": dict(
        MINIATURE, family="sd3", folder="miniatures/mini-mix", guidance=1.5, prompts=MIX_PROMPTS
    ),
    # mini-flux distilled for few steps, as FLUX.1-schnell: no guidance input, no resolution shift
    "mini-flux-schnell": dict(
        MINIATURE, family="flux", folder="miniatures/mini-flux-schnell", guidance=None
    ),
}

# the step-distilled model of each backbone that has one: evaluate.py --schnell compares with it
DISTILLED = {"flux-dev": "flux-schnell", "mini-flux": "mini-flux-schnell"}


def load_backbone(name, path=None, device=None, dtype=None, resolution=None, guidance=None):
    """Build a backbone by name, frozen. A diffusers backbone loads with from_pretrained from
    `path` (a local diffusers folder), else its hub id, else (a miniature) its folder in this
    checkout, on `device` (None: cuda when available, else cpu); real models in bfloat16 on CUDA."""
    spec = BACKBONES[name]
    if spec["family"] == "mixture":
        return MixtureBackbone(name, spec["populations"], device, spec.get("teacher"))
    import diffusers

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    location = path or spec["hub_id"] or os.path.join(REPOSITORY, spec["folder"])
    family, options = FAMILIES[spec["family"]], dict(dtype=dtype)
    if device.type == "cuda":  # straight to this rank's device (train.py set it), not via the CPU
        options.update(device_map="cuda")
    if location == spec["hub_id"] and "variant" in spec and dtype != torch.float32:
        options.update(variant=spec["variant"])  # half the download
    pipe = getattr(diffusers, family.pipeline).from_pretrained(location, **options)
    guidance = spec["guidance"] if guidance is None else guidance
    return family(pipe.to(device), name, resolution or spec["resolution"], guidance)


def trained_backbone(config, device):
    """The frozen backbone a checkpoint was trained with, rebuilt from its configuration alone."""
    dtype = getattr(torch, config["dtype"]) if config.get("dtype") else None
    sizes = dict(resolution=config.get("resolution"), guidance=config.get("guidance"))
    return load_backbone(config["backbone"], config.get("model_path"), device, dtype, **sizes)
