"""
Sample with a learned schedule and with the backbone's default schedule, from the same noise.

Everything (policy, backbone, L) is rebuilt from the checkpoint alone.

CPU, the embedded digits backbone (after `python train.py`; one context per class by default):
    python sample.py
    python sample.py --ckpt out/ckpt.pt --prompt "a handwritten 3" --seeds 0 1 2 --stochastic
One GPU:
    python sample.py --ckpt out_sd35m/ckpt.pt --prompt "a red fox in fresh snow, photo" --seeds 0 1 2 3
    python sample.py --ckpt out_sd35m/ckpt.pt --prompts prompts.txt --out-dir samples_sd35m

Writes under --out-dir (default: samples/ next to the checkpoint): one PNG per context and method
(NNN_<prompt>_seedS_default.png / _learned.png; small images are upscaled with nearest neighbours),
grid.png (rows = contexts, columns = default | learned), schedules.png (time per step index, learned
against default) and schedules.json (the times used, per context).
"""
import argparse
import json
import math
import os
import re
import sys

import torch

from evaluate import default_schedule, load_checkpoint, policy_schedule, trained_backbone
from prompts import context_noise, load_prompt_file

# -----------------------------------------------------------------------------
# configuration
parser = argparse.ArgumentParser(description="Sample with a learned schedule next to the default one.")
# I/O
parser.add_argument("--ckpt", default="out/ckpt.pt", help="checkpoint written by train.py")
parser.add_argument("--out-dir", default=None, help="output folder; default: samples/ next to --ckpt")
# contexts
parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
parser.add_argument("--prompts", default=None, help="prompt file (.txt, .json, .jsonl)")
parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="noise seeds; every prompt is sampled with each")
# schedule
parser.add_argument("--stochastic", action="store_true", help="draw one schedule from the Dirichlet instead of its mean")
parser.add_argument("--draw-seed", type=int, default=0, help="seed of the Dirichlet draws with --stochastic")
# consistency checks against the checkpoint
parser.add_argument("--backbone", default=None, help="expected backbone; an error if the checkpoint was trained on another")
parser.add_argument("--steps", type=int, default=None, help="expected L; an error if the checkpoint was trained for another")
# system
parser.add_argument("--batch-size", type=int, default=8, help="contexts per backbone call")
parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
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


def sample_contexts(backbone, policy, prompts, seeds, stochastic=False, draw_seed=0, batch_size=8):
    """Images and times of the default and the learned schedule for contexts (prompts[i], seeds[i]),
    both from the same noise. Returns dict method -> (images (N, 3, H, W) on CPU, times (N, L+1))."""
    generator = torch.Generator().manual_seed(draw_seed)
    methods = {"default": default_schedule(backbone, policy.steps),
               "learned": policy_schedule(policy, backbone, mode="sample" if stochastic else "mean", generator=generator)}
    results = {name: ([], []) for name in methods}
    for start in range(0, len(prompts), batch_size):
        noise = context_noise(backbone, seeds[start:start + batch_size])
        cond = backbone.encode_prompts(prompts[start:start + batch_size])
        for name, times_fn in methods.items():
            times = times_fn(noise, cond)
            results[name][0].append(backbone.decode(backbone.sample(noise, cond, times)).float().cpu())
            results[name][1].append(times.float().cpu())
    return {name: (torch.cat(images), torch.cat(times)) for name, (images, times) in results.items()}


def draw_schedules(ax, learned_times, default_times, label="learned"):
    """Time per step index on `ax`: one line per context (learned_times (N, L+1)), the default in black."""
    steps = range(default_times.shape[0])
    for index, times in enumerate(learned_times):
        ax.plot(steps, times, "-", marker=".", color="tab:blue", alpha=0.5, label=label if index == 0 else None)
    ax.plot(steps, default_times, "k--o", markersize=4, label="default")
    ax.set(xlabel="step index l", ylabel="time t_l (1 = noise, 0 = data)", xticks=list(steps))
    ax.legend(fontsize=8)


def plot_training(out_dir, backbone, policy, steps, prompts, seeds, reward_name):
    """train.png: the batch reward per iteration (metrics.jsonl) with its moving average over about 20
    iterations, and the learned schedules of held-out contexts against the default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(out_dir, "metrics.jsonl")) as file:
        rows = [json.loads(line) for line in file]
    iterations, batch_means = [row["iteration"] for row in rows], [row["reward"] for row in rows]
    smoothed = [batch_means[0]]
    for value in batch_means[1:]:
        smoothed.append(0.95 * smoothed[-1] + 0.05 * value)
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(iterations, batch_means, lw=0.5, alpha=0.4, label="batch mean")
    left.plot(iterations, smoothed, lw=1.5, label="moving average")
    left.set(xlabel="iteration", ylabel=f"mean reward ({reward_name})", title="training reward")
    left.legend()
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    draw_schedules(right, policy_schedule(policy, backbone)(noise, cond).cpu(), backbone.default_times(steps).cpu(), "learned (mean)")
    right.set_title("schedules (held-out contexts)")
    figure.tight_layout()
    figure.savefig(os.path.join(out_dir, "train.png"), dpi=120)
    plt.close(figure)


def save_grid(path, contexts, results):
    """Rows = contexts, columns = methods, each cell labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(len(contexts), len(names), figsize=(2.4 * len(names), 2.4 * len(contexts)), squeeze=False)
    for row, (prompt, seed) in enumerate(contexts):
        for col, name in enumerate(names):
            ax = axes[row][col]
            ax.imshow(results[name][0][row].permute(1, 2, 0).numpy(), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(name)
            if col == 0:
                ax.set_ylabel(f"{prompt[:28]}\nseed {seed}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def save_schedule_plot(path, learned_times, default_times, label):
    """Time per step index: one line per context for the learned schedule, the default in black."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    draw_schedules(ax, learned_times, default_times, label)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parser.parse_args(argv)
    try:
        ckpt, policy = load_checkpoint(args.ckpt, args.backbone, args.steps)
        config = ckpt["config"]
        prompts = list(args.prompt) + (load_prompt_file(args.prompts) if args.prompts else [])
        if not prompts and config["backbone"] != "digits":
            raise ValueError(f"backbone {config['backbone']!r} needs --prompt TEXT or --prompts FILE")
        backbone = trained_backbone(config, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        backbone.check_prompts(prompts)
        contexts = [(prompt, seed) for prompt in (prompts or backbone.prompts) for seed in args.seeds]
    except ValueError as error:
        sys.exit(f"sample.py: error: {error}")
    out_dir = args.out_dir or os.path.join(os.path.dirname(os.path.abspath(args.ckpt)), "samples")
    os.makedirs(out_dir, exist_ok=True)
    label = "learned (one Dirichlet draw)" if args.stochastic else "learned (Dirichlet mean)"
    print(f"backbone {config['backbone']}, L={policy.steps}, {len(contexts)} contexts, {label}")

    results = sample_contexts(backbone, policy.to(backbone.device), [p for p, _ in contexts], [s for _, s in contexts],
                              args.stochastic, args.draw_seed, args.batch_size)
    for index, (prompt, seed) in enumerate(contexts):
        for name, (images, _) in results.items():
            to_pil(images[index]).save(os.path.join(out_dir, f"{index:03d}_{slug(prompt)}_seed{seed}_{name}.png"))
    save_grid(os.path.join(out_dir, "grid.png"), contexts, results)
    default_times = results["default"][1][0]
    save_schedule_plot(os.path.join(out_dir, "schedules.png"), results["learned"][1], default_times, label)
    with open(os.path.join(out_dir, "schedules.json"), "w") as handle:
        json.dump(dict(default=default_times.tolist(), learned_mode="sample" if args.stochastic else "mean",
                       contexts=[dict(prompt=p, seed=s, learned=results["learned"][1][i].tolist())
                                 for i, (p, s) in enumerate(contexts)]), handle, indent=1)
    for index, (prompt, seed) in enumerate(contexts):
        times = ", ".join(f"{t:.3f}" for t in results["learned"][1][index].tolist())
        print(f"{prompt!r} seed {seed}: learned times [{times}]")
    print(f"default times [{', '.join(f'{t:.3f}' for t in default_times.tolist())}]")
    print(f"wrote {2 * len(contexts)} images to {out_dir}, the grid {os.path.join(out_dir, 'grid.png')}, "
          f"the schedules {os.path.join(out_dir, 'schedules.png')} and schedules.json")


if __name__ == "__main__":
    main()
