"""
GenEval (Ghosh et al. 2023, github.com/djghosh13/geneval) as a reward: a prompt names COCO objects
with counts, colours and relative positions; an instance segmenter and CLIP check the image.

    reward = GenEvalReward(backbone)  # reward(latents, prompts, noise, cond) -> (N,) in [0, 1]
    rows = reward.details(latents, prompts)  # per image: tag, GenEval's 0/1 "correct", requirements

Prompts (prompts/create_prompts.py): six tags over GenEval's 80 classes (object_names.txt: COCO's,
with mouse, remote, keyboard renamed computer mouse, tv remote, computer keyboard) and ten colours;
evaluation_metadata.jsonl's record layout; its templates, "a"/"an" by first letter and plurals by
"+s"/"+es" kept as written ("two skises"); no coloured person. `parse` turns a prompt back into its
record: a reward sees only prompt strings; prompts/geneval.py draws the shipped sets with them.

Rules (evaluation/evaluate_images.py with its defaults): detections scoring above 0.3 (0.9 in a
counting prompt), the 16 best per class, greedy NMS at IoU `max_overlap` 1.0, i.e. none (overlapping
duplicates all count), `relative_position` with margin 0.1, `evaluate`. Requirements, each met or
not: every include clause's class found `count` times (its `count` best detections are its
objects); every colour: all those objects classified as it; every relation: each of them so placed
to each object of the target clause (unmet if either clause failed); every exclude clause: fewer
than `count` found. The reward is the fraction met (partial credit for RL); "correct", all met, is
exactly GenEval's; evaluate.py's overall is the mean over tags of the share of correct images
(evaluation/summary_scores.py).

Detector and colours, and how they differ from GenEval's: transformers' Mask2Former (default the
Swin-S COCO instance model of the Mask2Former release, where GenEval runs mmdetection's own Swin-S),
fed as mmdetection's test pipeline (bilinear, short side 800, long side at most 1333, ImageNet
mean/std) except that the size is rounded up to a multiple of 32 by resizing, as transformers'
processor does, not by padding; its post_process_instance_segmentation binarises masks at 384x384
(mmdetection at full size) before they are upsampled; boxes from masks as mmdetection's mask2bbox.
Colours: CLIP ViT-L/14 zero-shot over GenEval's three templates on the object's mask over grey
#999, cropped to its box; the same OpenAI weights, in transformers, float32, preprocessed by
rewards.images.clip_preprocess (CLIPImageProcessor: centre crop at floor((H-224)/2), torchvision
rounds).
Images are scored as tensors quantised to 8 bits, as GenEval reads PNGs.
"""

import math
from dataclasses import dataclass
from itertools import compress
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from rewards.clip import CLIP_DEFAULT, CLIPReward
from rewards.images import clip_preprocess, normalize, quantize

CLASSES = (  # GenEval's object_names.txt, in the detector's class order
    "person|bicycle|car|motorcycle|airplane|bus|train|truck|boat|traffic light|fire hydrant|"
    "stop sign|parking meter|bench|bird|cat|dog|horse|sheep|cow|elephant|bear|zebra|giraffe|"
    "backpack|umbrella|handbag|tie|suitcase|frisbee|skis|snowboard|sports ball|kite|baseball bat|"
    "baseball glove|skateboard|surfboard|tennis racket|bottle|wine glass|cup|fork|knife|spoon|"
    "bowl|banana|apple|sandwich|orange|broccoli|carrot|hot dog|pizza|donut|cake|chair|couch|"
    "potted plant|bed|dining table|toilet|tv|laptop|computer mouse|tv remote|computer keyboard|"
    "cell phone|microwave|oven|toaster|sink|refrigerator|book|clock|vase|scissors|teddy bear|"
    "hair drier|toothbrush"
).split("|")
COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
RELATIONS = ["left of", "right of", "above", "below"]
NUMBERS = ["zero", "one", "two", "three", "four"]
TAGS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]
PREFIX = "a photo of "

THRESHOLD = 0.3  # detection score an object must exceed
COUNTING_THRESHOLD = 0.9  # the same for every class of a counting prompt
MAX_OBJECTS = 16  # best detections kept per class
POSITION_THRESHOLD = 0.1  # margin, a fraction of the two objects' summed width / height
COLOR_TEMPLATES = [
    "a photo of a {color} {name}",
    "a photo of a {color}-colored {name}",
    "a photo of a {color} object",
]
BACKGROUND = 153 / 255  # "#999", the grey GenEval puts around a masked object before CLIP

DETECTOR_DEFAULT = "facebook/mask2former-swin-small-coco-instance"


# ----------------------------------------------------------------------------------------------
# prompts: GenEval's templates and their inverse


def article(phrase):
    return f"an {phrase}" if phrase[0] in "aeiou" else f"a {phrase}"


def plural(name):
    return f"{name}es" if name.endswith("s") else f"{name}s"


def single_object(name):
    return {
        "tag": "single_object",
        "include": [{"class": name, "count": 1}],
        "prompt": PREFIX + article(name),
    }


def two_object(first, second):
    return {
        "tag": "two_object",
        "include": [{"class": first, "count": 1}, {"class": second, "count": 1}],
        "prompt": f"{PREFIX}{article(first)} and {article(second)}",
    }


def counting(name, count):
    return {
        "tag": "counting",
        "include": [{"class": name, "count": count}],
        "exclude": [{"class": name, "count": count + 1}],
        "prompt": f"{PREFIX}{NUMBERS[count]} {plural(name)}",
    }


def colors(name, color):
    return {
        "tag": "colors",
        "include": [{"class": name, "count": 1, "color": color}],
        "prompt": PREFIX + article(f"{color} {name}"),
    }


def position(name, relation, target):
    # the target comes first, so that the relation can point back at include clause 0
    return {
        "tag": "position",
        "include": [
            {"class": target, "count": 1},
            {"class": name, "count": 1, "position": [relation, 0]},
        ],
        "prompt": f"{PREFIX}{article(name)} {relation} {article(target)}",
    }


def color_attr(first, first_color, second, second_color):
    first_phrase = article(f"{first_color} {first}")
    second_phrase = article(f"{second_color} {second}")
    return {
        "tag": "color_attr",
        "include": [
            {"class": first, "count": 1, "color": first_color},
            {"class": second, "count": 1, "color": second_color},
        ],
        "prompt": f"{PREFIX}{first_phrase} and {second_phrase}",
    }


# "a dog", "an orange", "a red car", "an orange orange"
PHRASES = {article(name): (name, None) for name in CLASSES}
PHRASES.update({article(f"{color} {name}"): (name, color) for color in COLORS for name in CLASSES})
COUNTS = {
    f"{NUMBERS[count]} {plural(name)}": (name, count) for count in (2, 3, 4) for name in CLASSES
}


def parse(prompt):
    """A GenEval prompt -> its record (the builders above, inverted); ValueError if not one."""
    body = prompt[len(PREFIX) :] if prompt.startswith(PREFIX) else ""
    if body in PHRASES:
        name, color = PHRASES[body]
        return colors(name, color) if color else single_object(name)
    if body in COUNTS:
        return counting(*COUNTS[body])
    for joint in ["and"] + RELATIONS:
        first, found, second = body.partition(f" {joint} ")
        if found and first in PHRASES and second in PHRASES:
            (first, first_color), (second, second_color) = PHRASES[first], PHRASES[second]
            if joint == "and" and first_color and second_color:
                return color_attr(first, first_color, second, second_color)
            if not first_color and not second_color:
                return (
                    two_object(first, second) if joint == "and" else position(first, joint, second)
                )
    raise ValueError(f"not a GenEval prompt (templates in geneval.py): {prompt!r}")


# ----------------------------------------------------------------------------------------------
# rules: pure functions over one image's detections


@dataclass(eq=False)
class Detection:
    label: str  # a name in CLASSES
    score: float
    box: tuple  # (x0, y0, x1, y1) in pixels
    mask: torch.Tensor = None  # (H, W) bool, for the colour crop
    color: str = None  # a name in COLORS, once classified


def relative_position(box, target):
    """Relations of `box` to `target` (evaluate_images.py): the centres' offset, shrunk on each axis
    by POSITION_THRESHOLD times the two objects' sizes, over the offset's length, beyond +-0.5."""
    offset = [(box[i] + box[i + 2] - target[i] - target[i + 2]) / 2 for i in (0, 1)]
    sizes = [abs(box[i + 2] - box[i]) + abs(target[i + 2] - target[i]) for i in (0, 1)]
    revised = [np.sign(d) * max(abs(d) - POSITION_THRESHOLD * s, 0) for d, s in zip(offset, sizes)]
    if all(abs(d) < 1e-3 for d in revised):
        return set()
    dx, dy = np.array(revised) / np.linalg.norm(offset)
    return set(compress(RELATIONS, (dx < -0.5, dx > 0.5, dy < -0.5, dy > 0.5)))


def found_objects(detections, tag):
    """evaluate_image's filtering: class -> its detections above the tag's threshold, best first, at
    most MAX_OBJECTS. GenEval's non-maximum suppression runs at max_overlap 1.0, which keeps every
    overlap, so it is left out."""
    threshold = COUNTING_THRESHOLD if tag == "counting" else THRESHOLD
    ranked = sorted((d for d in detections if d.score > threshold), key=lambda d: -d.score)
    names = dict.fromkeys(detection.label for detection in detections)
    return {name: [d for d in ranked if d.label == name][:MAX_OBJECTS] for name in names}


def requirements(record, detections):
    """[(requirement, met)] for one image, in the order of GenEval's `evaluate`."""
    found = found_objects(detections, record["tag"])
    checks, groups = [], []  # groups: per include clause its objects, None if the clause failed
    for clause in record["include"]:
        name, count = clause["class"], clause["count"]
        objects = found.get(name, [])[:count]
        matched = len(objects) >= count
        checks.append((f"{count} {name}", matched))
        if "color" in clause:
            matched = matched and sum(obj.color == clause["color"] for obj in objects) >= count
            checks.append((f"{clause['color']} {name}", matched))
        if "position" in clause:
            relation, target = clause["position"]
            pairs = [(obj.box, other.box) for obj in objects for other in groups[target] or []]
            placed = all(relation in relative_position(*pair) for pair in pairs)
            matched = matched and groups[target] is not None and placed
            checks.append((f"{name} {relation} {record['include'][target]['class']}", matched))
        groups.append(objects if matched else None)
    for clause in record.get("exclude", []):
        name, count = clause["class"], clause["count"]
        checks.append((f"fewer than {count} {name}", len(found.get(name, [])) < count))
    return checks


def score(record, detections):
    """(fraction of the requirements met, GenEval's correct) for one image."""
    met = [ok for _, ok in requirements(record, detections)]
    return sum(met) / len(met), all(met)


# ----------------------------------------------------------------------------------------------
# detector and colour classifier


def mask_box(mask):
    """mmdetection's mask2bbox: (x0, y0, x1 + 1, y1 + 1) of a non-empty (H, W) bool mask."""
    columns, rows = mask.any(0).nonzero().flatten(), mask.any(1).nonzero().flatten()
    return (float(columns[0]), float(rows[0]), float(columns[-1] + 1), float(rows[-1] + 1))


class GenEvalReward:
    """Fraction of a GenEval prompt's requirements the decoded image meets (module docstring).
    `checkpoint`: a transformers Mask2Former COCO instance model, hub id or folder (default Swin-S;
    e.g. facebook/mask2former-swin-large-coco-instance); `clip_checkpoint`: a CLIPModel."""

    def __init__(
        self,
        backbone,
        checkpoint=DETECTOR_DEFAULT,
        clip_checkpoint=CLIP_DEFAULT,
        device=None,
        detector_size=(800, 1333),
        batch_size=8,
    ):
        from transformers import Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessorPil

        self.backbone = backbone
        self.device = torch.device(device or backbone.device)
        self.detector_size = detector_size  # (shortest, longest) side the detector sees at most
        self.batch_size = batch_size
        detector = Mask2FormerForUniversalSegmentation.from_pretrained(checkpoint)
        self.detector = detector.to(self.device).eval().requires_grad_(False)
        labels = self.detector.config.num_labels
        if labels != len(CLASSES):  # GenEval reads detector class i as object_names.txt line i
            raise ValueError(
                f"{checkpoint} has {labels} classes; GenEval needs a COCO instance model (80)"
            )
        self.processor = Mask2FormerImageProcessorPil()  # post-processing only: no configuration
        self.clip = CLIPReward(backbone, clip_checkpoint, self.device, batch_size)  # colours
        self.color_classifiers = {}  # class name -> (10, D), GenEval's COLOR_CLASSIFIERS

    def detect(self, images):
        """(N, 3, H, W) 8-bit images in [0, 1] -> per image its Detections scoring >= THRESHOLD."""
        height, width = images.shape[-2:]
        shortest, longest = self.detector_size
        scale = min(shortest / min(height, width), longest / max(height, width))
        size = [math.ceil(int(side * scale + 0.5) / 32) * 32 for side in (height, width)]
        # mmcv's cv2 resize, then mmdetection's img_norm_cfg / 255
        pixels = F.interpolate(images.to(self.device), size, mode="bilinear", align_corners=False)
        pixels = normalize(pixels, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        outputs = self.detector(pixel_values=pixels)
        # on the CPU: post-processing builds its (384, 384) maps there whatever the outputs' device
        outputs = SimpleNamespace(
            class_queries_logits=outputs.class_queries_logits.float().cpu(),
            masks_queries_logits=outputs.masks_queries_logits.float().cpu(),
        )
        results = self.processor.post_process_instance_segmentation(
            outputs, threshold=THRESHOLD, return_binary_maps=True
        )
        detections = [[] for _ in results]
        for found, result in zip(detections, results):
            if result["segments_info"]:  # else "segmentation" is an empty map, not binary masks
                segmentation = result["segmentation"][None].to(self.device)
                masks = F.interpolate(segmentation, (height, width), mode="nearest")[0].bool()
                found += [
                    Detection(CLASSES[segment["label_id"]], segment["score"], mask_box(mask), mask)
                    for segment, mask in zip(result["segments_info"], masks)
                    if mask.any()
                ]  # a speck at 384x384 can vanish in a smaller image
        return detections

    def color_classifier(self, name):
        """clip_benchmark's zero_shot_classifier over GenEval's templates: per colour the mean of
        its normalised text embeddings, renormalised. (10, D)"""
        if name not in self.color_classifiers:
            texts = [t.format(color=color, name=name) for color in COLORS for t in COLOR_TEMPLATES]
            embeddings = self.clip.embed_text(texts).view(len(COLORS), len(COLOR_TEMPLATES), -1)
            self.color_classifiers[name] = F.normalize(embeddings.mean(1), dim=-1)
        return self.color_classifiers[name]

    def classify_colors(self, images, wanted):
        """Set `.color` of each (image index, Detection) in `wanted`, as GenEval's
        color_classification: CLIP on the object over grey, cropped to its box."""
        crops = []
        for index, detection in wanted:
            x0, y0, x1, y1 = (int(value) for value in detection.box)
            masked = torch.where(detection.mask, images[index].to(self.device), BACKGROUND)
            crops.append(clip_preprocess(masked[None, :, y0:y1, x0:x1], self.clip.image_size))
        for start in range(0, len(crops), self.batch_size):
            features = self.clip.embed_image(torch.cat(crops[start : start + self.batch_size]))
            for (_, detection), feature in zip(wanted[start : start + self.batch_size], features):
                scores = self.color_classifier(detection.label) @ feature  # (10,)
                detection.color = COLORS[int(scores.argmax())]

    @torch.no_grad()
    def details(self, latents, prompts):
        """Per decoded image of N latents and N GenEval prompts: {"prompt", "tag", "reward",
        "correct", "requirements"}; a prompt that does not parse fails first."""
        records = [parse(prompt) for prompt in prompts]
        images = quantize(self.backbone.decode(latents))
        per_image = []  # per image its Detections
        for chunk in images.split(self.batch_size):
            per_image += self.detect(chunk)
        wanted = []  # as GenEval: the colours of a coloured clause's `count` best objects
        for index, (record, detections) in enumerate(zip(records, per_image)):
            found = found_objects(detections, record["tag"])
            wanted += [
                (index, obj)
                for clause in record["include"]
                if "color" in clause
                for obj in found.get(clause["class"], [])[: clause["count"]]
            ]
        self.classify_colors(images, wanted)
        rows = []
        for prompt, record, detections in zip(prompts, records, per_image):
            fraction, correct = score(record, detections)
            row = dict(prompt=prompt, tag=record["tag"], reward=fraction, correct=correct)
            rows.append(dict(row, requirements=requirements(record, detections)))
        return rows

    def __call__(self, latents, prompts, noise, cond):
        rewards = [row["reward"] for row in self.details(latents, prompts)]
        return torch.tensor(rewards, dtype=torch.float32, device=self.device)
