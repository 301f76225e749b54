"""
What the miniatures reach and how their settings were chosen, written into docs/RESULTS.md:

    python -m evidence.miniatures --guidance-sweep  # each miniature's default guidance
    python -m evidence.miniatures --agreement       # the rewards against realism per step count
    python -m evidence.miniatures --check           # what the shipped folders reach
"""

import argparse
import os

import torch

import backbones
from evaluate import default_schedule
from evidence.results import commit, one_line_errors, record
from miniatures.build import FAMILIES, FOLDER, folder_size
from miniatures.data import digit_splits, prompt_lists, split
from miniatures.realism import realism_measure, sample_images
from prompts import TUNING_SEED, heldout_contexts
from rewards import load_reward
from rewards.digits import digit_of, load_classifier, load_scorer

# -----------------------------------------------------------------------------
# the miniatures' default guidance, chosen as a real model's is

TUNING_CONTEXTS = 512  # training paraphrases with tuning noise (prompts.TUNING_SEED)
GUIDANCES = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)
MIN_ACCURACY = 0.95  # of 50-step samples showing the prompted digit


@torch.no_grad()
def guidance_sweep():
    """Each miniature's default guidance, chosen as a real model's default is: the best realism
    (lowest Frechet distance to real digits) at which at least MIN_ACCURACY of 50-step samples show
    the prompted digit, on training paraphrases and tuning noise (never the held-out contexts)."""
    started = commit()
    realism, classifier = realism_measure(), load_classifier()
    prompts, seeds = heldout_contexts(prompt_lists()[0], TUNING_CONTEXTS, TUNING_SEED)
    digits = torch.tensor([digit_of(prompt) for prompt in prompts])
    floor = realism.floor(TUNING_CONTEXTS)
    lines = [
        f"{TUNING_CONTEXTS} contexts (training paraphrases, tuning noise seeds), 50 default steps; "
        f"real against real ({min(TUNING_CONTEXTS, len(digit_splits()['preference'][0]))} unseen "
        "digits, all there are): Frechet {floor['frechet']:.3f}, precision "
        f"{floor['precision']:.3f}, recall {floor['recall']:.3f}. Chosen (bold): the lowest "
        f"Frechet distance with accuracy at least {MIN_ACCURACY}.",
        "",
        "| miniature | guidance | accuracy | Frechet distance | precision | recall |",
        "|---|---|---|---|---|---|",
    ]
    for family in FAMILIES:
        rows = {}
        for guidance in GUIDANCES:
            backbone = backbones.load_backbone(f"mini-{family}", guidance=guidance)
            default = default_schedule(backbone, 50)
            images = sample_images(backbone, default, prompts, seeds, batch_size=256)
            accuracy = (classifier(images).argmax(1) == digits).float().mean().item()
            rows[guidance] = dict(accuracy=accuracy, **realism(images))
            print(f"mini-{family} guidance {guidance}: {rows[guidance]}", flush=True)
        valid = [g for g in GUIDANCES if rows[g]["accuracy"] >= MIN_ACCURACY]
        chosen = min(valid, key=lambda g: rows[g]["frechet"]) if valid else None
        for guidance, row in rows.items():
            mark = "**" if guidance == chosen else ""
            lines.append(
                f"| mini-{family} | {mark}{guidance}{mark} | {row['accuracy']:.3f} | "
                f"{row['frechet']:.3f} | {row['precision']:.3f} | {row['recall']:.3f} |"
            )
    record("guidance", "python -m evidence.miniatures --guidance-sweep", lines, at=started)
    print("\n".join(lines))


# -----------------------------------------------------------------------------
# does the reward measure quality? Against realism, per default step count

AGREEMENT_STEPS = (1, 2, 3, 5, 10, 50)


@torch.no_grad()
def reward_agreement(contexts=256):
    """Per miniature at its default guidance, on the held-out contexts: the preference reward and
    the digit reward of the default schedule at AGREEMENT_STEPS, beside the realism measures; the
    rank correlation of each reward with minus the Frechet distance over the step counts; the real
    reference digits (which neither the scorer nor any miniature saw) as the top row."""
    from scipy.stats import spearmanr

    started = commit()
    realism, classifier, scorer = realism_measure(), load_classifier(), load_scorer()
    prompts, seeds = heldout_contexts(prompt_lists()[1], contexts)
    digits = torch.tensor([digit_of(prompt) for prompt in prompts])
    real, real_labels = digit_splits()["reference"]

    def rewards(images, labels):
        preference = scorer(images).gather(1, labels[:, None]).squeeze(1)
        log_probs = torch.log_softmax(classifier(images), 1)
        digit = log_probs.gather(1, labels[:, None]).squeeze(1)
        accuracy = (log_probs.argmax(1) == labels).float().mean().item()
        return preference, digit, accuracy

    def interval(values):
        return f"{values.mean():.3f} ± {1.96 * values.std() / len(values) ** 0.5:.3f}"

    floor = realism.floor(contexts)
    preference, digit, accuracy = rewards(real, real_labels)
    lines = [
        f"{contexts} held-out contexts (held-out paraphrases, held-out noise) per row, each "
        "miniature at its default guidance; mean ± 95% interval. Real digits: the reference set "
        f"({len(real)} digits no miniature and no reward model saw) for the rewards; their realism "
        f"row is {contexts} other unseen real digits against the reference (the floor at this N).",
        "",
        "| miniature | default steps | preference reward | digit log-prob | accuracy "
        "| Frechet distance | precision | recall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    real_row = (
        f"| real digits | - | {interval(preference)} | {interval(digit)} | {accuracy:.3f} | "
        f"{floor['frechet']:.3f} | {floor['precision']:.3f} | {floor['recall']:.3f} |"
    )
    summary = []
    for family in FAMILIES:
        backbone = backbones.load_backbone(f"mini-{family}")
        means, frechets = {"preference": [], "digit": []}, []
        lines.append(real_row)
        for steps in AGREEMENT_STEPS:
            default = default_schedule(backbone, steps)
            images = sample_images(backbone, default, prompts, seeds, batch_size=256)
            preference, digit, accuracy = rewards(images, digits)
            measured = realism(images)
            means["preference"].append(preference.mean().item())
            means["digit"].append(digit.mean().item())
            frechets.append(-measured["frechet"])
            lines.append(
                f"| mini-{family} | {steps} | {interval(preference)} | {interval(digit)} | "
                f"{accuracy:.3f} | {measured['frechet']:.3f} | {measured['precision']:.3f} | "
                f"{measured['recall']:.3f} |"
            )
        correlations = {name: spearmanr(values, frechets)[0] for name, values in means.items()}
        summary.append(
            f"- mini-{family}: rank correlation with minus the Frechet distance over "
            f"{list(AGREEMENT_STEPS)} steps: preference reward {correlations['preference']:.2f}, "
            f"digit log-prob {correlations['digit']:.2f}; guidance {backbone.guidance}"
        )
    lines += ["", *summary]
    record("agreement", "python -m evidence.miniatures --agreement", lines, at=started)
    print("\n".join(lines))


# -----------------------------------------------------------------------------
# what the shipped folders reach


def check(contexts=200):
    """What the shipped folders reach: the classifier's held-out accuracy; per miniature (the three
    and mini-flux-schnell), the share of contexts of unseen noise recognised at 50 default steps
    (training and held-out paraphrases) and at 4, 3 and 2 (held-out paraphrases); the preference
    reward of bfloat16 against float32 (the dtype a GPU run takes) on the held-out contexts at 3
    steps; the sizes."""
    started, lines = commit(), []
    classifier = load_classifier()
    (images, labels), _ = split()
    with torch.no_grad():
        accuracy = (classifier(images).argmax(1) == labels).float().mean().item()
    lines.append(
        f"- classifier: accuracy {accuracy:.4f} on the {len(images)} images the pipelines train on "
        "(it never saw them)"
    )
    training, heldout = prompt_lists()
    for family in FAMILIES + ("flux-schnell",):
        name, line, rewards = f"mini-{family}", [], {}
        for dtype in (torch.float32, torch.bfloat16):
            backbone = backbones.load_backbone(name, dtype=dtype)
            reward = load_reward("preference", backbone)  # its accuracy: the classifier's
            runs = [
                (50, "training"),
                (50, "held-out"),
                (4, "held-out"),
                (3, "held-out"),
                (2, "held-out"),
            ]
            for steps, paraphrases in runs if dtype == torch.float32 else [(3, "held-out")]:
                prompts, seeds = heldout_contexts(
                    heldout if paraphrases == "held-out" else training, contexts
                )
                noise = torch.cat(
                    [backbone.sample_noise(1, torch.Generator().manual_seed(s)) for s in seeds]
                )
                cond = backbone.encode_prompts(prompts)
                latents = backbone.sample(
                    noise, cond, default_schedule(backbone, steps)(noise, cond)
                )
                score, correct = reward.details(latents, prompts)
                rewards[dtype, steps] = score
                if dtype == torch.float32:
                    line.append(
                        f"{correct.mean().item():.3f} at {steps} steps ({paraphrases} paraphrases)"
                    )
        gap = (rewards[torch.bfloat16, 3] - rewards[torch.float32, 3]).abs()
        guidance = f"guidance {backbone.guidance}"
        guidance = "no guidance input" if backbone.guidance is None else guidance
        lines.append(
            f"- {name} ({guidance}): recognised {', '.join(line)}, {contexts} "
            "contexts of unseen noise each; "
            f"preference reward at 3 steps {rewards[torch.float32, 3].mean():.4f} in float32, "
            f"{rewards[torch.bfloat16, 3].mean():.4f} in bfloat16 "
            f"(per context |difference| median {gap.median():.4f}, max {gap.max():.4f}); "
            f"{folder_size(os.path.join(FOLDER, name)) / 1e6:.2f} MB"
        )
    lines.append(f"- miniatures/: {folder_size(FOLDER) / 1e6:.2f} MB in all")
    record("check", "python -m evidence.miniatures --check", lines, at=started)
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--guidance-sweep", action="store_true", help="the default guidances")
    parser.add_argument("--agreement", action="store_true", help="rewards against realism")
    parser.add_argument("--check", action="store_true", help="the shipped folders (the default)")
    args = parser.parse_args()
    with one_line_errors():
        if args.guidance_sweep:
            guidance_sweep()
        if args.agreement:
            reward_agreement()
        if args.check or not (args.guidance_sweep or args.agreement):
            check()
