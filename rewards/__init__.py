"""
Rewards: black-box scores of a rollout's final latents, higher is better.

    reward = load_reward("teacher", backbone)  # or "hpsv2", "clip", "ocr", "geneval"
    scores = reward(latents, prompts, noise, cond)  # (N,) float32 on the backbone's device
    # what evaluate.py reports: name -> (N,)
    columns = metrics(reward, "ocr", latents, prompts, noise, cond)

Every reward has that one signature, batched over N samples with one prompt each (the contexts of
a batch repeated K times with repeat_interleave), is built once and reused, and decodes with
`backbone.decode` itself when it needs images. `REWARDS` maps each name to its loader.

- "teacher": fidelity to the same frozen backbone's accurate solution `backbone.reference(noise,
  cond)` from the same noise and prompt: minus the per-sample mean squared error in latent space,
  so 0 is the best possible score. No reward model, works for every backbone, the default for
  digits. Teacher solutions are cached per context (hash of the noise bytes and the prompt): the K
  rollouts of a context cost one reference solve and a fixed held-out set is solved once.
- "hpsv2": Human Preference Score v2.1 (or v2.0), x100 as the paper reports HPSv2 (its text does not
  say which version; v2.1 is this project's choice): the cosine similarity of HPS's open_clip
  ViT-H-14 image and text embeddings. Needs requirements-hps.txt and
  the checkpoint HPS_v2.1_compressed.pt from the hub repo xswu/HPSv2 (`checkpoint=` a local path).
- "clip": 100 x cosine similarity of a transformers CLIPModel's image and text embeddings
  (default openai/clip-vit-large-patch14, `checkpoint=` a hub id or local folder): a light
  prompt-alignment reward for machines without the HPS environment.
- "ocr" (ocr.py): word recall of the prompt's "quoted" text in what EasyOCR reads in the image, the
  paper's text-rendering reward; evaluate.py reports 1 - normalised edit distance beside it.
- "preference": the miniatures' HPSv2, the default reward of the mini-* backbones: a small scorer
  of (image, prompted digit) that miniatures/build.py trains as HPSv2 was trained, with a
  Bradley-Terry loss on preference pairs (a real digit over the same digit blurred, averaged,
  noised, erased, over another digit, over a miniature's sample; of two samples, the one nearer
  convergence), on digits no miniature saw. A black box on their decoded pixels; evaluate.py reports
  the classifier's accuracy beside it, and scoring/realism.py the realism of the samples.
- "digit": log p(prompted digit | image) under the small classifier that miniatures/build.py trains
  on digits the miniature pipelines never saw: prompt alignment only (it scores a blurry class mean
  above a real digit); evaluate.py reports its accuracy beside it.
- "geneval" (geneval.py): the fraction of a GenEval prompt's requirements (objects, counts,
  colours, positions) that Mask2Former and CLIP find met; evaluate.py reports GenEval's binary
  correctness beside it. Both read text or objects, which the 8x8 embedded backbones do not have.

Images are quantised to 8 bits before scoring, as the reward models were trained and evaluated on
8-bit images, and preprocessed on tensors to the same numbers as each model's own transform
(tests/test_rewards.py, tests/test_rewards_hps.py check this against the reference code).

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
        backbone,
        device=device,
        checkpoint=checkpoint,
        clip_checkpoint=clip_checkpoint,
        batch_size=batch_size,
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
# rewards that read text or objects: not for the 8x8 embedded backbones
IMAGE_CONTENT = ("ocr", "geneval")
# rewards that read the miniatures' 16x16 digits: only for the mini-* backbones
DIGIT_REWARDS = ("digit", "preference")
COLUMNS = {  # what metrics() returns, per reward
    "ocr": ("ocr", "ocr edit"),
    "geneval": ("geneval", "geneval correct"),
    "digit": ("digit", "digit accuracy"),
    "preference": ("preference", "digit accuracy"),
}


def check_digits(name, backbone, spec):
    """ValueError (one line) when the reward `name` reads the miniatures' digits and the backbone
    named `backbone` (spec: its row of backbones.BACKBONES) draws none."""
    if name in DIGIT_REWARDS and "folder" not in spec:
        raise ValueError(
            f"the {name} reward reads the 16x16 handwritten digits that only the mini-* backbones "
            f"draw, not {backbone}'s images; use the teacher reward, or a mini-* backbone"
        )


def check_prompts(name, prompts):
    """ValueError (one line, naming the prompt) for a prompt the reward `name` cannot score: OCR
    needs a "quoted" target text, GenEval one of its templates."""
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
    """name -> (N,) float tensor: the reward, and for OCR the edit score, for GenEval the binary
    correctness (GenEval's own accuracy) beside it."""
    if name == "ocr":
        rows = reward.details(latents, prompts)
        return {
            "ocr": torch.tensor([row["recall"] for row in rows]),
            "ocr edit": torch.tensor([row["edit"] for row in rows]),
        }
    if name == "geneval":
        rows = reward.details(latents, prompts)
        return {
            "geneval": torch.tensor([row["reward"] for row in rows]),
            "geneval correct": torch.tensor([float(row["correct"]) for row in rows]),
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
    if name == "preference":  # the scorer (its checkpoint) and the classifier behind its accuracy
        check_model_files("preference", checkpoint)
        check_model_files("classifier")
    if name == "clip" and not os.path.isdir(checkpoint or CLIP_DEFAULT):
        model = checkpoint or CLIP_DEFAULT
        hub_file(
            model,
            "config.json",
            f"CLIP model {model!r} not found: download it with "
            f"`hf download {model}` or pass --reward-checkpoint PATH to a local copy",
        )


def check_model_files(kind, folder=None):
    """A digit reward model's folder (digits.model_folder: "classifier" or "preference") whole:
    ValueError in one line naming a missing or damaged file."""
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
