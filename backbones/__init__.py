"""
Every backbone by name: its model facts (BACKBONES) and where its weights come from (the hub, a
local folder, or a miniature shipped in this repository), and load_backbone(name), which builds
the frozen backbone: a diffusers pipeline of families.py or an embedded mixture of mixture.py.
Missing, gated or incomplete weights end in one line that says how to get them, before anything
loads (check_files); from_pipeline wraps an already built diffusers pipeline (the tests' tiny
random ones, miniatures/layouts.py).
"""

import os

import torch

from backbones.families import FluxBackbone, SD3Backbone, SDXLBackbone
from backbones.mixture import MixtureBackbone
from store.files import REPOSITORY, check_safetensors, hub_file, read_json

# +0.5 on the top four rows of an 8x8 digit, -0.5 on the bottom four (digits-xor)
TOP = torch.tensor([0.5] * 32 + [-0.5] * 32, dtype=torch.float64)

# the diffusers families (families.py), and the pipeline class each loads
FAMILIES = {"sd3": SD3Backbone, "flux": FluxBackbone, "sdxl": SDXLBackbone}
PIPELINES = {
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
    "sdxl": "StableDiffusionXLPipeline",
}
PIPELINE_FAMILIES = {pipeline: family for family, pipeline in PIPELINES.items()}


def from_pipeline(pipe, family=None, name=None, resolution=None, guidance=None):
    """Wrap an already built diffusers pipeline (how the tests inject tiny random ones)."""
    family = family or PIPELINE_FAMILIES.get(type(pipe).__name__)
    if family not in FAMILIES:
        raise ValueError(
            f"cannot tell the family of {type(pipe).__name__}; pass family= one of "
            f"{', '.join(FAMILIES)}"
        )
    return FAMILIES[family](pipe, name=name or family, resolution=resolution, guidance=guidance)


# Model facts per backbone (train.py's PRESETS hold the training configurations). family: the class
# that runs it; hub_id: its diffusers weights; resolution: the image side; guidance: the true-CFG
# scale (SD3.5, SD-XL), the distilled guidance embedding (Flux-Dev) or None (no guidance input): the
# values recommended by the SD3.5 model cards (Medium 4.5, Large 3.5) and the SD-XL and Flux-Dev
# pipelines' defaults (5.0, 3.5). policy: the size in store.checkpoint.PRESETS.
REAL = dict(resolution=1024, policy="real")
EMBEDDED = dict(family="mixture", hub_id=None, resolution=8, guidance=None, policy="embedded")
MINIATURE = dict(
    hub_id=None,
    resolution=16,
    policy="embedded",
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
    # Its teacher: 20 RK4 steps, large near t = 1, in float32 (mixture.MixtureBackbone.reference)
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
    # digits-xor: every class is two halves, one brighter in the top rows (shift +TOP) and one in
    # the bottom rows (-TOP); the noise's top-bottom contrast says which a trajectory reaches, the
    # digit's parity says which half is sharp (even: the top-bright one). Neither input alone
    # predicts the schedule; only the two together do.
    "digits-xor": dict(
        EMBEDDED,
        populations=[[(1.5, 0.02, TOP), (1.0, 0.5, -TOP)], [(1.0, 0.5, TOP), (1.5, 0.02, -TOP)]]
        * 5,
    ),
    # The trained miniatures (miniatures/build.py): the real families' classes with shipped 16x16
    # digit weights instead of a hub id; they run on a CPU. folder: their save_pretrained folder in
    # this repository; prompts: (training, held-out) paraphrase files; the reward reads their
    # pixels. guidance: as a real model's default is chosen, the most realistic 50-step samples of
    # which at least 95% show the prompted digit (`python -m evidence.miniatures --guidance-sweep`,
    # docs/RESULTS.md).
    "mini-sd3": dict(MINIATURE, family="sd3", folder="miniatures/mini-sd3", guidance=1.25),
    "mini-flux": dict(MINIATURE, family="flux", folder="miniatures/mini-flux", guidance=1.5),
    "mini-sdxl": dict(MINIATURE, family="sdxl", folder="miniatures/mini-sdxl", guidance=1.25),
    # mini-flux distilled for few steps, as FLUX.1-schnell: no guidance input, 4 steps by default
    # (train.py), no resolution shift (its scheduler's);
    # `python -m miniatures.build --family flux-schnell`
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
    return f"python -m miniatures.build --family {name[len('mini-') :]}"


def locate_weights(name, path=None):
    """Where from_pretrained loads backbone `name` from: the local diffusers folder `path`, or its
    hub id once its files are cached or reachable. ValueError in one line saying how to get them."""
    hub_id, folder = BACKBONES[name]["hub_id"], BACKBONES[name].get("folder")
    if path is None and folder is not None:  # a miniature shipped in this repository
        path = os.path.join(REPOSITORY, folder)
        index = os.path.join(folder, "model_index.json")
        if not os.path.isfile(os.path.join(REPOSITORY, index)):
            what = index if os.path.isdir(path) else folder  # one file lost, or the whole folder
            raise ValueError(
                f"{name}: {what} is missing from this checkout; restore it with "
                f"`git checkout {folder}`, or retrain it with `{retrain_command(name)}`"
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


def load_backbone(
    name, path=None, device=None, dtype=None, resolution=None, guidance=None, location=None
):
    """Build a backbone by name, frozen, in eval mode; `path` is a local diffusers folder replacing
    the hub id. Its files are checked first (check_files), unless the caller did and passes their
    `location`. Real models load in bfloat16 on CUDA (float32 on CPU). Weights that are incomplete,
    or that the model classes refuse although every file is whole, end in one line (ValueError)."""
    spec = BACKBONES[name]
    if spec["family"] == "mixture":
        return MixtureBackbone(
            name, spec["populations"], device=device, teacher=spec.get("teacher")
        )
    location = location or check_files(name, path)
    import diffusers

    device = check_device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    pipeline_class = getattr(diffusers, PIPELINES[spec["family"]])
    try:
        pipe = pipeline_class.from_pretrained(location, dtype=dtype)
    except OSError as error:  # a partial download or a file the hub refuses
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
    return from_pipeline(
        pipe.to(device),
        spec["family"],
        name=name,
        resolution=resolution or spec["resolution"],
        guidance=spec["guidance"] if guidance is None else guidance,
    )


# the files a tokenizer reads its vocabulary from (fast tokenizers, CLIP's BPE, T5's SentencePiece)
VOCABULARIES = ("tokenizer.json", "vocab.json", "spiece.model", "vocab.txt")
# the configuration each kind of component is loaded from (config.json for the models)
CONFIG_FILES = {"scheduler": "scheduler_config.json", "tokenizer": "tokenizer_config.json"}


def check_files(name, path=None):
    """Where backbone `name` loads from (locate_weights: ValueError in one line when
    missing), checked before anything loads: the folder holds the pipeline class of the backbone's
    family, and every component it lists has its configuration and whole weight files. ValueError
    in one line naming the file, what is wrong and what to do."""
    spec = BACKBONES[name]
    if spec["family"] == "mixture":
        return None
    location = locate_weights(name, path)
    folder = location
    if not os.path.isdir(location):  # a hub id, found in the local cache (or just downloaded)
        from huggingface_hub import try_to_load_from_cache

        index = try_to_load_from_cache(location, "model_index.json")
        if not isinstance(index, str):
            return location  # from_pretrained downloads it
        folder = os.path.dirname(index)
    if path is None and spec.get("folder"):
        advice = (
            f"restore it with `git checkout {spec['folder']}`, or retrain it with "
            f"`{retrain_command(name)}`"
        )
    elif path is not None:
        advice = "download the model again, or pass another --model-path"
    else:
        advice = f"delete {location} from the hub cache and run again to download it afresh"
    index = read_json(os.path.join(folder, "model_index.json"), advice)
    wanted = PIPELINES[spec["family"]]
    if not isinstance(index, dict) or index.get("_class_name") != wanted:
        held = index.get("_class_name") if isinstance(index, dict) else None
        raise ValueError(
            f"{folder} holds a {held}, not the {wanted} that {name} runs; pass the folder of "
            f"a {spec['family']} model"
        )
    for component, entry in index.items():
        if component.startswith("_") or not isinstance(entry, list) or None in entry:
            continue
        subfolder = os.path.join(folder, component)
        files = os.listdir(subfolder) if os.path.isdir(subfolder) else []
        configs = [file for file in files if file.endswith("config.json")]
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
    """ValueError in one line unless the checkpoint `source` names a backbone of BACKBONES (a
    policy folder's config.json can be edited by hand)."""
    if config.get("backbone") not in BACKBONES:
        raise ValueError(
            f'{source}: "backbone" is {config.get("backbone")!r}, not a backbone here; restore '
            "the file from the run folder it came from, or train again"
        )


def trained_backbone(config, device, location=None):
    """The frozen backbone a checkpoint was trained with, rebuilt from its configuration alone."""
    return load_backbone(
        config["backbone"],
        path=config["model_path"],
        device=device,
        dtype=getattr(torch, config["dtype"]) if config["dtype"] else None,
        resolution=config["resolution"],
        guidance=config["guidance"],
        location=location,
    )


def check_device(name):
    """The torch.device of a --device flag (None: cuda when available, else cpu). ValueError in one
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
