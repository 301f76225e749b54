"""
The data of mini-mix, the miniature that draws several kinds of 16x16 content: handwritten digits
(scikit-learn's, as in miniatures/data.py), printed capital letters, soft colour blobs and crops of
two photographs. The kinds ask different things of a sampler: the digits are blurred grey strokes,
the letters sharp one-pixel strokes of pure ink or paper, the blobs smooth colour with hardly any
detail, the photo crops fine texture everywhere. Early steps settle layout and colour, late ones
edges and texture, so a learned schedule may spend its steps differently on each kind.

A class is a (kind, mark) pair; a prompt names its class by holding the mark as one of its words
("the letter K", "a soft purple blob"), and class_of reads it back. The prompts are every template
of a kind filled with every mark of that kind: prompts/mix_train.txt, and prompts/mix_heldout.txt,
whose templates are never seen in training (`python -m miniatures.mix` writes both). The images
come from fixed seeds and files inside installed packages (Pillow's font, scikit-learn's digits
and sample photographs), split by use as the digits are (mix_splits).
"""

import os

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from sklearn.datasets import load_sample_images

from miniatures.data import SIDE, split
from rewards import digits

KINDS = ("digit", "letter", "shape", "photo")
HUES = dict(red=0, green=120, blue=225, yellow=55, purple=280, orange=30)  # a shape's hue, degrees
PHOTOS = {  # a photo class's sample photograph in scikit-learn, and the box its subject fills
    "flower": ("flower.jpg", (180, 90, 440, 360)),  # (left, top, right, bottom) in pixels
    "temple": ("china.jpg", (70, 60, 360, 400)),
}
CLASSES = (
    [("digit", str(digit)) for digit in range(10)]
    + [("letter", letter) for letter in "AEHKMRSTXZ"]
    + [("shape", colour) for colour in HUES]
    + [("photo", subject) for subject in PHOTOS]
)
KIND_OF = torch.tensor([KINDS.index(kind) for kind, _ in CLASSES])  # (28,) each class's kind
MARKS = tuple(mark for _, mark in CLASSES)  # the word of a prompt that names each class
TEMPLATES = {  # kind: (training templates, held-out templates), "{}" where the mark goes
    "digit": (  # those of prompts/digit_train.txt and prompts/digit_heldout.txt, in their order
        ("a handwritten {}", "the digit {}", "a {} written by hand", "handwritten digit {}",
         "a drawing of the number {}", "the number {}, handwritten", "digit {}", "a scribbled {}",
         "number {}", "a {}", "{}", "a picture of the digit {}", "the handwritten number {}",
         "a photo of a handwritten {}", "{} written by hand", "a drawn {}"),
        ("an image of a handwritten {}", "a hand-drawn {}", "the numeral {} written by hand",
         "the digit {}, drawn by hand"),
    ),
    "letter": (
        ("the letter {}", "a capital {}", "the character {}", "a printed letter {}",
         "an uppercase {}", "the glyph {}", "a typed {}", "the capital letter {}"),
        ("a sharp letter {}", "the typeface symbol {}"),
    ),
    "shape": (
        ("a {} blob", "a {} shape", "a smooth {} spot", "a soft {} blob", "a {} disc",
         "a round {} shape", "a blurry {} blob", "a {} patch"),
        ("a fuzzy {} circle", "a {} smudge"),
    ),
    "photo": (
        ("a photo of a {}", "a {} photograph", "a close-up photo of a {}", "a photo showing a {}",
         "a picture of a {}", "a snapshot of a {}", "a {} in a photo", "a detail of a {} photo"),
        ("an image of a {} photo", "a photographed {}"),
    ),
}  # fmt: skip
# images per class in each use: every kind about as many as the digits' half, twice that for the
# letters, whose sharp one-pixel strokes a small denoiser learns last
COUNTS = dict(letter=200, shape=170, photo=500)
SEEDS = dict(letter=2, shape=4, photo=6)  # a kind's pipelines' images; its held-out ones: seed + 1
LETTER_SIZES = ((16, 18, 20), (17, 19))  # font sizes in pixels (pipelines, held out): 11-14 px tall
SHIFT = 2  # a glyph lies at most this many pixels from the centre, in x and in y
CROP_SIDES, GRID = (24, 40), 6  # a crop's side in pixels (smallest, largest); the cells


def classes_of(kind):
    """(class index, mark) of each class of `kind`."""
    return [(index, mark) for index, (of, mark) in enumerate(CLASSES) if of == kind]


def class_of(prompt):
    """The index into CLASSES of the one mark among the prompt's words; ValueError otherwise."""
    return digits.class_of(prompt, MARKS)


def prompts(held_out=False):
    """Every template of every kind filled with every mark of that kind, by kind, template, mark."""
    return [
        template.format(mark)
        for kind in KINDS
        for template in TEMPLATES[kind][held_out]
        for _, mark in classes_of(kind)
    ]


def letter_images(held_out=False):
    """(N, 3, 16, 16) printed capitals in [0, 1] and their labels: dark ink on light paper, as print
    is, which also sets them apart from the digits' light ink on black from the coarsest steps on;
    no anti-aliasing, so every pixel is ink or paper; near the centre, as the digits are. Held out:
    other font sizes, and glyph corners of the other parity of x + y, so even a bitmap that two
    sizes share never lands where it did."""
    generator = torch.Generator().manual_seed(SEEDS["letter"] + held_out)
    images, labels = [], []
    for index, letter in classes_of("letter"):
        placements = []  # (glyph, x, y) for each place near the centre that keeps the whole glyph
        for size in LETTER_SIZES[held_out]:
            canvas = Image.new("1", (2 * SIDE, 2 * SIDE))
            draw = ImageDraw.Draw(canvas)
            draw.fontmode = "1"  # no anti-aliasing
            # Aileron Regular, which ships inside Pillow; `size` needs Pillow >= 10.1 and FreeType
            draw.text((0, 0), letter, fill=1, font=ImageFont.load_default(size=size))
            glyph = np.asarray(canvas.crop(canvas.getbbox()))  # the ink alone, (height, width)
            height, width = glyph.shape
            x0, y0 = (SIDE - width) // 2, (SIDE - height) // 2  # centred
            placements += [
                (glyph, x, y)
                for x in range(max(0, x0 - SHIFT), min(SIDE - width, x0 + SHIFT) + 1)
                for y in range(max(0, y0 - SHIFT), min(SIDE - height, y0 + SHIFT) + 1)
                if (x + y) % 2 == held_out
            ]
        chosen = torch.randint(len(placements), (COUNTS["letter"],), generator=generator)
        for glyph, x, y in (placements[choice] for choice in chosen.tolist()):
            image = np.zeros((SIDE, SIDE), np.float32)
            image[y : y + glyph.shape[0], x : x + glyph.shape[1]] = glyph
            images.append(image)
        labels += [index] * len(chosen)
    ink = torch.from_numpy(np.stack(images))  # (N, 16, 16), 1 on the glyph
    # placements repeat, so each image gets its own paper and ink shade
    paper = 0.8 + 0.2 * torch.rand(len(ink), 1, 1, generator=generator)
    shade = 0.25 * torch.rand(len(ink), 1, 1, generator=generator)
    images = paper + ink * (shade - paper)
    return images[:, None].expand(-1, 3, -1, -1).contiguous(), torch.tensor(labels)


def shape_images(held_out=False):
    """(N, 3, 16, 16) soft colour blobs in [0, 1] and their labels: an ellipse of the class's
    colour (its hue, saturation and brightness jittered), its rim a smooth ramp, on plain grey.
    Held out: another seed, the same ranges."""
    generator = torch.Generator().manual_seed(SEEDS["shape"] + held_out)
    shapes = classes_of("shape")
    labels = torch.tensor([index for index, _ in shapes]).repeat_interleave(COUNTS["shape"])

    def uniform(low, high):  # (N, 1, 1, 1), one draw per image
        return low + (high - low) * torch.rand(len(labels), 1, 1, 1, generator=generator)

    hue = torch.tensor([HUES[colour] for _, colour in shapes]).repeat_interleave(COUNTS["shape"])
    hue = hue[:, None, None, None] + uniform(-8, 8)  # degrees
    saturation, value = uniform(0.75, 1), uniform(0.75, 1)
    # HSV to RGB, channel by channel (the standard piecewise-linear formula)
    sector = (torch.tensor([5.0, 3.0, 1.0])[:, None, None] + hue / 60) % 6  # (N, 3, 1, 1)
    colour = value - value * saturation * torch.minimum(sector, 4 - sector).clamp(0, 1)
    centre_x, centre_y, angle = uniform(4.5, 10.5), uniform(4.5, 10.5), uniform(0, torch.pi)
    axis_x, axis_y, softness = uniform(2.5, 6), uniform(2.5, 6), uniform(0.15, 0.35)
    pixels = torch.arange(float(SIDE))
    rows, columns = torch.meshgrid(pixels, pixels, indexing="ij")
    along = (columns - centre_x) * angle.cos() + (rows - centre_y) * angle.sin()
    across = (rows - centre_y) * angle.cos() - (columns - centre_x) * angle.sin()
    radius = ((along / axis_x) ** 2 + (across / axis_y) ** 2).sqrt()  # 1 on the ellipse's rim
    inside = torch.sigmoid((1 - radius) / softness)  # (N, 1, 16, 16)
    grey = uniform(0.2, 0.8)
    return grey + inside * (colour - grey), labels


def photo_images(held_out=False):
    """(N, 3, 16, 16) crops of scikit-learn's two sample photographs in [0, 1] and their labels:
    squares of 24 to 40 pixels within the subject's box (around it lie plain sky and blurred
    leaves), downsampled with Pillow's bicubic filter, which averages over the whole square, so
    fine texture survives without aliasing. The box is cut into a GRID x GRID checkerboard: the
    pipelines' crops lie in its even cells, the held-out ones in its odd cells, so no held-out
    pixel was seen and both hold every part of the subject (roofs and walls, petals and centre)."""
    generator = torch.Generator().manual_seed(SEEDS["photo"] + held_out)
    sample = load_sample_images()
    files = dict(zip(map(os.path.basename, sample.filenames), sample.images))
    smallest, largest = CROP_SIDES
    cells = [(i, j) for i in range(GRID) for j in range(GRID) if (i + j) % 2 == held_out]
    crops, labels = [], []
    for index, subject in classes_of("photo"):
        name, (left, top, right, bottom) = PHOTOS[subject]
        photo = Image.fromarray(files[name])
        width, height = (right - left) // GRID, (bottom - top) // GRID
        sides = torch.randint(smallest, largest + 1, (COUNTS["photo"],), generator=generator)
        picks = torch.randint(len(cells), (len(sides),), generator=generator).tolist()
        # each square's corner, uniform over the places that keep the square in its cell
        shifts = torch.rand(2, len(sides), generator=generator)
        for side, pick, (u, v) in zip(sides.tolist(), picks, shifts.T.tolist()):
            column, row = cells[pick]
            x = left + column * width + int(u * (width - side + 1))
            y = top + row * height + int(v * (height - side + 1))
            # cropped first: resize(box=...) would let the filter read pixels beyond the box
            crop = photo.crop((x, y, x + side, y + side))
            crops.append(np.asarray(crop.resize((SIDE, SIDE), Image.BICUBIC)))
        labels += [index] * len(sides)
    images = torch.from_numpy(np.stack(crops)).permute(0, 3, 1, 2).float().div(255.0)
    return images.contiguous(), torch.tensor(labels)


def mix_images(held_out=False):
    """Every kind's images of one use, (images, labels): the pipelines' or the held-out ones."""
    kinds = [split()[held_out], letter_images(held_out), shape_images(held_out)]
    kinds.append(photo_images(held_out))
    return torch.cat([images for images, _ in kinds]), torch.cat([labels for _, labels in kinds])


def mix_splits():
    """The mix by use, as miniatures.data.digit_splits, each (images, labels): "pipelines" (what
    trains mini-mix: the digits' pipelines half and each other kind's pipelines images), and
    "classifier", every image no pipeline saw (the digits' other half and the held-out images
    of the other kinds); a seeded half of it ("preference") trains the preference scorer, the rest
    ("reference") is the realism measure's reference set, which the scorer never saw."""
    images, labels = mix_images(held_out=True)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(1))
    scorer, reference = order[: len(order) // 2], order[len(order) // 2 :]
    return dict(
        pipelines=mix_images(held_out=False),
        classifier=(images, labels),
        preference=(images[scorer], labels[scorer]),
        reference=(images[reference], labels[reference]),
    )


if __name__ == "__main__":
    for path, held_out in (("prompts/mix_train.txt", False), ("prompts/mix_heldout.txt", True)):
        with open(path, "w") as handle:
            handle.write("".join(prompt + "\n" for prompt in prompts(held_out)))
