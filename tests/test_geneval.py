"""GenEval reward: prompt templates and their parser over the shipped prompt sets, the rules on
hand-built detections (thresholds, counts, duplicates, positions, colours, exclusions) against
values computed by hand and against a port of GenEval's own `evaluate` and `relative_position`,
and the detector + colour path end to end on a tiny randomly initialised Mask2Former and CLIPModel
built here."""

import itertools
import json
import pathlib
import random

import numpy as np
import pytest
import torch
from PIL import Image

# the image stand-in, the 8-bit PIL conversion, a tiny CLIP folder and transformers' scores with it
from test_rewards import ImageBackbone, clip_reference, save_tiny_clip, to_pil

import rewards.images as preprocess
from prompts.geneval import benchmark, splits
from rewards import geneval
from rewards.geneval import Detection, parse, score

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(name):
    lines = (ROOT / "prompts" / f"geneval_{name}.jsonl").read_text().splitlines()
    return lines, [json.loads(line) for line in lines]


def det(label, score=0.95, box=(0, 0, 10, 10), color=None):
    return Detection(label, score, box, color=color)


# ----------------------------------------------------------------------------------------------
# prompts


def test_templates_and_record_layout():
    assert parse("a photo of a dog") == {
        "tag": "single_object",
        "include": [{"class": "dog", "count": 1}],
        "prompt": "a photo of a dog",
    }
    assert parse("a photo of two dogs") == {
        "tag": "counting",
        "include": [{"class": "dog", "count": 2}],
        "exclude": [{"class": "dog", "count": 3}],
        "prompt": "a photo of two dogs",
    }
    # "+es" after an s, as GenEval
    assert parse("a photo of four buses")["include"] == [{"class": "bus", "count": 4}]
    assert parse("a photo of three skises")["include"] == [{"class": "skis", "count": 3}]
    assert parse("a photo of an orange")["tag"] == "single_object"  # orange is a class and a colour
    assert parse("a photo of an orange orange")["include"] == [
        {"class": "orange", "count": 1, "color": "orange"}
    ]
    assert parse("a photo of a dog left of a cat") == {
        "tag": "position",
        "include": [
            {"class": "cat", "count": 1},
            {"class": "dog", "count": 1, "position": ["left of", 0]},
        ],
        "prompt": "a photo of a dog left of a cat",
    }
    # GenEval's key order: tag, include, exclude, prompt
    assert list(parse("a photo of three cats")) == ["tag", "include", "exclude", "prompt"]
    assert len(geneval.PHRASES) == 80 + 80 * 10  # no phrase is two things


@pytest.mark.parametrize(
    "prompt",
    [
        "a photo of a unicorn",
        "a photo of five dogs",
        "a dog",
        "a photo of a red car and a bench",
        "a photo of a dog next to a cat",
        "a photo of two dog",
        "",
    ],
)
def test_parse_rejects_other_prompts_in_one_line(prompt):
    with pytest.raises(ValueError, match="not a GenEval prompt") as error:
        parse(prompt)
    assert repr(prompt) in str(error.value) and "\n" not in str(error.value)


def test_benchmark_regenerates_genevals_prompts():
    records = benchmark()
    counts = {tag: sum(r["tag"] == tag for r in records) for tag in geneval.TAGS}
    # GenEval's evaluation_metadata.jsonl: 553 prompts, its first records and prompts quoted from it
    assert counts == {
        "single_object": 80,
        "two_object": 99,
        "counting": 80,
        "colors": 94,
        "position": 100,
        "color_attr": 100,
    }
    firsts = {tag: next(r["prompt"] for r in records if r["tag"] == tag) for tag in geneval.TAGS}
    assert firsts["single_object"] == "a photo of a bench"
    assert firsts["counting"] == "a photo of two clocks"
    assert firsts["position"] == "a photo of a dog right of a teddy bear"
    prompts = {r["prompt"] for r in records}
    assert {
        "a photo of a bench left of a bear",
        "a photo of an elephant below a horse",
        "a photo of four giraffes",
        "a photo of a yellow car and an orange toothbrush",
        "a photo of a red orange and a purple broccoli",
        "a photo of a pink car",
        "a photo of a brown giraffe and a white stop sign",
    } <= prompts
    assert all(parse(r["prompt"]) == r for r in records)


def test_shipped_prompt_sets():
    train_lines, train = load("train")
    heldout_lines, heldout = load("heldout")
    assert len(train) >= 600 and len(heldout) >= 300
    assert {r["tag"] for r in train} == set(geneval.TAGS)
    assert {tag: sum(r["tag"] == tag for r in heldout) for tag in geneval.TAGS} == dict.fromkeys(
        geneval.TAGS, 50
    )
    train_prompts, heldout_prompts = [r["prompt"] for r in train], [r["prompt"] for r in heldout]
    assert len(set(train_prompts)) == len(train) and len(set(heldout_prompts)) == len(heldout)
    assert not set(train_prompts) & set(heldout_prompts)
    regenerated = {r["prompt"] for r in benchmark() if r["tag"] != "single_object"}
    assert not regenerated & (set(train_prompts) | set(heldout_prompts))
    for line, record in zip(train_lines + heldout_lines, train + heldout):
        # same layout, key order
        assert parse(record["prompt"]) == record and json.dumps(parse(record["prompt"])) == line
    assert (train, heldout) == splits(0)  # the files are what the generator writes


# ----------------------------------------------------------------------------------------------
# rules, by hand


def dog_at(x, score=0.9):
    return det("dog", score, (x, 0, x + 10, 10))


def car(color, score=0.95):
    return det("car", score, color=color)


CAT = det("cat", 0.9, (50, 0, 60, 10))
TWO_DOGS = "a photo of two dogs"  # requirements: >= 2 dogs, fewer than 3, counted above 0.9
DOG_LEFT_OF_CAT = "a photo of a dog left of a cat"  # a cat, a dog, the dog left of the cat
RED_CAR_BLUE_BENCH = "a photo of a red car and a blue bench"  # a car, red, a bench, blue


@pytest.mark.parametrize(
    "prompt, detections, expected",
    [
        # a detection counts above 0.3, strictly
        ("a photo of a dog", [det("dog", 0.3)], (0.0, False)),
        ("a photo of a dog", [det("dog", 0.3001)], (1.0, True)),
        # counting; overlapping duplicates count (GenEval's max_overlap 1.0 suppresses nothing)
        (TWO_DOGS, [det("dog", 0.95), det("dog", 0.9)], (0.5, False)),  # 0.9 is not above 0.9
        (TWO_DOGS, [det("dog", 0.95), det("dog", 0.9001)], (1.0, True)),
        (TWO_DOGS, [det("dog", 0.95), det("dog", 0.91), det("dog", 0.8)], (1.0, True)),
        (TWO_DOGS, [det("dog", 0.95), det("dog", 0.91), det("dog", 0.92)], (0.5, False)),
        # two objects: the counting threshold holds for a counting prompt only, and other classes
        # are not excluded
        ("a photo of a dog and a cat", [det("dog", 0.5), det("cat", 0.5)], (1.0, True)),
        ("a photo of a dog and a cat", [det("dog"), det("cat"), det("bird")], (1.0, True)),
        ("a photo of a dog and a cat", [det("dog")], (0.5, False)),
        # position: only the best detection of each class is placed
        (DOG_LEFT_OF_CAT, [dog_at(0), CAT], (1.0, True)),
        (DOG_LEFT_OF_CAT, [dog_at(100), CAT], (2 / 3, False)),
        (DOG_LEFT_OF_CAT, [dog_at(0)], (1 / 3, False)),  # no target
        (DOG_LEFT_OF_CAT, [dog_at(0), dog_at(100, score=0.5), CAT], (1.0, True)),
        (DOG_LEFT_OF_CAT, [dog_at(0, score=0.5), dog_at(100), CAT], (2 / 3, False)),
        # colours: the best car decides
        ("a photo of a red car", [car("red")], (1.0, True)),
        ("a photo of a red car", [car("blue")], (0.5, False)),
        ("a photo of a red car", [car("blue", 0.9), car("red", 0.5)], (0.5, False)),
        ("a photo of a red car", [det("truck", color="red")], (0.0, False)),
        # colour attribution
        (RED_CAR_BLUE_BENCH, [car("red"), det("bench", color="blue")], (1.0, True)),
        (RED_CAR_BLUE_BENCH, [car("blue"), det("bench", color="red")], (0.5, False)),
        (RED_CAR_BLUE_BENCH, [car("red")], (0.5, False)),
        (RED_CAR_BLUE_BENCH, [det("bench", color="red")], (0.25, False)),
    ],
)
def test_score_by_hand(prompt, detections, expected):
    """The fraction of the prompt's requirements met, and whether all are."""
    assert score(parse(prompt), detections) == (pytest.approx(expected[0]), expected[1])


def test_at_most_max_objects_per_class_best_first():
    found = geneval.found_objects(
        [det("cat", 0.4 + i / 100) for i in range(20)] + [det("dog", 0.5)], "two_object"
    )
    assert [len(found["cat"]), len(found["dog"])] == [16, 1]
    assert [d.score for d in found["cat"]] == sorted(
        (0.4 + i / 100 for i in range(4, 20)), reverse=True
    )


# ----------------------------------------------------------------------------------------------
# rules against GenEval's own evaluate, on random scenes


def reference_relative_position(box_a, box_b):
    """evaluate_images.py's relative_position, numpy as written there."""
    boxes = np.array([box_a, box_b])[:, :4].reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised_offset = np.maximum(np.abs(offset) - 0.1 * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised_offset) < 1e-3):
        return set()
    dx, dy = revised_offset / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def reference_correct(metadata, detections):
    """evaluate_images.py's evaluate_image filtering and evaluate, on Detections (colours given)."""
    threshold = 0.9 if metadata["tag"] == "counting" else 0.3
    objects = {}
    for classname in geneval.CLASSES:
        mine = [d for d in detections if d.label == classname]
        ordering = np.argsort([d.score for d in mine])[::-1]
        ordering = [index for index in ordering if mine[index].score > threshold][:16]
        if ordering:
            objects[classname] = [mine[index] for index in ordering]
    correct, matched_groups = True, []
    for req in metadata.get("include", []):
        matched = True
        found_objects = objects.get(req["class"], [])[: req["count"]]
        if len(found_objects) < req["count"]:
            correct = matched = False
        else:
            if (
                "color" in req
                and [obj.color for obj in found_objects].count(req["color"]) < req["count"]
            ):
                correct = matched = False
            if "position" in req and matched:
                expected_rel, target_group = req["position"]
                if matched_groups[target_group] is None:
                    correct = matched = False
                else:
                    for obj in found_objects:
                        for target_obj in matched_groups[target_group]:
                            if expected_rel not in reference_relative_position(
                                obj.box, target_obj.box
                            ):
                                correct = matched = False
                                break
                        if not matched:
                            break
        matched_groups.append(found_objects if matched else None)
    for req in metadata.get("exclude", []):
        if len(objects.get(req["class"], [])) >= req["count"]:
            correct = False
    return correct


def random_scene(record, rng):
    """Detections of the prompt's classes (0-4 each, scores at and around both thresholds, colours
    mostly right) and of a distractor class, in random boxes."""
    detections = []
    for clause in record["include"] + [{"class": rng.choice(geneval.CLASSES)}]:
        for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 4])):
            x, y = rng.uniform(0, 100), rng.uniform(0, 100)
            w, h = rng.uniform(5, 40), rng.uniform(5, 40)
            color = clause.get("color") if rng.random() < 0.7 else rng.choice(geneval.COLORS)
            # distinct scores: GenEval orders ties by numpy's argsort, which no rule may depend on
            score = rng.choice([0.2, 0.3, 0.5, 0.9, 0.95, 0.99, rng.random()])
            score -= 1e-9 * len(detections)
            detections.append(Detection(clause["class"], score, (x, y, x + w, y + h), color=color))
    return detections


def test_correct_is_genevals_evaluate():
    rng = random.Random(0)
    outcomes = []
    for record in load("train")[1] + load("heldout")[1]:
        for _ in range(3):
            detections = random_scene(record, rng)
            fraction, correct = score(record, detections)
            assert correct == reference_correct(record, detections), (record["prompt"], detections)
            assert (fraction == 1.0) == correct and 0.0 <= fraction <= 1.0
            boxes = [detection.box for detection in detections]  # every pair, each with itself
            for box, other in itertools.product(boxes, repeat=2):
                expected = reference_relative_position(box, other)
                assert geneval.relative_position(box, other) == expected, (box, other)
            outcomes.append((record["tag"], correct))
    for tag in geneval.TAGS:  # both outcomes occur for every tag, so the comparison means something
        assert {correct for t, correct in outcomes if t == tag} == {True, False}


# ----------------------------------------------------------------------------------------------
# detector and colour path, on tiny random models


CAR = geneval.CLASSES.index("car")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A Mask2Former (Swin backbone, 8 queries, COCO's 80 labels) whose class head favours "car",
    so that detections pass the thresholds, and a CLIPModel with its tokenizer, saved to folders."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    torch.manual_seed(0)
    swin = SwinConfig(
        image_size=64,
        patch_size=4,
        embed_dim=32,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 1, 1],
        window_size=4,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    config = Mask2FormerConfig(
        backbone_config=swin,
        hidden_dim=32,
        feature_size=32,
        mask_feature_size=32,
        encoder_feedforward_dim=32,
        dim_feedforward=32,
        num_queries=8,
        decoder_layers=2,
        encoder_layers=1,
        num_attention_heads=2,
        id2label=dict(enumerate(geneval.CLASSES)),
    )
    detector = Mask2FormerForUniversalSegmentation(config)
    with torch.no_grad():
        detector.class_predictor.bias[CAR] += 20.0
    detector_path = tmp_path_factory.mktemp("tiny-mask2former")
    detector.save_pretrained(detector_path)
    clip_path = save_tiny_clip(tmp_path_factory.mktemp("tiny-clip"), image_size=32, patch_size=8)
    return str(detector_path), clip_path


@pytest.fixture(scope="module")
def reward(tiny_models):
    return geneval.GenEvalReward(
        ImageBackbone(),
        checkpoint=tiny_models[0],
        clip_checkpoint=tiny_models[1],
        detector_size=(64, 96),
        batch_size=2,
    )


IMAGES = torch.rand(4, 3, 48, 64, generator=torch.Generator().manual_seed(1))
PROMPTS = [
    "a photo of a red car",
    "a photo of two cars",
    "a photo of a dog left of a car",
    "a photo of a blue car and a green bench",
]


def test_detections_are_masks_with_boxes_and_colour_is_clip_on_the_grey_crop(reward, tiny_models):
    """The colour: against transformers' CLIPModel and CLIPImageProcessorPil on GenEval's PIL
    composite."""
    images = preprocess.quantize(IMAGES)
    detections = reward.detect(images)
    assert len(detections) == 4 and all(detections)
    for found in detections:
        for detection in found:
            assert detection.label == "car" and detection.score >= geneval.THRESHOLD
            assert detection.mask.shape == (48, 64) and detection.mask.dtype == torch.bool
            rows, columns = detection.mask.nonzero().T.tolist()
            assert detection.box == (min(columns), min(rows), max(columns) + 1, max(rows) + 1)
    wanted = [(index, found[0]) for index, found in enumerate(detections)]
    reward.classify_colors(images, wanted)
    crops = []
    for index, detection in wanted:
        image, mask = to_pil(images[index]), Image.fromarray(detection.mask.numpy())
        composite = Image.composite(image, Image.new("RGB", image.size, color="#999"), mask)
        crops.append(composite.crop(detection.box))
    texts = [t.format(color=c, name="car") for c in geneval.COLORS for t in geneval.COLOR_TEMPLATES]
    _, out = clip_reference(tiny_models[1], 32, texts, crops)
    classifier = torch.nn.functional.normalize(out.text_embeds.view(10, 3, -1).mean(1), dim=-1)
    scores = (out.image_embeds @ classifier.T).sort(1)  # per crop, the colours from worst to best
    predicted = [geneval.COLORS[i] for i in scores.indices[:, -1]]
    assert [detection.color for _, detection in wanted] == predicted
    assert (scores.values[:, -1] - scores.values[:, -2] > 1e-5).all()  # no argmax is a tie


def test_reward_end_to_end_and_batch_equals_one_by_one(reward):
    scores = reward(IMAGES, PROMPTS, None, None)
    assert scores.shape == (4,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    rows = reward.details(IMAGES, PROMPTS)
    assert [row["tag"] for row in rows] == ["colors", "counting", "position", "color_attr"]
    assert [len(row["requirements"]) for row in rows] == [2, 2, 3, 4]
    assert rows[0]["requirements"][0] == ("1 car", True)
    assert rows[2]["requirements"][1] == ("1 dog", False)
    assert torch.equal(scores, torch.tensor([row["reward"] for row in rows]))
    for row in rows:
        met = [ok for _, ok in row["requirements"]]
        assert row["reward"] == sum(met) / len(met) and row["correct"] == all(met)
    single = torch.cat([reward(IMAGES[[i]], PROMPTS[i : i + 1], None, None) for i in range(4)])
    assert torch.equal(scores, single)  # each image is paired with its prompt and scored alone
