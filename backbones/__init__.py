"""
Every backbone by name (BACKBONES) and load_backbone(name), which builds it frozen: a diffusers
pipeline of families.py or an embedded mixture of mixture.py. check_files finds a model's files
and says in one line what is wrong with missing or damaged ones before anything loads.
"""

import os

import torch

from backbones.families import FluxBackbone, SD3Backbone, SDXLBackbone
from backbones.mixture import MixtureBackbone
from store.files import REPOSITORY, check_safetensors, hub_file, read_json

# +0.5 on the top four rows of an 8x8 digit, -0.5 on the bottom four; digits-xor's (even, odd)
TOP = torch.tensor([0.5] * 32 + [-0.5] * 32, dtype=torch.float64)
XOR_CLASSES = [[(1.5, 0.02, TOP), (1.0, 0.5, -TOP)], [(1.0, 0.5, TOP), (1.5, 0.02, -TOP)]]

# the diffusers families (families.py), and the pipeline class each loads
FAMILIES = {"sd3": SD3Backbone, "flux": FluxBackbone, "sdxl": SDXLBackbone}
PIPELINES = {
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
    "sdxl": "StableDiffusionXLPipeline",
}
PIPELINE_FAMILIES = {pipeline: family for family, pipeline in PIPELINES.items()}


def from_pipeline(pipe, family=None, name=None, resolution=None, guidance=None):
    """Wrap an already built diffusers pipeline (the tests' tiny random ones)."""
    family = family or PIPELINE_FAMILIES.get(type(pipe).__name__)
    if family not in FAMILIES:
        raise ValueError(
            f"cannot tell the family of {type(pipe).__name__}; pass family= one of "
            f"{', '.join(FAMILIES)}"
        )
    return FAMILIES[family](pipe, name=name or family, resolution=resolution, guidance=guidance)


def _real(family, hub_id, guidance):
    return dict(resolution=1024, policy="real", family=family, hub_id=hub_id, guidance=guidance)


# Model facts per backbone (train.py's PRESETS hold the training configurations). guidance: the
# true-CFG scale (SD3.5, SD-XL: their model cards' and pipeline's values), Flux-Dev's distilled
# guidance embedding, or None (no guidance input). policy: the size in store.checkpoint.PRESETS.
EMBEDDED = dict(family="mixture", hub_id=None, resolution=8, guidance=None, policy="embedded")
DIGIT_PROMPTS = ("prompts/digit_train.txt", "prompts/digit_heldout.txt")
MINIATURE = dict(hub_id=None, resolution=16, policy="embedded", prompts=DIGIT_PROMPTS)
BACKBONES = {
    "sd35m": _real("sd3", "stabilityai/stable-diffusion-3.5-medium", 4.5),
    "sd35l": _real("sd3", "stabilityai/stable-diffusion-3.5-large", 3.5),
    "sdxl": _real("sdxl", "stabilityai/stable-diffusion-xl-base-1.0", 5.0),
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
    # mini-flux distilled for few steps, as FLUX.1-schnell: no guidance input, no resolution shift
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
    cfg = spec["family"] in ("sd3", "sdxl") and guidance is not None and guidance > 1  # doubles
    return (
        f"one update: B x K x L = {contexts} x {rollouts} x {steps} = {samples * steps:,} "
        f"model evaluations{' (each a CFG pair)' if cfg else ''}, {samples} reward calls"
    )


def load_backbone(
    name, path=None, device=None, dtype=None, resolution=None, guidance=None, location=None
):
    """Build a backbone by name, frozen; `path`: a local diffusers folder instead of the hub id.
    Its files are checked first (check_files) unless the caller passes their `location`. Real
    models load in bfloat16 on CUDA. Weights that do not load end in one line (ValueError)."""
    spec = BACKBONES[name]
    if spec["family"] == "mixture":
        return MixtureBackbone(name, spec["populations"], device, spec.get("teacher"))
    location = location or check_files(name, path)
    import diffusers

    device = check_device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    pipeline_class = getattr(diffusers, PIPELINES[spec["family"]])
    try:
        pipe = pipeline_class.from_pretrained(location, dtype=dtype)
    except OSError as error:  # a weight file missing, a partial download or one the hub refuses
        if os.path.isdir(location):  # a local folder: no licence involved
            reason = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            raise ValueError(
                f"{name}: the files at {location} are incomplete or damaged ({reason}); download "
                "them again, retrain a miniature with `python -m miniatures.build`, or pass "
                "another --model-path"
            ) from None
        raise ValueError(
            f"{name}: the weights at {location} are incomplete ({type(error).__name__}); run "
            f"`hf auth login`, accept the licence on https://huggingface.co/{spec['hub_id']} and "
            "download again, or pass --model-path"
        ) from None
    except ValueError as error:  # shapes other than the configuration says
        reason = str(error).splitlines()[0]
        raise ValueError(
            f"{name}: {location} does not load ({reason}); pass the folder of a {name} model"
        ) from None
    resolution = resolution or spec["resolution"]
    guidance = spec["guidance"] if guidance is None else guidance
    return from_pipeline(pipe.to(device), spec["family"], name, resolution, guidance)


# the files a tokenizer reads its vocabulary from (fast tokenizers, CLIP's BPE, T5's SentencePiece)
VOCABULARIES = ("tokenizer.json", "vocab.json", "spiece.model", "vocab.txt")
# the configuration each kind of component is loaded from (config.json for the models)
CONFIG_FILES = {"scheduler": "scheduler_config.json", "tokenizer": "tokenizer_config.json"}


def check_files(name, path=None):
    """Where from_pretrained loads backbone `name` from (None for a mixture): the diffusers folder
    `path`, a miniature shipped in this checkout or its hub id. Checked before anything loads: the
    family's pipeline class, every component's configuration and whole weight files. ValueError in
    one line naming the file, what is wrong and what to do (restore, log in, --model-path)."""
    spec = BACKBONES[name]
    hub_id, shipped = spec["hub_id"], spec.get("folder")
    if spec["family"] == "mixture":
        return None
    if path is None and shipped is not None:
        folder = location = os.path.join(REPOSITORY, shipped)
        advice = (  # mini-flux-schnell: --family flux-schnell
            f"restore it with `git checkout {shipped}`, or retrain it with "
            f"`python -m miniatures.build --family {name[len('mini-') :]}`"
        )
        index = os.path.join(shipped, "model_index.json")
        if not os.path.isfile(os.path.join(REPOSITORY, index)):
            what = index if os.path.isdir(folder) else shipped  # one file lost, or the whole folder
            raise ValueError(f"{name}: {what} is missing from this checkout; {advice}")
    elif path is not None:
        folder = location = path
        advice = "download the model again, or pass another --model-path"
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            raise ValueError(
                f"{name}: {path} is not a diffusers folder (no model_index.json); pass the folder "
                "that holds model_index.json, or drop --model-path to use "
                + (f"{hub_id} from the hub" if hub_id else "the miniature shipped here")
            )
    else:  # from the local hub cache, else downloaded
        location = hub_id
        advice = f"delete {hub_id} from the hub cache and run again to download it afresh"
        unavailable = (
            f"{name}: the weights of {hub_id} are not available; run `hf auth login` and accept "
            f"the licence on https://huggingface.co/{hub_id}, or pass a local diffusers folder "
            "with --model-path"
        )
        folder = os.path.dirname(hub_file(hub_id, "model_index.json", unavailable))
    index = read_json(os.path.join(folder, "model_index.json"), advice)
    wanted = PIPELINES[spec["family"]]
    held = index.get("_class_name") if isinstance(index, dict) else None
    if held != wanted:
        raise ValueError(
            f"{folder} holds a {held}, not the {wanted} that {name} runs; pass the folder of "
            f"a {spec['family']} model"
        )
    cached = location == hub_id  # files the cache lacks are downloaded by from_pretrained
    for component, entry in index.items():
        if component.startswith("_") or not isinstance(entry, list) or None in entry:
            continue
        subfolder = os.path.join(folder, component)
        files = os.listdir(subfolder) if os.path.isdir(subfolder) else []
        configs = [file for file in files if file.endswith("config.json")]
        if cached and not configs:  # not downloaded yet: only what is there is checked
            continue
        if not configs:  # the file from_pretrained reads first: scheduler_config.json, ...
            wanted = CONFIG_FILES.get(component.rstrip("_0123456789"), "config.json")
            raise ValueError(f"{os.path.join(subfolder, wanted)} is missing; {advice}")
        # without its vocabulary a tokenizer can load as nothing at all, and its encoder goes unused
        if "Tokenizer" in entry[1] and not any(file in VOCABULARIES for file in files):
            raise ValueError(f"{subfolder} has no vocabulary ({entry[1]}); {advice}")
        for file in configs:
            read_json(os.path.join(subfolder, file), advice)
        for file in files:
            if file.endswith(".safetensors"):
                check_safetensors(os.path.join(subfolder, file), advice)
    return location


def check_trained_on(config, source):
    """ValueError in one line unless the checkpoint `source` names a backbone of BACKBONES."""
    if config.get("backbone") not in BACKBONES:
        raise ValueError(
            f'{source}: "backbone" is {config.get("backbone")!r}, not a backbone here; restore '
            "the file from the run folder it came from, or train again"
        )


def trained_backbone(config, device, location=None):
    """The frozen backbone a checkpoint was trained with, rebuilt from its configuration alone."""
    return load_backbone(
        config["backbone"],
        path=config.get("model_path"),
        device=device,
        dtype=getattr(torch, config["dtype"]) if config.get("dtype") else None,
        resolution=config.get("resolution"),
        guidance=config.get("guidance"),
        location=location,
    )


def check_device(name):
    """The torch.device of a --device flag (None: cuda when available, else cpu); ValueError in one
    line for a name that is not a device here."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r} is not a device: pass cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}, but this machine has no CUDA device; pass --device cpu")
    return device
