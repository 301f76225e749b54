"""
The miniatures' rewards, read from their decoded pixels: "class" ("digit" on the digit miniatures),
the log-probability of the prompted class under a small classifier, and "preference", their HPSv2,
a scorer trained on preference pairs (miniatures/build.py trains both on images no miniature saw).
The classes are the digits, or mini-mix's (miniatures/mix.py): the classifier's configuration holds
their marks, the word of a prompt that names each.
"""

import os

import torch
import torch.nn as nn
from huggingface_hub import PyTorchModelHubMixin

from rewards.images import quantize

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = tuple("0123456789")  # the digit classifier's marks


def class_of(prompt, marks=DIGITS):
    """The class a prompt names: the position in `marks` of its one word that is a mark (a comma
    dropped: "the number 3, handwritten"). ValueError in one line otherwise."""
    found = [marks.index(word) for word in prompt.replace(",", " ").split() if word in marks]
    if len(found) != 1:
        raise ValueError(f"the prompt {prompt!r} must name exactly one of {', '.join(marks)}")
    return found[0]


digit_of = class_of  # the digit miniatures' classes: the digits


def reward_folder(backbone, model):
    """Where a miniature's reward `model` ("classifier" or "preference") lies: mini-mix's own, else
    the digits'."""
    return os.path.join(
        REPOSITORY, "miniatures", f"mix-{model}" if backbone == "mini-mix" else model
    )


class DigitClassifier(nn.Module, PyTorchModelHubMixin):
    """A small CNN over 16x16 RGB images in [0, 1]: logits (N, len(classes)), one per mark."""

    def __init__(self, side=16, width=24, classes=DIGITS):
        super().__init__()
        self.side, self.classes = side, tuple(classes)
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.3),
            nn.Linear(2 * width * (side // 4) ** 2, 64),
            nn.ReLU(),
            nn.Linear(64, len(classes)),
        )

    def forward(self, images):
        return self.head(self.features(2.0 * images - 1.0))


class PreferenceScorer(DigitClassifier):
    """The miniatures' preference model, built as HPSv2 is (a scorer of image and prompt trained on
    pairwise preferences): the same CNN, its outputs read as the score of an image for each
    prompted class, trained with a Bradley-Terry loss by miniatures/build.py (train_preference)."""


def load_classifier(folder=None):
    """The classifier in `folder`, else the digit classifier miniatures/build.py ships."""
    folder = folder or os.path.join(REPOSITORY, "miniatures", "classifier")
    return DigitClassifier.from_pretrained(folder).eval()


def load_scorer(folder=None):
    """The preference scorer in `folder`, else the digits' one miniatures/build.py ships."""
    folder = folder or os.path.join(REPOSITORY, "miniatures", "preference")
    return PreferenceScorer.from_pretrained(folder).eval()


class ClassReward:
    """log p(prompted class | image) under the backbone's classifier (miniatures/build.py), a black
    box on the decoded pixels as HPSv2 is on a real model's: 8-bit images at the classifier's side
    (the miniatures decode at its 16 px), its own normalisation. 0 is certainty."""

    def __init__(self, backbone, checkpoint=None, device=None):
        self.backbone = backbone
        self.device = torch.device(device or backbone.device)
        folder = checkpoint or reward_folder(backbone.name, "classifier")
        self.model = load_classifier(folder).to(self.device).requires_grad_(False)

    def pixels(self, latents):
        """The decoded 8-bit images at the models' side: (N, 3, 16, 16) in [0, 1]."""
        images = quantize(self.backbone.decode(latents)).to(self.device)
        assert images.shape[-2:] == (self.model.side,) * 2, "the digit models read 16x16 images"
        return images

    def prompted(self, prompts):
        """The class each prompt names, by the classifier's marks."""
        classes = [class_of(prompt, self.model.classes) for prompt in prompts]
        return torch.tensor(classes, device=self.device)

    @torch.no_grad()
    def details(self, latents, prompts):
        """Per sample: the reward, and 1.0 where the classifier's guess is the prompted class."""
        log_probs = torch.log_softmax(self.model(self.pixels(latents)).float(), dim=1)
        wanted = self.prompted(prompts)
        correct = (log_probs.argmax(1) == wanted).float()
        return log_probs.gather(1, wanted[:, None]).squeeze(1), correct

    def __call__(self, latents, prompts, noise, cond):
        return self.details(latents, prompts)[0]


class PreferenceReward(ClassReward):
    """The miniatures' quality reward, their HPSv2: the preference scorer's score of the image for
    the prompted class (higher is preferred; real images score highest, blurred, averaged, noisy,
    erased, wrong and unconverged ones lower). details() also gives the classifier's accuracy."""

    def __init__(self, backbone, checkpoint=None, device=None):
        super().__init__(backbone, device=device)
        folder = checkpoint or reward_folder(backbone.name, "preference")
        self.scorer = load_scorer(folder).to(self.device).requires_grad_(False)

    @torch.no_grad()
    def details(self, latents, prompts):
        images, wanted = self.pixels(latents), self.prompted(prompts)
        correct = (self.model(images).argmax(1) == wanted).float()
        return self.scorer(images).float().gather(1, wanted[:, None]).squeeze(1), correct
