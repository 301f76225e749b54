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
  HPS_v2.1_compressed.pt from the hub repo xswu/HPSv2.
- "clip": 100 x CLIP cosine similarity (transformers), a lighter prompt-alignment reward than HPSv2.
- "ocr" (ocr.py): word recall of the prompt's "quoted" text in what EasyOCR reads, the paper's
  text-rendering reward; evaluate.py also reports 1 - normalised edit distance.
- "geneval" (geneval.py): the fraction of a GenEval prompt's requirements met; evaluate.py also
  reports GenEval's binary correctness.
- "class" ("digit" on the digit miniatures), "preference" (digits.py): the mini-* backbones'
  rewards, from models that miniatures/build.py trains on images no miniature saw: log p(prompted
  class | image) under a classifier, and a Bradley-Terry preference scorer (their HPSv2); both
  also report the classifier's accuracy.

Images are quantised to 8 bits before scoring, as the reward models saw them, and preprocessed on
tensors to the same numbers as each model's own transform (tests/test_rewards.py checks this).
Rewards are returned as computed, NaN included: the trainer stops at a non-finite reward rather
than dropping or clamping samples, which would bias the estimator and hide a broken model.
"""

import torch

from rewards import digits
from rewards.clip import CLIPReward
from rewards.geneval import GenEvalReward, parse
from rewards.hps import HPSReward
from rewards.ocr import OCRReward, target_text
from rewards.teacher import TeacherReward

REWARDS = {  # name -> its loader: (backbone, device=None, **options) -> the reward
    "teacher": TeacherReward,
    "hpsv2": HPSReward,
    "clip": CLIPReward,
    "ocr": OCRReward,
    "geneval": GenEvalReward,
    "class": digits.ClassReward,
    "digit": digits.ClassReward,  # its name on the digit miniatures
    "preference": digits.PreferenceReward,
}
IMAGE_CONTENT = ("ocr", "geneval")  # read text or objects: not for the 8x8 embedded backbones
DIGIT_REWARDS = ("class", "digit", "preference")  # read the miniatures' 16x16 images: mini-* only


def check_digits(name, backbone, spec):
    """ValueError when the reward `name` reads digits that the backbone `backbone` (spec: its row
    of backbones.BACKBONES) does not draw."""
    if name in DIGIT_REWARDS and "folder" not in spec:
        raise ValueError(
            f"the {name} reward reads the 16x16 handwritten digits that only the mini-* backbones "
            f"draw, not {backbone}'s images; use the teacher reward, or a mini-* backbone"
        )


def check_prompts(name, prompts, backbone=None):
    """ValueError naming the first prompt the reward `name` cannot score on `backbone`."""
    reads = {"ocr": target_text, "geneval": parse}
    if name in DIGIT_REWARDS:  # the classes of the backbone's classifier
        marks = digits.load_classifier(digits.reward_folder(backbone, "classifier")).classes
        reads[name] = lambda prompt: digits.class_of(prompt, marks)
    if name in reads:
        for prompt in prompts:
            reads[name](prompt)


@torch.no_grad()
def metrics(reward, name, latents, prompts, noise, cond):
    """column -> (N,) float tensor: the reward, and beside it OCR's edit score ("ocr edit"),
    GenEval's binary correctness ("geneval correct") or the digit classifier's accuracy."""
    if name in IMAGE_CONTENT:
        rows = reward.details(latents, prompts)
        score, other = ("recall", "edit") if name == "ocr" else ("reward", "correct")
        values = {key: torch.tensor([float(row[key]) for row in rows]) for key in (score, other)}
        return {name: values[score], f"{name} {other}": values[other]}
    if name in DIGIT_REWARDS:
        score, correct = reward.details(latents, prompts)
        accuracy = "digit accuracy" if reward.model.classes == digits.DIGITS else "class accuracy"
        return {name: score.cpu(), accuracy: correct.cpu()}
    return {name: reward(latents, prompts, noise, cond).float().cpu()}


def load_reward(name, backbone, device=None, checkpoint=None, **options):
    """Build the reward `name` once for `backbone`; `checkpoint` (local weights, for the rewards
    that have a model) and options go to its loader."""
    if checkpoint is not None:
        options["checkpoint"] = checkpoint
    return REWARDS[name](backbone, device=device, **options)
