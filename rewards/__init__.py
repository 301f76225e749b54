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
  reports GenEval's binary correctness.
- "digit", "preference" (digits.py): the mini-* backbones' rewards, from models that
  miniatures/build.py trains on digits no miniature saw: log p(prompted digit | image) under a
  classifier, and a Bradley-Terry preference scorer (their HPSv2); both also report the
  classifier's accuracy.

Images are quantised to 8 bits before scoring, as the reward models saw them, and preprocessed on
tensors to the same numbers as each model's own transform (tests/test_rewards.py checks this).
Rewards are returned as computed, NaN included: the trainer stops at a non-finite reward rather
than dropping or clamping samples, which would bias the estimator and hide a broken model.
"""

import torch

from rewards.clip import CLIP_DEFAULT, CLIPReward
from rewards.digits import DigitReward, PreferenceReward, digit_of, model_folder
from rewards.hps import HPSReward, hps_checkpoint, import_hps
from rewards.images import check_all, check_model
from rewards.ocr import OCRReward, import_easyocr, target_text, weights_folder
from rewards.teacher import TeacherReward


def load_geneval(backbone, **options):
    from rewards import geneval  # imported when used: `python -m rewards.geneval` is a script too

    return geneval.load_geneval(backbone, **options)


REWARDS = {  # name -> its loader: (backbone, device=None, **options) -> the reward
    "teacher": TeacherReward,
    "hpsv2": HPSReward,
    "clip": CLIPReward,
    "ocr": OCRReward,
    "geneval": load_geneval,
    "digit": DigitReward,
    "preference": PreferenceReward,
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
    from rewards.geneval import parse

    # what each reward reads in a prompt; ValueError in one line if the prompt has none
    reads = {"digit": digit_of, "preference": digit_of, "ocr": target_text, "geneval": parse}
    if name in reads:
        for prompt in prompts:
            reads[name](prompt)


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
    """Fail fast, before a backbone is loaded: ValueError in one line naming every package and
    model file of the reward `name` that this machine lacks. Loads nothing heavy."""
    from rewards.geneval import DETECTOR_DEFAULT

    clip_advice = "pass --reward-checkpoint PATH to a local copy"
    needs = {
        "hpsv2": [import_hps, lambda: hps_checkpoint(checkpoint=checkpoint)],
        "clip": [lambda: check_model(checkpoint or CLIP_DEFAULT, "CLIP model", clip_advice)],
        "ocr": [import_easyocr, lambda: weights_folder(checkpoint)],
        "geneval": [
            lambda: check_model(checkpoint or DETECTOR_DEFAULT, "GenEval detector"),
            lambda: check_model(CLIP_DEFAULT, "CLIP model"),
        ],
        "digit": [lambda: model_folder("classifier", checkpoint)],
        # the scorer, and the classifier behind its accuracy
        "preference": [
            lambda: model_folder("preference", checkpoint),
            lambda: model_folder("classifier"),
        ],
    }
    check_all(*needs.get(name, []))


def load_reward(name, backbone, device=None, checkpoint=None, **options):
    """Build the reward `name` once for `backbone`; `checkpoint` (local weights, for the rewards
    that have a model) and options go to its loader."""
    if checkpoint is not None:
        options["checkpoint"] = checkpoint
    return REWARDS[name](backbone, device=device, **options)
