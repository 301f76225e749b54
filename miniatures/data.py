"""
The miniatures' data: scikit-learn's 1,797 handwritten 8x8 digits (they ship inside the package),
upsampled to 16x16 with Pillow's bicubic filter, grey ink replicated to RGB, split by use so that
no reward model and no realism reference holds a digit a miniature trained on; and their prompts,
paraphrases such as "a handwritten 7" (prompts/digit_train.txt; the held-out ones,
prompts/digit_heldout.txt, are never seen in training).
"""

import torch

from prompts import load_prompt_file

SIDE = 16  # image side in pixels; the VAEs downsample 2x, so latents are 8x8


def digit_images():
    """(1797, 3, 16, 16) float images in [0, 1] and their labels: scikit-learn's 8x8 digits
    upsampled with Pillow's bicubic filter."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    upsampled = [
        np.asarray(Image.fromarray(image).resize((SIDE, SIDE), Image.BICUBIC)) for image in pixels
    ]
    images = torch.from_numpy(np.stack(upsampled)).float().div(255.0)[:, None].expand(-1, 3, -1, -1)
    return images.contiguous(), torch.from_numpy(digits.target).long()


def split():
    """A seeded half of the digits for the pipelines, the other half for the classifier."""
    images, labels = digit_images()
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    pipelines, classifier = order[: len(order) // 2], order[len(order) // 2 :]
    return (images[pipelines], labels[pipelines]), (images[classifier], labels[classifier])


def digit_splits():
    """The digits by use, each (images, labels): "pipelines" (the half that trains the miniatures'
    VAEs and denoisers), and the other half, which no miniature saw: all of it trains the digit
    classifier; a seeded half of it ("preference") trains the preference scorer, the rest
    ("reference") is the realism measure's reference set (miniatures/realism.py), which the scorer
    never saw."""
    pipelines, (images, labels) = split()
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(1))
    scorer, reference = order[: len(order) // 2], order[len(order) // 2 :]
    return dict(
        pipelines=pipelines,
        classifier=(images, labels),
        preference=(images[scorer], labels[scorer]),
        reference=(images[reference], labels[reference]),
    )


def prompt_lists():
    """The training and held-out paraphrases."""
    return load_prompt_file("prompts/digit_train.txt"), load_prompt_file(
        "prompts/digit_heldout.txt"
    )
