"""
Prompt lists and contexts. A context is a prompt and the seed of its initial noise: training draws
them afresh every iteration (context_seed); evaluation uses fixed held-out contexts, the same noise
for every method, so that differences between methods are paired.

Prompt files: a .txt with one prompt per line, a .json list of prompts or of records with a "prompt"
(HPDv2's train.json), or a .jsonl of such records, whose "style" or "tag" is its group. A relative
path is looked up in the current folder, then in this repository; "hpdv2" means HPDv2's training
prompts, from the hub.
"""

import argparse
import json
import os
import reprlib

import torch

from store.files import REPOSITORY, hub_file

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


def _hpdv2_file(filename):
    return hub_file(
        HPDV2,
        filename,
        f"HPDv2's {filename} is not available: fetch it once online with `hf download {HPDV2} "
        f"{filename} --repo-type dataset`, or pass a local file or folder",
        repo_type="dataset",
    )


def load_prompt_file(path):
    """The prompts of a file (see the module docstring), or of HPDv2's training set for "hpdv2";
    ValueError in one line naming the file for anything that is not a list of prompts."""
    if path == "hpdv2":
        path = _hpdv2_file("train.json")
    elif not os.path.exists(path) and os.path.isfile(os.path.join(REPOSITORY, path)):
        path = os.path.join(REPOSITORY, path)
    if os.path.isdir(path):
        raise ValueError(f"prompt file {path} is a folder; pass a .txt, .json or .jsonl file in it")
    if not os.path.exists(path):  # a pipe (<(...), /dev/stdin) exists, and is read as a file
        raise ValueError(f"prompt file {path} does not exist")
    kind = os.path.splitext(path)[1].lower()  # .JSON is JSON
    try:
        # utf-8-sig: a byte-order mark, as some editors write, is not part of the first prompt
        with open(path, encoding="utf-8-sig") as handle:
            if kind == ".json":
                records = json.load(handle)
            elif kind == ".jsonl":
                records = [json.loads(line) for line in handle if line.strip()]
            else:
                records = list(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path} is not a prompt file ({type(error).__name__}: {str(error).splitlines()[0]})"
        ) from None
    if not isinstance(records, list):
        raise ValueError(
            f"{path} holds a JSON {type(records).__name__}, "
            'not a list of prompts or of records with a "prompt"'
        )
    bad = [
        record
        for record in records
        if not isinstance(record, str)
        and not (isinstance(record, dict) and isinstance(record.get("prompt"), str))
    ]
    if bad:
        raise ValueError(
            f'{path}: {len(bad)} entries are neither a prompt nor a record with a "prompt" text, '
            f"e.g. {str(bad[0])[:60]}"
        )
    prompts = [record["prompt"] if isinstance(record, dict) else record for record in records]
    prompts = [prompt.strip() for prompt in prompts if prompt.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def prompt_groups(path):
    """Per prompt of a .jsonl file its "style" or "tag" (or None), in load_prompt_file's order;
    None for other files."""
    if not path.endswith(".jsonl"):
        return None
    path = path if os.path.exists(path) else os.path.join(REPOSITORY, path)
    with open(path, encoding="utf-8-sig") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return [
        record.get("style", record.get("tag")) for record in records if record["prompt"].strip()
    ]


def load_hpdv2(folder=None):
    """(prompts, styles): the HPDv2 test prompts (4 styles x 800), from `folder`
    (benchmark/<style>.json) or the hub, interleaved so that any prefix (--limit) is balanced."""
    if folder is None:
        files = [_hpdv2_file(f"benchmark/{style}.json") for style in HPDV2_STYLES]
    else:
        files = [os.path.join(folder, f"{style}.json") for style in HPDV2_STYLES]
        missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(
                f"HPDv2 test prompts not found in {folder} (missing {', '.join(missing)}): "
                f"fetch them with `hf download {HPDV2} --repo-type dataset "
                '--include "benchmark/*.json" --local-dir data/HPDv2` and pass --hpdv2 '
                "data/HPDv2/benchmark"
            )
    per_style = {style: load_prompt_file(file) for style, file in zip(HPDV2_STYLES, files)}
    prompts, styles = [], []
    for index in range(max(len(p) for p in per_style.values())):
        for style in HPDV2_STYLES:
            if index < len(per_style[style]):
                prompts.append(per_style[style][index])
                styles.append(style)
    return prompts, styles


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
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a seed is an integer, got {text!r}") from None
    if not 0 <= seed < 2**63:
        raise argparse.ArgumentTypeError(f"a seed is an integer from 0 to 2^63 - 1, got {text}")
    return seed


def context_noise(backbone, seeds):
    """Initial noise per seed, drawn one by one: identical for every method and batch size."""
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    return torch.cat([backbone.sample_noise(1, generator) for generator in generators])
