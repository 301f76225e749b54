"""
Sample with a learned schedule and with the backbone's default schedule, from the same noise, next
to the teacher's solution; draw where the schedules put their steps.

Everything (policy, backbone, L) is rebuilt from the checkpoint alone.

CPU, the embedded digits backbone (after `python train.py`; one context per class by default):
    python sample.py
    python sample.py --ckpt out/ckpt.pt --prompt "a handwritten 3" --seeds 0 1 2 --stochastic
One GPU:
    python sample.py --ckpt out_sd35m/ckpt.pt --prompt "a red fox in fresh snow, photo" --seeds 0 1 2 3
    python sample.py --ckpt out_sd35m/policy --prompts prompts/heldout.jsonl --out-dir samples_sd35m
    python sample.py --ckpt out_sd35m/policy --prompt "a red fox" --pipeline   # through the stock diffusers pipeline
    python sample.py --ckpt out_global/policy --export schedule.json           # a global schedule for other tools

Writes under --out-dir (default: samples/ next to the checkpoint): one PNG per context and method
(NNN_<prompt>_seedS_default.png / _learned.png / _teacher.png; small images are upscaled with nearest
neighbours), grid.png (rows = contexts, columns = default | learned | teacher, each image titled with
its mean squared distance to the teacher), schedules.png (time per step index, one colour per context,
against the default) and schedules.json (the times used, per context). With --pipeline the images come
from the diffusers pipeline itself (pipeline.generate for the learned schedule, the pipeline's own call
for the default, from the same seeds): *_default.png and *_learned.png.
"""

import argparse
import json
import math
import os
import re
import sys

from prompts import noise_seed

# -----------------------------------------------------------------------------
# configuration
parser = argparse.ArgumentParser(
    description="Sample with a learned schedule next to the default one."
)
parser.error = lambda message: parser.exit(
    2, f"sample.py: error: {message}\n"
)  # one line, without the usage
# I/O
parser.add_argument(
    "--ckpt",
    default="out/ckpt.pt",
    help="checkpoint written by train.py, or its policy folder / a hub id",
)
parser.add_argument(
    "--out-dir", default=None, help="output folder; default: samples/ next to --ckpt"
)
# contexts
parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
parser.add_argument("--prompts", default=None, help="prompt file (.txt, .json, .jsonl)")
parser.add_argument(
    "--seeds",
    type=noise_seed,
    nargs="+",
    default=[0],
    help="noise seeds; every prompt is sampled with each",
)
# schedule
parser.add_argument(
    "--stochastic",
    action="store_true",
    help="draw one schedule from the Dirichlet instead of its mean",
)
parser.add_argument(
    "--draw-seed", type=int, default=0, help="seed of the Dirichlet draws with --stochastic"
)
parser.add_argument(
    "--pipeline",
    action="store_true",
    help="sample through the stock diffusers pipeline (pipeline.generate)",
)
parser.add_argument(
    "--export",
    default=None,
    metavar="JSON",
    help="write a global policy's schedule (times, sigmas) and exit",
)
# consistency checks against the checkpoint
parser.add_argument(
    "--backbone",
    default=None,
    help="expected backbone; an error if the checkpoint was trained on another",
)
parser.add_argument(
    "--steps",
    type=int,
    default=None,
    help="expected L; an error if the checkpoint was trained for another",
)
# system
parser.add_argument("--batch-size", type=int, default=8, help="contexts per backbone call")
parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")

if __name__ == "__main__":
    parser.parse_args()  # --help and bad flags answer here, before torch and the models load

import torch  # noqa: E402

import backbones  # noqa: E402
from checkpoints import load_checkpoint, trained_backbone  # noqa: E402
from evaluate import default_schedule, policy_schedule  # noqa: E402
from prompts import context_noise, load_prompt_file  # noqa: E402

# -----------------------------------------------------------------------------

MIN_SIDE = 128  # smaller images (digits: 8x8) are upscaled with nearest neighbours to at least this


def to_pil(image):
    """(3, H, W) float in [0, 1] -> PIL image, upscaled by an integer factor when tiny."""
    from PIL import Image

    array = (image.float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype("uint8")
    picture = Image.fromarray(array)
    scale = math.ceil(MIN_SIDE / min(picture.size))
    if scale > 1:
        picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
    return picture


def slug(prompt, length=40):
    return re.sub(r"[^a-zA-Z0-9]+", "-", prompt).strip("-")[:length].lower() or "prompt"


@torch.no_grad()
def sample_contexts(backbone, policy, prompts, seeds, stochastic=False, draw_seed=0, batch_size=8):
    """For contexts (prompts[i], seeds[i]), from the same noise: the default and the learned schedule's
    images, times and mean squared distance (in latent space) to the teacher, and the teacher's images.
    Returns dict method -> (images (N, 3, H, W) on CPU, times (N, L+1) or None, errors (N,))."""
    generator = torch.Generator().manual_seed(draw_seed)
    methods = {
        "default": default_schedule(backbone, policy.steps),
        "learned": policy_schedule(
            policy, backbone, mode="sample" if stochastic else "mean", generator=generator
        ),
    }
    results = {name: ([], [], []) for name in [*methods, "teacher"]}
    for start in range(0, len(prompts), batch_size):
        noise = context_noise(backbone, seeds[start : start + batch_size])
        cond = backbone.encode_prompts(prompts[start : start + batch_size])
        teacher = backbone.reference(noise, cond)
        for name, times_fn in [*methods.items(), ("teacher", None)]:
            times = None if times_fn is None else times_fn(noise, cond)
            latents = teacher if times is None else backbone.sample(noise, cond, times)
            results[name][0].append(backbone.decode(latents).float().cpu())
            results[name][1].append(None if times is None else times.float().cpu())
            results[name][2].append(
                (latents.float() - teacher.float()).square().flatten(1).mean(1).cpu()
            )
    return {
        name: (torch.cat(images), None if times[0] is None else torch.cat(times), torch.cat(errors))
        for name, (images, times, errors) in results.items()
    }


@torch.no_grad()
def pipeline_contexts(backbone, policy, prompts, seeds):
    """The diffusers pipeline's own images for contexts (prompts[i], seeds[i]): its default schedule,
    and the learned one through pipeline.generate, both from the noise of torch.Generator(seed)."""
    from pipeline import generate  # diffusers' schedulers load only on this path

    results = {"default": [], "learned": []}
    for prompt, seed in zip(prompts, seeds):
        options = dict(
            height=backbone.resolution,
            width=backbone.resolution,
            guidance_scale=backbone.guidance or 0.0,
        )
        results["default"] += backbone.pipe(
            prompt,
            num_inference_steps=policy.steps,
            generator=torch.Generator().manual_seed(seed),
            **options,
        ).images
        results["learned"] += generate(
            backbone.pipe, policy, prompt, generator=torch.Generator().manual_seed(seed), **options
        ).images
    return results


def draw_schedules(ax, learned_times, default_times, labels=None):
    """Time per step index on `ax`: one colour per context (learned_times (N, L+1)), the default in black."""
    import matplotlib

    steps = list(range(default_times.shape[0]))
    colors = matplotlib.colormaps["viridis"].resampled(max(len(learned_times), 2))
    if torch.equal(learned_times, learned_times[:1].expand_as(learned_times)):  # a global policy
        learned_times, labels = learned_times[:1], ["learned: one schedule for every context"]
    for index, times in enumerate(learned_times):
        ax.plot(
            steps,
            times,
            "-",
            marker=".",
            color=colors(index),
            label=None if labels is None else labels[index],
        )
    ax.plot(steps, default_times, "k--o", markersize=4, label="default")
    ax.set(xlabel="step index l", ylabel="time t_l (1 = noise, 0 = data)", xticks=steps)
    ax.legend(fontsize=6)


def plot_training(out_dir, backbone, policy, prompts, seeds, reward_name, shown=8):
    """train.png: at each checkpoint, the learned mean schedule's reward gain over the default on the
    same 32 held-out contexts (metrics.jsonl, heldout_gain), against the noisy batch reward of changing
    contexts; and the learned schedules of a few held-out contexts against the default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(out_dir, "metrics.jsonl")) as file:
        rows = [json.loads(line) for line in file]
    checkpoints = [row for row in rows if "heldout_gain" in row]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(
        [0] + [row["iteration"] for row in checkpoints],
        [0] + [row["heldout_gain"] for row in checkpoints],
        "-o",
        label="held out: learned - default, same 32 contexts",
    )
    left.axhline(0.0, color="black", linestyle="--", linewidth=0.8)
    left.set(
        xlabel="iteration",
        ylabel=f"{reward_name} gain over the default (> 0: better)",
        title="training progress",
    )
    left.legend(fontsize=8)
    noise, cond = context_noise(backbone, seeds[:shown]), backbone.encode_prompts(prompts[:shown])
    labels = [f"{prompt[:24]}, seed {seed}" for prompt, seed in zip(prompts, seeds)]
    draw_schedules(
        right,
        policy_schedule(policy, backbone)(noise, cond).cpu(),
        backbone.default_times(policy.steps).cpu(),
        labels,
    )
    right.set_title("learned mean schedules of held-out contexts")
    figure.tight_layout()
    figure.savefig(os.path.join(out_dir, "train.png"), dpi=120)
    plt.close(figure)


def save_figures(out_dir, contexts, results, label):
    """grid.png: rows = contexts, columns = methods, each image titled with its distance to the
    teacher; schedules.png: the learned schedule of every context against the default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    gains = [
        float(d - l) for d, l in zip(results["default"][2], results["learned"][2])
    ]  # > 0: learned better
    figure, axes = plt.subplots(
        len(contexts), len(names), figsize=(2.4 * len(names), 2.5 * len(contexts)), squeeze=False
    )
    for row, (prompt, seed) in enumerate(contexts):
        for col, name in enumerate(names):
            images, _, errors = results[name]
            axes[row][col].imshow(images[row].permute(1, 2, 0).numpy(), interpolation="nearest")
            title = f"{name}: {errors[row]:.4f}" if name != "teacher" else "teacher"
            if (
                name == "learned"
            ):  # this context's gain or loss: a mean gain comes with per-context losses
                title += f"\n{'better' if gains[row] > 0 else 'worse'} by {abs(gains[row]):.4f}"
            axes[row][col].set(xticks=[], yticks=[], title=title)
            axes[row][col].title.set_fontsize(7)
            if name == "learned":
                axes[row][col].title.set_color("tab:green" if gains[row] > 0 else "tab:red")
        axes[row][0].set_ylabel(f"{prompt[:28]}\nseed {seed}", fontsize=7)
    better, mean = sum(gain > 0 for gain in gains), sum(gains) / len(gains)
    figure.suptitle(
        f"each image's mean squared distance to the teacher (lower is better); the learned schedule "
        f"is better on {better} of these {len(gains)} contexts, worse on {len(gains) - better}, and "
        f"{'closer' if mean > 0 else 'farther'} by {abs(mean):.4f} on average: a mean gain does not "
        "mean a gain on every context",
        fontsize=7,
        wrap=True,
    )
    figure.tight_layout(
        rect=(0, 0, 1, 1 - 0.3 / (2.5 * len(contexts)))
    )  # room for the title above the first row
    figure.savefig(os.path.join(out_dir, "grid.png"), dpi=150)
    plt.close(figure)
    figure, ax = plt.subplots(figsize=(6, 4))
    draw_schedules(
        ax,
        results["learned"][1],
        results["default"][1][0],
        [f"{p[:24]}, seed {s}" for p, s in contexts],
    )
    ax.set_title(label, fontsize=9)
    figure.tight_layout()
    figure.savefig(os.path.join(out_dir, "schedules.png"), dpi=120)
    plt.close(figure)


def main(argv=None):
    args = parser.parse_args(argv)
    try:
        ckpt, policy = load_checkpoint(args.ckpt, args.backbone, args.steps)
        config = ckpt["config"]
        prompts = list(args.prompt) + (load_prompt_file(args.prompts) if args.prompts else [])
        shipped = backbones.BACKBONES[config["backbone"]].get(
            "prompts"
        )  # the miniatures' held-out paraphrases
        if not prompts and shipped:
            prompts = load_prompt_file(shipped[1])[:10]
        if not prompts and backbones.BACKBONES[config["backbone"]]["family"] != "mixture":
            raise ValueError(
                f"backbone {config['backbone']!r} needs --prompt TEXT or --prompts FILE"
            )
        torch.set_num_threads(
            backbones.BACKBONES[config["backbone"]]["threads"] or torch.get_num_threads()
        )
        backbone = trained_backbone(
            config, args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        backbone.check_prompts(prompts)
        contexts = [
            (prompt, seed) for prompt in (prompts or backbone.prompts) for seed in args.seeds
        ]
    except ValueError as error:
        sys.exit(f"sample.py: error: {error}")
    if args.export:
        from pipeline import schedule_json

        try:
            schedule = schedule_json(policy, backbone)
        except ValueError as error:
            sys.exit(f"sample.py: error: {error}")
        with open(args.export, "w") as handle:
            json.dump(schedule, handle, indent=1)
        return print(f"wrote the schedule of {args.ckpt} to {args.export}")
    out_dir = args.out_dir or os.path.join(os.path.dirname(os.path.abspath(args.ckpt)), "samples")
    os.makedirs(out_dir, exist_ok=True)
    label = "learned (one Dirichlet draw)" if args.stochastic else "learned (Dirichlet mean)"
    print(f"backbone {config['backbone']}, L={policy.steps}, {len(contexts)} contexts, {label}")
    if args.pipeline:
        if not hasattr(backbone, "pipe"):
            sys.exit(
                f"sample.py: error: --pipeline needs a diffusers backbone, not {config['backbone']!r}"
            )
        images = pipeline_contexts(
            backbone, policy.to(backbone.device), [p for p, _ in contexts], [s for _, s in contexts]
        )
        for index, (prompt, seed) in enumerate(contexts):
            for name, pictures in images.items():
                pictures[index].save(
                    os.path.join(out_dir, f"{index:03d}_{slug(prompt)}_seed{seed}_{name}.png")
                )
        return print(f"wrote {2 * len(contexts)} images from the diffusers pipeline to {out_dir}")

    results = sample_contexts(
        backbone,
        policy.to(backbone.device),
        [p for p, _ in contexts],
        [s for _, s in contexts],
        args.stochastic,
        args.draw_seed,
        args.batch_size,
    )
    for index, (prompt, seed) in enumerate(contexts):
        for name, (images, _, _) in results.items():
            to_pil(images[index]).save(
                os.path.join(out_dir, f"{index:03d}_{slug(prompt)}_seed{seed}_{name}.png")
            )
    save_figures(out_dir, contexts, results, label)
    default_times = results["default"][1][0]
    with open(os.path.join(out_dir, "schedules.json"), "w") as handle:
        json.dump(
            dict(
                default=default_times.tolist(),
                learned_mode="sample" if args.stochastic else "mean",
                contexts=[
                    dict(prompt=p, seed=s, learned=results["learned"][1][i].tolist())
                    for i, (p, s) in enumerate(contexts)
                ],
            ),
            handle,
            indent=1,
        )
    for index, (prompt, seed) in enumerate(contexts):
        times = ", ".join(f"{t:.3f}" for t in results["learned"][1][index].tolist())
        print(
            f"{prompt!r} seed {seed}: learned times [{times}], distance to the teacher {results['learned'][2][index]:.4f} "
            f"(default {results['default'][2][index]:.4f})"
        )
    print(f"default times [{', '.join(f'{t:.3f}' for t in default_times.tolist())}]")
    closer = int((results["learned"][2] < results["default"][2]).sum())
    print(
        f"the learned schedule is closer to the teacher on {closer} of {len(contexts)} contexts, farther on "
        f"{len(contexts) - closer}: a mean gain comes with per-context losses"
    )
    print(
        f"wrote {3 * len(contexts)} images to {out_dir}, the grid {os.path.join(out_dir, 'grid.png')}, "
        f"the schedules {os.path.join(out_dir, 'schedules.png')} and schedules.json"
    )


if __name__ == "__main__":
    main()
