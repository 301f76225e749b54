"""
GenEval's prompts (Ghosh et al. 2023, github.com/djghosh13/geneval): its benchmark regenerated, and
the shipped sets prompts/geneval_train.jsonl and prompts/geneval_heldout.jsonl drawn beside it.

    python -m prompts.geneval          # per-tag counts of the benchmark and the two sets
    python -m prompts.geneval --write  # and write the two sets

`sample` draws with the calls of GenEval's samplers (prompts/create_prompts.py) and the reward's
templates (rewards/geneval.py), so that `benchmark()` (seed 43) regenerates GenEval's own 553
prompts. prompts/geneval_heldout.jsonl (50 per tag) and prompts/geneval_train.jsonl (610) are new
draws (seed 0), disjoint from each other and, but for single objects (the benchmark has all 80),
from the benchmark.
"""

import argparse
import json
import os

import numpy as np

from rewards import geneval as templates
from rewards.geneval import CLASSES, COLORS, RELATIONS, TAGS

FOLDER = os.path.dirname(os.path.abspath(__file__))  # prompts/, where the sets are written
HELDOUT_PER_TAG = 50
# single objects: the 30 not held out; counting: 240 prompts exist, 80 of them GenEval's benchmark
TRAIN_PER_TAG = dict(
    single_object=30, two_object=120, counting=100, colors=120, position=120, color_attr=120
)


def sample(tag, rng):
    """One record of `tag`, drawn with create_prompts.py's calls on a numpy Generator."""
    if tag == "single_object":
        return templates.single_object(CLASSES[rng.choice(len(CLASSES))])
    if tag == "two_object":
        first, second = rng.choice(len(CLASSES), size=2, replace=False)
        return templates.two_object(CLASSES[first], CLASSES[second])
    if tag == "counting":
        name = CLASSES[rng.choice(len(CLASSES))]
        return templates.counting(name, int(rng.integers(2, 4, endpoint=True)))
    if tag == "colors":  # 1 + (0..78) skips class 0, person
        name = CLASSES[rng.choice(len(CLASSES) - 1) + 1]
        return templates.colors(name, COLORS[rng.choice(len(COLORS))])
    if tag == "position":
        name, target = rng.choice(len(CLASSES), size=2, replace=False)
        relation = RELATIONS[rng.choice(len(RELATIONS))]
        return templates.position(CLASSES[name], relation, CLASSES[target])
    names = [CLASSES[index] for index in rng.choice(len(CLASSES) - 1, size=2, replace=False) + 1]
    colors = [COLORS[index] for index in rng.choice(len(COLORS), size=2, replace=False)]
    return templates.color_attr(names[0], colors[0], names[1], colors[1])


def benchmark(seed=43, per_tag=100):
    """GenEval's evaluation_metadata.jsonl as generate_suite makes it: every single object once,
    then `per_tag` draws of each other tag, de-duplicated."""
    rng = np.random.default_rng(seed)
    order = rng.choice(len(CLASSES), size=len(CLASSES), replace=False)
    records = [templates.single_object(CLASSES[index]) for index in order]
    records += [sample(tag, rng) for tag in TAGS[1:] for _ in range(per_tag)]
    return list({record["prompt"]: record for record in records}.values())


def draw(rng, quotas, taken):
    """`quotas[tag]` records per tag whose prompts are not in `taken`, which grows."""
    records = []
    for tag, quota in quotas.items():
        for _ in range(quota):
            record = sample(tag, rng)
            while record["prompt"] in taken:
                record = sample(tag, rng)
            taken.add(record["prompt"])
            records.append(record)
    return records


def splits(seed=0):
    """(train, heldout): held-out drawn first; no prompt twice, none from the benchmark but single
    objects."""
    rng = np.random.default_rng(seed)
    taken = {record["prompt"] for record in benchmark() if record["tag"] != "single_object"}
    heldout = draw(rng, dict.fromkeys(TAGS, HELDOUT_PER_TAG), taken)
    return draw(rng, TRAIN_PER_TAG, taken), heldout


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="GenEval prompt sets, deterministic from --seed")
    parser.add_argument("--write", action="store_true", help="write prompts/geneval_*.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train, heldout = splits(args.seed)
    for name, records in [("benchmark", benchmark()), ("train", train), ("heldout", heldout)]:
        counts = "  ".join(f"{tag} {sum(r['tag'] == tag for r in records)}" for tag in TAGS)
        print(f"{name:<9} {len(records):4d}  {counts}")
        if args.write and name != "benchmark":
            path = os.path.join(FOLDER, f"geneval_{name}.jsonl")
            with open(path, "w") as file:
                file.writelines(json.dumps(record) + "\n" for record in records)
            print(f"wrote {path}")
