"""
Prompt lists and contexts. A context is a prompt and the seed of its initial noise: training draws
them afresh every iteration (context_seed); evaluation uses fixed held-out contexts, the same noise
for every method, so that differences between methods are paired.

Prompt files: a .txt with one prompt per line, a .json list of prompts or of records with a "prompt"
(HPDv2's train.json), or a .jsonl of such records; a record's "style" or "tag" is its group. A
relative path is looked up in the current folder, then in this repository; "hpdv2" means HPDv2's
training prompts, from the hub.
"""

import argparse
import itertools
import json
import os
import reprlib

import torch
from huggingface_hub import hf_hub_download

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (train, held out) per reward with its own prompts (the others: train.py's prompts/train.jsonl)
SHIPPED = {
    "ocr": ("prompts/ocr_train.jsonl", "prompts/ocr_heldout.jsonl"),
    "geneval": ("prompts/geneval_train.jsonl", "prompts/geneval_heldout.jsonl"),
}
HPDV2 = "zhwang/HPDv2"  # the hub dataset: train.json, benchmark/<style>.json
HPDV2_STYLES = ("anime", "concept-art", "paintings", "photo")
HELDOUT_SEED = 10**6  # held-out noise seeds start here, disjoint from the seeds training draws
# tuning contexts' noise seeds (training prompts, for choosing settings): apart from both
TUNING_SEED = 2 * 10**6

QUOTED = reprlib.Repr()
QUOTED.maxstring = 80
shown = QUOTED.repr  # how a message quotes a prompt: its repr, a long one cut in the middle


def load_prompt_file(path, groups=False):
    """The prompts of a file (see the module docstring), or of HPDv2's training set for "hpdv2";
    with `groups`, (prompts, each one's "style" or "tag", else None). ValueError in one line if it
    holds no prompts."""
    if path == "hpdv2":
        path = hf_hub_download(HPDV2, "train.json", repo_type="dataset")
    elif not os.path.exists(path) and os.path.isfile(os.path.join(REPOSITORY, path)):
        path = os.path.join(REPOSITORY, path)
    kind = os.path.splitext(path)[1].lower()  # .JSON is JSON
    # utf-8-sig: a byte-order mark, as some editors write, is not part of the first prompt
    try:
        with open(path, encoding="utf-8-sig") as handle:
            if kind == ".json":
                records = json.load(handle)
            elif kind == ".jsonl":
                records = [json.loads(line) for line in handle if line.strip()]
            else:
                records = list(handle)
    except ValueError as error:  # not JSON, or not UTF-8: said with the file's name
        raise ValueError(f"{path}: {error}") from None
    if not isinstance(records, list):  # a JSON object's keys are no prompts
        raise ValueError(f"{path} holds a JSON {type(records).__name__}, not a list of prompts")
    records = [record if isinstance(record, dict) else dict(prompt=record) for record in records]
    for number, record in enumerate(records, 1):
        if not isinstance(record.get("prompt"), str):
            raise ValueError(f'{path}: record {number} is not a prompt nor has a "prompt" text')
    records = [record for record in records if record["prompt"].strip()]
    if not records:
        raise ValueError(f"{path} holds no prompts")
    prompts = [record["prompt"].strip() for record in records]
    return (prompts, [r.get("style", r.get("tag")) for r in records]) if groups else prompts


def load_hpdv2(folder=None):
    """(prompts, styles): the HPDv2 test prompts (4 styles x 800), from `folder`
    (benchmark/<style>.json) or the hub, interleaved so that any prefix (--limit) is balanced."""
    names = [f"benchmark/{style}.json" for style in HPDV2_STYLES]
    if folder is None:
        files = [hf_hub_download(HPDV2, name, repo_type="dataset") for name in names]
    else:
        files = [os.path.join(folder, os.path.basename(name)) for name in names]
    # the i-th prompt of each style in turn, while the style has one (prompts are never empty)
    rows = itertools.zip_longest(*(load_prompt_file(file) for file in files))
    pairs = [(prompt, style) for row in rows for prompt, style in zip(row, HPDV2_STYLES) if prompt]
    return [prompt for prompt, _ in pairs], [style for _, style in pairs]


def context_seed(seed, iteration, context):
    """The noise seed of a training context, its own for every context of every iteration (the same
    for any number of ranks and across a resume); offset by 2**32 from the held-out seeds."""
    return 2**32 + (seed * 1_000_003 + iteration) * 65_536 + context


def heldout_contexts(prompts, count=None, seed=HELDOUT_SEED):
    """Fixed held-out contexts: `count` prompts cycling over `prompts` (default: each once) with
    noise seeds seed, seed + 1, ... Returns (prompts, seeds)."""
    count = len(prompts) if count is None else count
    chosen = [prompts[index % len(prompts)] for index in range(count)]
    return chosen, [seed + index for index in range(count)]


def noise_seed(text):
    """argparse type of a noise seed: an integer torch's manual_seed takes, 0 <= seed < 2^63."""
    seed = int(text)  # argparse answers a ValueError with "invalid noise_seed value"
    if not 0 <= seed < 2**63:
        raise argparse.ArgumentTypeError(f"a seed is an integer from 0 to 2^63 - 1, got {text}")
    return seed


def context_noise(backbone, seeds):
    """Initial noise per seed, drawn one by one: identical for every method and batch size."""
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    return torch.cat([backbone.sample_noise(1, generator) for generator in generators])
