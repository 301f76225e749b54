"""
The figures of train.py (train.png), evaluate.py (results.png) and sample.py's schedule panel, drawn
on matplotlib Figures (no pyplot, no display); matplotlib is imported only when a figure is drawn.
"""

import json
import os

import torch

from prompts import context_noise
from scoring.paired import GAIN_CONTEXTS


def context_labels(prompts, seeds, length=40):
    """The legend entry of each context (prompt, noise seed); a long prompt keeps its start and its
    end (where the miniatures' prompts name the digit)."""
    cut = [
        text if len(text) <= length else f"{text[: length // 2 - 2]}...{text[-(length // 2 - 1) :]}"
        for text in prompts
    ]
    return [f"{prompt}, seed {seed}" for prompt, seed in zip(cut, seeds)]


def step_ticks(ax, steps):
    """One x tick per step index up to 20 steps; integer ticks chosen by matplotlib beyond."""
    from matplotlib.ticker import MaxNLocator

    if len(steps) <= 21:
        ax.set_xticks(list(steps))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def draw_schedules(ax, learned_times, default_times, labels=None):
    """Time per step index: a colour per context (learned_times (N, L+1)), the default in black."""
    import matplotlib

    steps = list(range(default_times.shape[0]))
    colors = matplotlib.colormaps["viridis"].resampled(max(len(learned_times), 2))
    if torch.equal(learned_times, learned_times[:1].expand_as(learned_times)):  # a global policy
        learned_times, labels = learned_times[:1], ["learned: one schedule for every context"]
    for index, times in enumerate(learned_times):
        label = None if labels is None else labels[index]
        ax.plot(steps, times, "-", marker=".", color=colors(index), label=label)
    ax.plot(steps, default_times, "k--o", markersize=4, label="default")
    ax.set(xlabel="step index l", ylabel="time t_l (1 = noise, 0 = data)")
    step_ticks(ax, steps)
    ax.legend(fontsize=6)


def plot_training(out_dir, backbone, policy, heldout, reward_name):
    """train.png: at each checkpoint, the learned mean schedule's reward gain over the default on
    the same held-out contexts (metrics.jsonl, scoring.paired.heldout_gain); and the learned
    schedules of a few held-out contexts (prompts, seeds) against the default."""
    from matplotlib.figure import Figure

    prompts, seeds = (part[:8] for part in heldout)  # a few held-out contexts
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    with torch.no_grad():
        learned_times = policy.schedule(backbone, noise, cond)[0].cpu()
    default_times = backbone.default_times(policy.steps).cpu()
    labels = context_labels(prompts, seeds)
    contexts = min(GAIN_CONTEXTS, len(heldout[0]))
    with open(os.path.join(out_dir, "metrics.jsonl")) as file:
        checkpoints = [row for row in map(json.loads, file) if "heldout_gain" in row]
    figure = Figure(figsize=(11, 4), layout="tight")
    left, right = figure.subplots(1, 2)
    label = f"held out: learned - default, the same {contexts} contexts at every checkpoint"
    iterations = [row["iteration"] for row in checkpoints]
    left.plot(iterations, [row["heldout_gain"] for row in checkpoints], "-o", label=label)
    left.axhline(0.0, color="black", linestyle="--", linewidth=0.8)
    ylabel = f"{reward_name} gain over the default (> 0: better)"
    left.set(xlabel="iteration", ylabel=ylabel, title="training progress")
    left.legend(fontsize=8)
    draw_schedules(right, learned_times, default_times, labels)
    right.set_title("learned mean schedules of held-out contexts")
    figure.savefig(os.path.join(out_dir, "train.png"), dpi=120)


def plot_results(path, scores_per_reward, learned_times, default_times):
    """One panel per reward: histograms of the paired differences to the default schedule on the
    same contexts; last panel: how far the learned schedules move each step from the default's
    (mean, 10-90% and min-max bands over contexts)."""
    from matplotlib.figure import Figure

    panels = len(scores_per_reward) + 1
    figure = Figure(figsize=(5.5 * panels, 4))
    axes = figure.subplots(1, panels)
    for ax, (reward_name, scores) in zip(axes, scores_per_reward.items()):
        others = [name for name in scores if name != "default"]
        differences = {name: scores[name] - scores["default"] for name in others}
        everything = torch.cat([torch.zeros(1), *differences.values()])
        low, high, edges = everything.min().item(), everything.max().item(), 31
        if high - low < 1e-9:  # the same score on every context (accuracy 1 for both): one bar
            low, high, edges = low - 0.5, high + 0.5, 32  # centred on the value
        bins = torch.linspace(low, high, edges).tolist()
        for name, values in differences.items():
            label = f"{name} (mean {values.mean():+.4g})"
            ax.hist(values.tolist(), bins=bins, histtype="step", linewidth=1.5, label=label)
        ax.axvline(0.0, color="black", linestyle="--")
        ax.set(xlabel=f"{reward_name}: method - default, same context (> 0: better)")
        ax.set(ylabel="contexts")
        ax.ticklabel_format(axis="x", useOffset=False)
        ax.legend(fontsize=8)
    # the times differ from the default's by far less than their range 0..1: drawn as learned -
    # default, the spread over contexts (10-90% and min-max bands) is visible
    steps, last = torch.arange(default_times.numel()), axes[-1]
    last.axhline(0.0, color="black", linestyle="--", linewidth=0.8, label="default")
    for name, times in learned_times.items():
        shift = times - default_times
        low, high = torch.quantile(shift, torch.tensor([0.1, 0.9]), dim=0)
        mean_label = f"{name}: mean over contexts"
        (line,) = last.plot(steps, shift.mean(0), "-o", markersize=4, label=mean_label)
        color, lowest, highest = line.get_color(), shift.min(0).values, shift.max(0).values
        last.fill_between(steps, low, high, color=color, alpha=0.3, label=f"{name}: 10-90%")
        last.fill_between(steps, lowest, highest, color=color, alpha=0.1, label=f"{name}: min-max")
    last.set(xlabel="step index l", ylabel="t_l learned - t_l default (> 0: noisier)")
    last.set(title="where the learned schedules move each step")
    step_ticks(last, steps.tolist())
    last.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
