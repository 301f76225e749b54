"""
Rewards: black-box scores of a rollout's final latents, higher is better.

    reward = load_reward("teacher", backbone)  # or "hpsv2", "clip", "ocr", "geneval", ...
    scores = reward(latents, prompts, noise, cond)  # (N,) float32 on the backbone's device
    columns = metrics(reward, "ocr", latents, prompts, noise, cond)  # what evaluate.py reports

Every reward is batched over N samples with one prompt each (a batch's contexts repeated K times
with repeat_interleave), built once, and decodes with `backbone.decode` when it needs images.

- "teacher": minus the latent MSE to the frozen backbone's accurate solution `backbone.reference(
  noise, cond)` from the same noise and prompt (0 is best); no reward model, the digits' default.
- "hpsv2": 100 x HPS v2.1 (or v2.0) cosine similarity (Wu et al. 2023), the paper's reward; needs
  requirements-hps.txt and HPS_v2.1_compressed.pt from the hub repo xswu/HPSv2.
- "clip": 100 x CLIP cosine similarity (transformers), for machines without the HPS environment.
- "ocr" (ocr.py): word recall of the prompt's "quoted" text in what EasyOCR reads, the paper's
  text-rendering reward; evaluate.py also reports 1 - normalised edit distance.
- "geneval" (geneval.py): the fraction of a GenEval prompt's requirements met; evaluate.py also
  reports GenEval's binary correctness. ocr and geneval need images with text or objects, which
  the 8x8 embedded backbones do not draw.
- "digit", "preference" (digits.py): the mini-* backbones' rewards, from models that
  miniatures/build.py trains on digits no miniature saw: log p(prompted digit | image) under a
  classifier, and a Bradley-Terry preference scorer (their HPSv2); both also report the
  classifier's accuracy.

Images are quantised to 8 bits before scoring, as the reward models saw them, and preprocessed on
tensors to the same numbers as each model's own transform (tests/test_rewards.py checks this).
Rewards are returned as computed, NaN included: the trainer stops at a non-finite reward rather
than dropping or clamping samples, which would bias the estimator and hide a broken model.
"""

import os

import torch

from rewards.clip import CLIP_DEFAULT, load_clip
from rewards.digits import digit_of, load_digit, load_preference, model_folder
from rewards.hps import _import_hps, hps_checkpoint, load_hpsv2
from rewards.teacher import load_teacher
from store.files import check_safetensors, hub_file, read_json


def load_ocr(backbone, device=None, checkpoint=None, batch_size=8):
    from rewards import ocr  # EasyOCR needs torchvision: imported only when asked for

    return ocr.load_ocr(backbone, device=device, checkpoint=checkpoint, batch_size=batch_size)


def load_geneval(backbone, device=None, checkpoint=None, clip_checkpoint=None, batch_size=8):
    from rewards import geneval  # Mask2Former: imported only when asked for

    return geneval.load_geneval(
        backbone, device, checkpoint, clip_checkpoint, batch_size=batch_size
    )


REWARDS = {
    "teacher": load_teacher,
    "hpsv2": load_hpsv2,
    "clip": load_clip,
    "ocr": load_ocr,
    "geneval": load_geneval,
    "digit": load_digit,
    "preference": load_preference,
}
IMAGE_CONTENT = ("ocr", "geneval")  # read text or objects: not for the 8x8 embedded backbones
DIGIT_REWARDS = ("digit", "preference")  # read the miniatures' 16x16 digits: mini-* only
COLUMNS = {  # what metrics() returns, per reward
    "ocr": ("ocr", "ocr edit"),
    "geneval": ("geneval", "geneval correct"),
    "digit": ("digit", "digit accuracy"),
    "preference": ("preference", "digit accuracy"),
}


def check_digits(name, backbone, spec):
    """ValueError when the reward `name` reads digits that the backbone `backbone` (spec: its row
    of backbones.BACKBONES) does not draw."""
    if name in DIGIT_REWARDS and "folder" not in spec:
        raise ValueError(
            f"the {name} reward reads the 16x16 handwritten digits that only the mini-* backbones "
            f"draw, not {backbone}'s images; use the teacher reward, or a mini-* backbone"
        )


def check_prompts(name, prompts):
    """ValueError naming the first prompt the reward `name` cannot score."""
    if name in DIGIT_REWARDS:
        for prompt in prompts:
            digit_of(prompt)
    if name in IMAGE_CONTENT:
        from rewards.geneval import parse
        from rewards.ocr import target_text

        for prompt in prompts:
            (target_text if name == "ocr" else parse)(prompt)


@torch.no_grad()
def metrics(reward, name, latents, prompts, noise, cond):
    """name -> (N,) float tensor: the reward, and beside it OCR's edit score, GenEval's binary
    correctness or the digit classifier's accuracy."""
    if name in IMAGE_CONTENT:
        rows = reward.details(latents, prompts)
        keys = ("recall", "edit") if name == "ocr" else ("reward", "correct")
        return {
            column: torch.tensor([float(row[key]) for row in rows])
            for column, key in zip(COLUMNS[name], keys)
        }
    if name in DIGIT_REWARDS:
        score, correct = reward.details(latents, prompts)
        return {name: score.cpu(), "digit accuracy": correct.cpu()}
    return {name: reward(latents, prompts, noise, cond).float().cpu()}


def check_reward(name, checkpoint=None):
    """Fail fast, before a backbone is loaded: ValueError (one line) if the packages or weights of
    the reward `name` are not on this machine. Loads nothing heavy."""
    if name == "hpsv2":  # the packages and the checkpoint, both reported when both are missing
        missing = []
        for check in (_import_hps, lambda: hps_checkpoint(checkpoint=checkpoint)):
            try:
                check()
            except (ImportError, ValueError) as error:
                missing.append(str(error))
        if missing:
            raise ValueError("; ".join(missing))
    if name == "ocr":
        from rewards.ocr import check_ocr

        check_ocr(checkpoint)
    if name == "geneval":
        from rewards.geneval import DETECTOR_DEFAULT, check_weights

        check_weights(
            checkpoint or DETECTOR_DEFAULT, "GenEval detector", also=(CLIP_DEFAULT, "CLIP model")
        )
    if name == "digit":
        check_model_files("classifier", checkpoint)
    if name == "preference":  # the scorer and the classifier behind its accuracy
        check_model_files("preference", checkpoint)
        check_model_files("classifier")
    model = checkpoint or CLIP_DEFAULT
    if name == "clip" and not os.path.isdir(model):
        hub_file(
            model,
            "config.json",
            f"CLIP model {model!r} not found: download it with "
            f"`hf download {model}` or pass --reward-checkpoint PATH to a local copy",
        )


def check_model_files(kind, folder=None):
    """ValueError naming a missing or damaged file of the digit model `kind` ("classifier" or
    "preference")."""
    folder = model_folder(kind, folder)
    advice = (
        f"restore it with `git checkout miniatures/{kind}`, or retrain it with "
        f"`python -m miniatures.build --family {kind}`"
    )
    read_json(os.path.join(folder, "config.json"), advice)
    check_safetensors(os.path.join(folder, "model.safetensors"), advice)


def load_reward(name, backbone, device=None, checkpoint=None, **options):
    """Build the reward `name` once for `backbone`; `checkpoint` (local weights, for the rewards
    that have a model) and options go to its loader."""
    if checkpoint is not None:
        options["checkpoint"] = checkpoint
    return REWARDS[name](backbone, device=device, **options)
