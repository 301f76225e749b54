"""
What mini-mix (miniatures/mix.py: digits, letters, colour blobs and photo crops on the SD3 family)
reaches, written into docs/RESULTS.md (section "mini-mix gates"):

    python -m evidence.mix --gates   # its guidance, chosen as the digit miniatures', its gates
                                     # and a figure of its samples (docs/mini-mix.png)

The guidance: for each of GUIDANCES, 50-step samples of TUNING contexts per kind (training
paraphrases, tuning noise; never the held-out contexts), read by mini-mix's classifier (trained on
images no pipeline saw): each kind's share recognised as its kind and as its class, and the realism
of all samples against the reference images (colour features, miniatures/realism.py). Chosen as the
digit miniatures' guidance is (evidence/miniatures.py): the most realistic guidance at which at
least MIN_ACCURACY of all samples show the prompted class; where none does, the most accurate.

The gates, fixed before mini-mix was built and measured on HELDOUT contexts per kind (held-out
paraphrases, held-out noise) at 50 steps and the chosen guidance: at least KIND_GATE of each kind's
samples recognised as the prompted kind and CLASS_GATE as the prompted class; realism per kind
(Frechet distance, precision and recall against that kind's reference images, beside the floor of
unseen real images of the kind at the same N) is reported, not gated.
"""

import argparse
import os

import torch
from PIL import Image

import backbones
from evaluate import default_schedule
from evidence.miniatures import MIN_ACCURACY
from evidence.results import REPOSITORY, commit, one_line_errors, record
from miniatures import mix
from miniatures.realism import Realism, sample_images
from prompts import HELDOUT_SEED, TUNING_SEED, heldout_contexts
from rewards.digits import load_classifier, reward_folder

GUIDANCES = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)
TUNING, HELDOUT = 128, 200  # contexts per kind
KIND_GATE, CLASS_GATE = 0.9, 0.8


def contexts(held_out, count, seed):
    """Per kind: `count` contexts, its prompts cycling (training or held-out paraphrases)."""
    prompts = mix.prompts(held_out)
    return {
        kind: heldout_contexts(
            [p for p in prompts if mix.KIND_OF[mix.class_of(p)] == k], count, seed
        )
        for k, kind in enumerate(mix.KINDS)
    }


def measured(backbone, classifier, realism, drawn):
    """Per kind (drawn: kind -> (prompts, seeds)): the share recognised as its kind and as its
    class, and its samples' realism; "all": every sample's realism against all the references.
    Returns them and the samples of each kind."""
    rows, images = {}, []
    for k, (kind, (prompts, seeds)) in enumerate(drawn.items()):
        sampled = sample_images(backbone, default_schedule(backbone, 50), prompts, seeds, 256)
        with torch.no_grad():
            guess = classifier(sampled).argmax(1)
        wanted = torch.tensor([mix.class_of(prompt) for prompt in prompts])
        shares = dict(kind=mix.KIND_OF[guess] == k, accuracy=guess == wanted)
        rows[kind] = {key: value.float().mean().item() for key, value in shares.items()}
        rows[kind].update(realism[kind](sampled))
        images.append(sampled)
    rows["all"] = realism["all"](torch.cat(images))
    return rows, images


def figure(images, path, columns=16):
    """A row of the first `columns` held-out samples of each kind, 4x enlarged: a PNG at path."""
    rows = [torch.cat(list(kind[:columns]), dim=2) for kind in images]  # (3, 16, 16 columns)
    grid = torch.cat(rows, dim=1).repeat_interleave(4, 1).repeat_interleave(4, 2)
    pixels = (grid.permute(1, 2, 0) * 255).round().byte().numpy()
    Image.fromarray(pixels).save(path)


def passes(row):
    """Whether a kind's row reaches both gates."""
    return row["kind"] >= KIND_GATE and row["accuracy"] >= CLASS_GATE


def gates():
    started = commit()
    classifier = load_classifier(reward_folder("mini-mix", "classifier"))
    splits = mix.mix_splits()
    (reference, labels), (unseen, unseen_labels) = splits["reference"], splits["preference"]
    realism = {"all": Realism(reference, unseen, colour=True)}
    for k, kind in enumerate(mix.KINDS):
        ours, theirs = mix.KIND_OF[labels] == k, mix.KIND_OF[unseen_labels] == k
        realism[kind] = Realism(reference[ours], unseen[theirs], colour=True)
    with torch.no_grad():
        accuracy = classifier(splits["pipelines"][0]).argmax(1) == splits["pipelines"][1]
    lines = [
        f"mini-mix's classifier: {accuracy.float().mean():.3f} of the {len(accuracy)} images the "
        f"pipeline trained on (it never saw them). The guidance: 50-step samples of {TUNING} "
        "contexts per kind (training paraphrases, tuning noise); chosen (bold) as the digit "
        "miniatures' guidance: the lowest Frechet distance of all samples at which at least "
        f"{MIN_ACCURACY} of them show the prompted class.",
        "",
        "| guidance | " + " | ".join(f"{kind}: kind, class" for kind in mix.KINDS)
        + " | Frechet (all) | precision | recall |",
        "|---|" + "---|" * (len(mix.KINDS) + 3),
    ]  # fmt: skip
    tuning, sweep = contexts(False, TUNING, TUNING_SEED), {}
    for guidance in GUIDANCES:
        backbone = backbones.load_backbone("mini-mix", guidance=guidance)
        sweep[guidance] = measured(backbone, classifier, realism, tuning)[0]
        print(f"guidance {guidance}: {sweep[guidance]}", flush=True)
    # every kind has TUNING samples: the share of all is the mean of the kinds'
    shares = {g: [sweep[g][kind]["accuracy"] for kind in mix.KINDS] for g in GUIDANCES}
    accuracy = {g: sum(share) / len(share) for g, share in shares.items()}
    valid = [g for g in GUIDANCES if accuracy[g] >= MIN_ACCURACY]
    chosen = min(valid, key=lambda g: sweep[g]["all"]["frechet"]) if valid else None
    chosen = chosen or max(accuracy, key=accuracy.get)
    for guidance, rows in sweep.items():
        mark = "**" if guidance == chosen else ""
        cells = [f"{rows[kind]['kind']:.3f}, {rows[kind]['accuracy']:.3f}" for kind in mix.KINDS]
        cells += [f"{rows['all'][key]:.3f}" for key in ("frechet", "precision", "recall")]
        lines.append(f"| {mark}{guidance}{mark} | " + " | ".join(cells) + " |")
    backbone = backbones.load_backbone("mini-mix", guidance=chosen)
    heldout, images = measured(backbone, classifier, realism, contexts(True, HELDOUT, HELDOUT_SEED))
    figure(images, os.path.join(REPOSITORY, "docs", "mini-mix.png"))
    lines += [
        "",
        f"The gates at guidance {chosen}, {HELDOUT} held-out contexts per kind (held-out "
        "paraphrases, held-out noise), 50 steps:",
        "",
        "| kind | recognised as its kind | as its class | Frechet | precision | recall | "
        "unseen real images: Frechet, precision, recall | gates |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in mix.KINDS:
        row, floor = heldout[kind], realism[kind].floor(HELDOUT)
        lines.append(
            f"| {kind} | {row['kind']:.3f} | {row['accuracy']:.3f} | {row['frechet']:.3f} | "
            f"{row['precision']:.3f} | {row['recall']:.3f} | {floor['frechet']:.3f}, "
            f"{floor['precision']:.3f}, {floor['recall']:.3f} | "
            f"{'pass' if passes(row) else 'FAIL'} |"
        )
    passed = all(passes(heldout[kind]) for kind in mix.KINDS)
    verdict = "every kind passes" if passed else "a kind fails"
    lines += ["", f"Gates: {verdict}."]
    record("mini-mix gates", "python -m evidence.mix --gates", lines, at=started)
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--gates", action="store_true", help="its guidance and its gates")
    args = parser.parse_args()
    with one_line_errors():
        if args.gates:
            gates()
