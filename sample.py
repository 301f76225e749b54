"""
Sample with a learned schedule and with the backbone's default schedule, from the same noise, next
to the teacher's solution; draw where the schedules put their steps. Everything (policy, backbone,
L) is rebuilt from the checkpoint alone.

CPU, the embedded digits backbone (after `python train.py`; one context per class by default):
    python sample.py
    python sample.py --ckpt out/digits-L4-instance-s0/ckpt.pt --prompt "a handwritten 3" --seeds 0 1
CPU, a miniature (after `python train.py --backbone mini-sd3 --steps 3`):
    python sample.py --ckpt out/mini-sd3-L3-instance-s0/ckpt.pt
One GPU, after `python train.py --backbone sd35m --steps 10` (--pipeline: through the stock
diffusers pipeline; --export: a global schedule for other tools):
    RUN=out/sd35m-L10-instance-s0
    python sample.py --ckpt $RUN/ckpt.pt --prompt "a red fox in fresh snow, photo" --seeds 0 1
    python sample.py --ckpt $RUN/policy --prompts prompts/heldout.jsonl --out-dir samples_sd35m
    python sample.py --ckpt $RUN/policy --prompt "a red fox" --pipeline
    python sample.py --ckpt out/digits-L4-global-s0/policy --export schedule.json

Writes under --out-dir (default: samples/ next to the checkpoint) one image per context and method
(*_default.png, *_learned.png, *_teacher.png), grid.png (each image titled with its score by the
run's reward), schedules.png and schedules.json (the times used); with --pipeline, *_default.png
and *_learned.png from the diffusers pipeline itself (backbones.pipeline.generate).
"""

import argparse
import json
import math
import os
import re

import torch

import backbones
import evaluate
from prompts import load_prompt_file, noise_seed

# ---- configuration
parser = argparse.ArgumentParser(description="Sample with a learned schedule next to the default.")
add = parser.add_argument
# I/O
add("--ckpt", default=evaluate.MAIN_RUN, help=f"train.py's ckpt.pt, its policy/ folder or a hub id "
    f"(default: {evaluate.MAIN_RUN})")  # fmt: skip
add("--out-dir", help="output folder; default: samples/ next to --ckpt (a hub id: here)")
# contexts
add("--prompt", action="append", default=[], help="a prompt (repeatable)")
add("--prompts", help="prompt file (.txt, .json, .jsonl)")
add("--seeds", type=noise_seed, nargs="+", default=[0], help="noise seeds; each with every prompt")
# schedule
add("--stochastic", action="store_true", help="draw the schedule (Dirichlet / Beta), not its mean")
add("--draw-seed", type=noise_seed, default=0, help="seed of the Dirichlet draws with --stochastic")
add("--pipeline", action="store_true", help="through the stock diffusers pipeline (generate)")
add("--export", metavar="JSON", help="write a global policy's schedule (times, sigmas) and exit")
# system
add("--batch-size", type=int, default=8, help="contexts per backbone call")
add("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")

MIN_SIDE = 128  # smaller images (digits: 8x8) are upscaled with nearest neighbours to at least this
GRID_CONTEXTS = 16  # contexts drawn in grid.png (each context's images are written whole)


def to_pil(image):
    """(3, H, W) float in [0, 1] -> PIL image, upscaled by an integer factor when tiny."""
    from PIL import Image

    array = (image.float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype("uint8")
    picture = Image.fromarray(array)
    scale = math.ceil(MIN_SIDE / min(picture.size))
    return picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)


@torch.no_grad()
def sample_contexts(backbone, policy, prompts, seeds, draws=None, batch_size=8, reward=None):
    """Contexts (prompts[i], seeds[i]) sampled from the same noise by the default schedule, the
    learned one (its mean, or with `draws` a generator, one draw) and the teacher. Returns method
    -> (images (N, 3, H, W) on CPU, times (N, L+1) or None, latent mean squared distance to the
    teacher (N,), score by `reward` or, when None, minus that distance (N,))."""
    rows = dict(default=evaluate.default_schedule(backbone, policy.steps))
    rows["learned"] = evaluate.policy_schedule(policy, backbone, draws)
    # evaluate.score_table's columns: what is kept of each method's latents, on the CPU
    keep = dict(image=lambda latents, *_: backbone.decode(latents), latents=lambda *seen: seen[0])
    keep |= {} if reward is None else {"score": reward}
    table, used = evaluate.score_table(backbone, keep, prompts, seeds, rows, "teacher", batch_size)
    results = {}
    for name, row in table.items():  # default, learned, teacher
        error = (row["latents"] - table["teacher"]["latents"]).square().flatten(1).mean(1)
        results[name] = (row["image"], used.get(name), error, row.get("score", -error))
    return results


@torch.no_grad()
def pipeline_contexts(backbone, policy, prompts, seeds):
    """The diffusers pipeline's own images for contexts (prompts[i], seeds[i]) with its default
    schedule and the learned one (backbones.pipeline.generate), both from torch.Generator(seed)."""
    from backbones.pipeline import generate  # diffusers' schedulers load only on this path

    results = {"default": [], "learned": []}
    side, guidance, steps = backbone.resolution, backbone.guidance or 0.0, policy.steps
    options = dict(height=side, width=side, guidance_scale=guidance, num_inference_steps=steps)
    for prompt, seed in zip(prompts, seeds):  # a generator per call: both start from one noise
        noise = torch.Generator().manual_seed(seed)
        results["default"] += backbone.pipe(prompt, generator=noise, **options).images
        noise = torch.Generator().manual_seed(seed)
        learned = generate(backbone.pipe, policy, prompt, generator=noise, **options)
        results["learned"] += learned.images
    return results


def verdict(gains, measure):
    """The per-context wins and losses and the mean gain (learned - default), in words, without
    claiming a gain that is not there."""
    better, count, mean = sum(gain > 0 for gain in gains), len(gains), sum(gains) / len(gains)
    text = (
        f"by {measure}, the learned schedule is better on {better} of {count} contexts, worse on "
        f"{count - better}, {'better' if mean > 0 else 'worse'} by {abs(mean):.4f} on average"
    )
    return text + (": a mean gain comes with per-context losses" if 0 < better < count else "")


def save_figures(out_dir, contexts, results, label, measure):
    """grid.png: rows = contexts, columns = methods, each image titled with its score by `measure`
    (the run's reward); schedules.png: the learned schedule of every context against the default."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    gains = (results["learned"][3] - results["default"][3]).tolist()
    contexts = contexts[:GRID_CONTEXTS]  # a readable grid; every context's images are written
    figure = Figure(figsize=(2.4 * len(results), 2.5 * len(contexts)))
    axes = figure.subplots(len(contexts), len(results), squeeze=False)
    for row, (prompt, seed) in enumerate(contexts):
        for ax, (name, (images, _, _, scores)) in zip(axes[row], results.items()):
            ax.imshow(images[row].permute(1, 2, 0).numpy(), interpolation="nearest")
            title = "teacher" if name == "teacher" else f"{name}: {scores[row]:.4f}"
            if name == "learned":  # this context's gain or loss: a mean gain has per-context losses
                title += f"\n{'better' if gains[row] > 0 else 'worse'} by {abs(gains[row]):.4f}"
            ax.set(xticks=[], yticks=[], title=title)
            ax.title.set_fontsize(7)
        axes[row][0].set_ylabel(f"{prompt[:40]}\nseed {seed}", fontsize=7)
    title = f"each image's {measure} (higher is better); {verdict(gains, measure)}"
    figure.suptitle(title, fontsize=7, wrap=True)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (2.5 * len(contexts))))  # room for the title
    figure.savefig(os.path.join(out_dir, "grid.png"), dpi=150)
    ax = Figure(figsize=(6, 4)).subplots()  # time per step index, a colour per context
    learned, default = results["learned"][1][: len(contexts)], results["default"][1][0]
    steps, colors = range(len(default)), colormaps["viridis"].resampled(len(contexts))
    for index, ((prompt, seed), times) in enumerate(zip(contexts, learned)):
        ax.plot(steps, times, "-", marker=".", color=colors(index), label=f"{prompt[:30]}, {seed}")
    ax.plot(steps, default, "k--o", markersize=4, label="default")
    ax.set(xlabel="step index l", ylabel="time t_l (1 = noise, 0 = data)", title=label)
    ax.title.set_fontsize(9)
    ax.legend(fontsize=6)
    ax.figure.tight_layout()
    ax.figure.savefig(os.path.join(out_dir, "schedules.png"), dpi=120)


def write_images(out_dir, contexts, pictures):
    """One PNG per context and method (pictures: method -> PIL images)."""
    os.makedirs(out_dir, exist_ok=True)
    for index, (prompt, seed) in enumerate(contexts):
        slug = re.sub(r"[^a-zA-Z0-9]+", "-", prompt).strip("-")[:40].lower() or "prompt"
        for name, images in pictures.items():
            images[index].save(os.path.join(out_dir, f"{index:03d}_{slug}_seed{seed}_{name}.png"))


def main(argv=None):
    args = parser.parse_args(argv)
    # ---------------- the door ----------------
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1 (got {args.batch_size})")
    policy, config = evaluate.load_policy(args.ckpt)
    if args.export and policy.config["kind"] != "global":
        raise ValueError("--export is for a global policy (train.py --policy global) only")
    spec = backbones.BACKBONES[config["backbone"]]
    prompts = args.prompt + (load_prompt_file(args.prompts) if args.prompts else [])
    if not prompts and spec.get("prompts"):  # the miniatures' held-out paraphrases
        prompts = load_prompt_file(spec["prompts"][1])[:10]
    if not prompts and spec["family"] != "mixture" and not args.export:
        raise ValueError(f"backbone {config['backbone']} needs --prompt TEXT or --prompts FILE")
    if args.pipeline and (policy.pipeline_refusal or spec["family"] == "mixture"):
        raise ValueError(policy.pipeline_refusal or "--pipeline needs a diffusers backbone")
    out_dir = None if args.export else evaluate.out_folder(args, "samples")  # --export: no images

    # ---------------- backbone, contexts ----------------
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    torch.set_num_threads(config.get("threads") or torch.get_num_threads())  # the run's
    backbone = backbones.trained_backbone(config, device)
    if args.export:
        from backbones.pipeline import schedule_json

        exported = json.dumps(schedule_json(policy, backbone), indent=1)  # whole, then written
        with open(args.export, "w") as handle:
            handle.write(exported)
        return print(f"wrote the schedule of {args.ckpt} to {args.export}")
    backbone.check_prompts(prompts, config.get("reward"))
    contexts = [(prompt, seed) for prompt in prompts or backbone.prompts for seed in args.seeds]
    contexts = list(dict.fromkeys(contexts))  # a repeated context is sampled once
    label = policy.described[args.stochastic]
    print(f"backbone {config['backbone']}, L={policy.steps}, {len(contexts)} contexts, {label}")
    prompts, seeds = [prompt for prompt, _ in contexts], [seed for _, seed in contexts]
    policy = policy.to(backbone.device)
    if args.pipeline:
        write_images(out_dir, contexts, pipeline_contexts(backbone, policy, prompts, seeds))
        return print(f"wrote {2 * len(contexts)} images from the diffusers pipeline to {out_dir}")

    # ---------------- sample: default, learned and teacher from the same noise ----------------
    name = config.get("reward", "teacher")  # the run's, else minus the distance to the teacher
    local = {name: config.get("reward_checkpoint")}
    reward = evaluate.load_rewards({name} - {"teacher"}, backbone, device, local).get(name)
    measure = "minus the distance to the teacher" if reward is None else f"the {name} reward"
    draws = torch.Generator().manual_seed(args.draw_seed) if args.stochastic else None
    results = sample_contexts(backbone, policy, prompts, seeds, draws, args.batch_size, reward)
    learned, default = results["learned"], results["default"]
    scores = learned[3], default[3]
    pictures = {name: [to_pil(image) for image in images] for name, (images, *_) in results.items()}
    write_images(out_dir, contexts, pictures)
    save_figures(out_dir, contexts, results, label, measure)
    rows = [dict(prompt=p, seed=s, learned=t.tolist()) for (p, s), t in zip(contexts, learned[1])]
    mode = "sample" if args.stochastic else "mean"
    saved = dict(default=default[1][0].tolist(), learned_mode=mode, contexts=rows)
    with open(os.path.join(out_dir, "schedules.json"), "w") as handle:
        json.dump(saved, handle, indent=1)
    print(f"scores: {measure}; default times {[round(t, 3) for t in default[1][0].tolist()]}")
    for (prompt, seed), times, score, default_score in zip(contexts, learned[1], *scores):
        times = [round(t, 3) for t in times.tolist()]
        print(f"{prompt!r} seed {seed}: {score:.4f} (default {default_score:.4f}), times {times}")
    print(verdict((learned[3] - default[3]).tolist(), measure))
    written = f"{3 * len(contexts)} images, grid.png, schedules.png and schedules.json"
    print(f"wrote {written} to {out_dir}")


if __name__ == "__main__":
    with evaluate.one_line_errors():
        main()
