"""
Paired evaluation of learned sampling schedules on held-out contexts.

Every method (the default schedule, the learned instance-level schedule at its Dirichlet mean,
optionally a learned global schedule, the teacher and, for Flux-Dev, the distilled Flux-Schnell)
samples from the *same* initial noise for each context (prompt + seed), so differences are paired.
A method is a callable (noise, cond) -> times (N, L+1).

CPU, the embedded digits backbone (after `python train.py`):
    python evaluate.py --ckpt out/ckpt.pt [--global-ckpt out_global/ckpt.pt]
One GPU, HPSv2 and CLIP on the 3,200 HPDv2 test prompts (`hf download zhwang/HPDv2 --repo-type dataset
--include "benchmark/*.json" --local-dir data/HPDv2` once):
    python evaluate.py --ckpt out_sd35m/ckpt.pt --hpdv2 data/HPDv2/benchmark --rewards hpsv2 clip
    python evaluate.py --ckpt out_flux/ckpt.pt --hpdv2 data/HPDv2/benchmark --schnell --limit 400

Writes under --out-dir (default: eval/ next to the checkpoint): results.md (mean and 95% CI per
method, paired difference to default with its CI, per style for HPDv2), scores.json (every score,
per method, reward and context) and results.png. A rerun loads scores.json and scores only what is
missing, so an interrupted run resumes and --limit can be raised later.
"""

import argparse
import math
import os
import sys

from prompts import HELDOUT_SEED, noise_seed

parser = argparse.ArgumentParser(description="Paired evaluation of learned sampling schedules.")
parser.error = lambda message: parser.exit(
    2, f"evaluate.py: error: {message}\n"
)  # one line, without the usage
# I/O
parser.add_argument(
    "--ckpt", default="out/ckpt.pt", help="instance-level checkpoint written by train.py"
)
parser.add_argument(
    "--global-ckpt",
    default=None,
    help="optional checkpoint of a global schedule (same backbone and L)",
)
parser.add_argument("--out-dir", default=None, help="output folder; default: eval/ next to --ckpt")
# contexts
parser.add_argument("--prompts", default=None, help="prompt file (.txt, .json, .jsonl)")
parser.add_argument(
    "--hpdv2",
    nargs="?",
    const="hub",
    default=None,
    help="the HPDv2 test prompts: from a folder holding anime/concept-art/paintings/photo.json, or the hub",
)
parser.add_argument(
    "--count",
    type=int,
    default=None,
    help="contexts of train.py's held-out prompts (default: train.py's own count)",
)
parser.add_argument(
    "--seed",
    type=noise_seed,
    default=HELDOUT_SEED,
    help="noise seed of the first context; context i uses seed + i",
)
parser.add_argument(
    "--limit",
    type=int,
    default=None,
    help="evaluate only the first N contexts (HPDv2: styles interleaved)",
)
# methods and rewards
parser.add_argument(
    "--rewards",
    nargs="+",
    default=None,
    metavar="NAME",
    help="rewards to report (names in rewards.REWARDS); default: the training reward, and clip beside hpsv2",
)
parser.add_argument(
    "--reward-checkpoint",
    action="append",
    default=[],
    metavar="NAME=PATH",
    help="local weights of a reward (repeatable); default: the training reward's, else the hub cache",
)
parser.add_argument(
    "--reference", action="store_true", help="also score the teacher solution (backbone.reference)"
)
parser.add_argument(
    "--schnell",
    action="store_true",
    help="flux-dev only: add Flux-Schnell at 4 steps and at L from the same noise",
)
parser.add_argument(
    "--schnell-path", default=None, help="local Flux-Schnell folder; default: the hub cache"
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
parser.add_argument(
    "--batch-size",
    type=int,
    default=None,
    help="contexts per batch; default 200 for digits, 8 otherwise",
)
parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")

if __name__ == "__main__":
    parser.parse_args()  # --help and bad flags answer here, before torch and the models load

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import backbones  # noqa: E402
import rewards as reward_lib  # noqa: E402
from checkpoints import (
    check_writable,
    load_checkpoint,
    score_store,
    trained_backbone,
    write_json_atomic,
)  # noqa: E402
from policy import mean_increments, sample_increments, times_from_increments  # noqa: E402
from prompts import context_noise, heldout_contexts, load_hpdv2, load_prompt_file, prompt_groups  # noqa: E402

# -----------------------------------------------------------------------------
# methods: callables (noise, cond) -> times (N, L+1)


def policy_schedule(policy, backbone, mode="mean", generator=None):
    """A trained policy's schedule: the Dirichlet mean ("mean", deterministic) or one draw ("sample")."""

    @torch.no_grad()
    def times_fn(noise, cond):
        alpha = policy(**backbone.policy_inputs(noise, cond))  # (N, L+1)
        increments = (
            mean_increments(alpha)
            if mode == "mean"
            else sample_increments(alpha, 1, generator)[:, 0]
        )
        return times_from_increments(increments)

    return times_fn


def fixed_schedule(times):
    """The same schedule times (L+1,) for every context."""
    return lambda noise, cond: times.to(noise.device).expand(noise.shape[0], -1)


def default_schedule(backbone, steps):
    return fixed_schedule(backbone.default_times(steps))


# -----------------------------------------------------------------------------
# scores


@torch.no_grad()
def score_batches(
    backbone,
    rewards,
    prompts,
    seeds,
    methods,
    reference=None,
    batch_size=64,
    pending=None,
    progress=False,
):
    """Score contexts (prompts[i], seeds[i]) with every method and reward, batch by batch, on identical noise.

    rewards: name -> reward; methods: name -> callable (noise, cond) -> times; reference: the name of
    a row that scores backbone.reference (the teacher), or None. pending(row, index) -> bool says which
    contexts a row still needs (default: all); a batch with nothing pending is skipped before any
    encoding. Yields per batch: scores[row][reward] = {index: float}, times[row] = {index: [L+1 floats]}.
    """
    samplers = {**methods, **({reference: None} if reference else {})}  # None: the teacher
    pending = pending or (lambda row, index: True)
    for start in tqdm(
        range(0, len(prompts), batch_size), disable=not progress, desc=f"{len(prompts)} contexts"
    ):
        stop = min(start + batch_size, len(prompts))
        todo = {name: [i for i in range(start, stop) if pending(name, i)] for name in samplers}
        if not any(todo.values()):
            continue
        noise, cond = (
            context_noise(backbone, seeds[start:stop]),
            backbone.encode_prompts(prompts[start:stop]),
        )
        scores, times = {}, {}
        for name, schedule in samplers.items():
            if not todo[name]:
                continue
            pick = torch.tensor([i - start for i in todo[name]])
            sub_noise, sub_cond = (
                noise[pick.to(noise.device)],
                {key: value[pick.to(value.device)] for key, value in cond.items()},
            )
            if schedule is None:
                latents = backbone.reference(sub_noise, sub_cond)
            else:
                used = schedule(sub_noise, sub_cond)
                latents = backbone.sample(sub_noise, sub_cond, used)
                times[name] = dict(zip(todo[name], used.float().cpu().tolist()))
            sub_prompts, scores[name] = [prompts[i] for i in todo[name]], {}
            for (
                reward_name,
                reward,
            ) in rewards.items():  # the reward, and for OCR and GenEval a second column
                for column, values in reward_lib.metrics(
                    reward, reward_name, latents, sub_prompts, sub_noise, sub_cond
                ).items():
                    scores[name][column] = dict(zip(todo[name], values.tolist()))
        yield scores, times


def score_table(
    backbone, rewards, prompts, seeds, methods, reference=None, batch_size=64, progress=False
):
    """Per-sample scores of each row and column (each reward's metrics) on the contexts (prompts[i],
    seeds[i]): row -> column -> Tensor (N,) in context order, independent of batch_size."""
    collected = {}
    for scores, _ in score_batches(
        backbone, rewards, prompts, seeds, methods, reference, batch_size, progress=progress
    ):
        for name, columns in scores.items():
            for column, values in columns.items():
                collected.setdefault(name, {}).setdefault(column, {}).update(values)
    return {
        name: {
            column: torch.tensor([values[i] for i in range(len(prompts))])
            for column, values in columns.items()
        }
        for name, columns in collected.items()
    }


def evaluate(
    backbone, reward, prompts, seeds, methods, reference=None, batch_size=64, progress=False
):
    """score_table for one reward: name -> Tensor (N,)."""
    table = score_table(
        backbone, {"reward": reward}, prompts, seeds, methods, reference, batch_size, progress
    )
    return {name: columns["reward"] for name, columns in table.items()}


def _mean_ci(values):
    """(mean, 95% Student-t half-width) of a 1-D tensor; the half-width is nan for n < 2."""
    from scipy.stats import t as student_t  # scipy comes with scikit-learn

    values = values.double()
    if values.numel() < 2:
        return values.mean().item(), math.nan
    sem = (values.std() / math.sqrt(values.numel())).item()
    return values.mean().item(), float(student_t.ppf(0.975, values.numel() - 1)) * sem


def summarize(scores, baseline="default"):
    """One row per method: n, mean, ci95 (half-width of the 95% interval) and the paired difference to
    the baseline method on the same contexts (diff_mean, diff_ci95; None for the baseline itself)."""
    rows = []
    for name, values in scores.items():
        row = dict(method=name, n=values.numel(), diff_mean=None, diff_ci95=None)
        row["mean"], row["ci95"] = _mean_ci(values)
        if baseline in scores and name != baseline:
            if scores[baseline].shape != values.shape:
                raise ValueError(
                    f"paired difference needs the same contexts: {name} has {values.numel()}, "
                    f"{baseline} has {scores[baseline].numel()}"
                )
            row["diff_mean"], row["diff_ci95"] = _mean_ci(values - scores[baseline])
        rows.append(row)
    return rows


def format_table(rows, baseline="default"):
    """Markdown table of summarize()'s rows: mean ± 95% CI and paired difference ± 95% CI."""
    number = lambda value: "-" if value is None or math.isnan(value) else f"{value:.4g}"
    lines = [f"| method | n | mean ± 95% CI | diff to {baseline} ± 95% CI |", "|---|---|---|---|"]
    for row in rows:
        diff = (
            "-"
            if row["diff_mean"] is None
            else f"{row['diff_mean']:+.4g} ± {number(row['diff_ci95'])}"
        )
        lines.append(
            f"| {row['method']} | {row['n']} | {number(row['mean'])} ± {number(row['ci95'])} | {diff} |"
        )
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# figures


def plot_results(path, scores_per_reward, learned_times, default_times, baseline="default"):
    """One panel per reward: histograms of the paired differences to the baseline method on the same
    contexts; last panel: how far the learned schedules move each step from the default's (mean,
    10-90% and min-max bands over contexts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        1, len(scores_per_reward) + 1, figsize=(5.5 * (len(scores_per_reward) + 1), 4)
    )
    for ax, (reward_name, scores) in zip(axes, scores_per_reward.items()):
        differences = {
            name: values - scores[baseline] for name, values in scores.items() if name != baseline
        }
        everything = torch.cat([torch.zeros(1), *differences.values()])
        bins = torch.linspace(everything.min().item(), everything.max().item() + 1e-9, 31).tolist()
        for name, values in differences.items():
            ax.hist(
                values.tolist(),
                bins=bins,
                histtype="step",
                linewidth=1.5,
                label=f"{name} (mean {values.mean():+.4g})",
            )
        ax.axvline(0.0, color="black", linestyle="--")
        ax.set(
            xlabel=f"{reward_name}: method - {baseline}, same context (> 0: better)",
            ylabel="contexts",
        )
        ax.legend(fontsize=8)
    # the times themselves differ from the default's by far less than their range of 0..1: drawn as
    # learned - default, the spread over contexts (10-90% and min-max bands) is visible
    steps = torch.arange(default_times.numel())
    axes[-1].axhline(0.0, color="black", linestyle="--", linewidth=0.8, label="default")
    for name, times in learned_times.items():
        shift = times - default_times
        low, high = torch.quantile(shift, torch.tensor([0.1, 0.9]), dim=0)
        (line,) = axes[-1].plot(
            steps, shift.mean(0), "-o", markersize=4, label=f"{name}: mean over contexts"
        )
        axes[-1].fill_between(
            steps, low, high, color=line.get_color(), alpha=0.3, label=f"{name}: 10-90%"
        )
        axes[-1].fill_between(
            steps,
            shift.min(0).values,
            shift.max(0).values,
            color=line.get_color(),
            alpha=0.1,
            label=f"{name}: min-max",
        )
    axes[-1].set(
        xlabel="step index l",
        ylabel="t_l learned - t_l default (> 0: noisier)",
        xticks=steps.tolist(),
        title="where the learned schedules move each step",
    )
    axes[-1].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -----------------------------------------------------------------------------
# command line: checkpoints, prompt sets, resumable scores, report


def main(argv=None):
    args = parser.parse_args(argv)
    unknown = [name for name in args.rewards or [] if name not in reward_lib.REWARDS]
    if unknown:  # checked here, not by choices=, so that --help needs no torch
        choices = ", ".join(map(repr, reward_lib.REWARDS))
        parser.error(f"argument --rewards: invalid choice: {unknown[0]!r} (choose from {choices})")
    try:  # cheap checks before anything heavy
        checkpoint, learned = load_checkpoint(args.ckpt, args.backbone, args.steps)
        config, steps = checkpoint["config"], checkpoint["config"]["steps"]
        policies = {"learned": (args.ckpt, checkpoint, learned)}
        if args.global_ckpt:
            policies["global"] = (
                args.global_ckpt,
                *load_checkpoint(args.global_ckpt, config["backbone"], steps),
            )
        reward_names = args.rewards or [config["reward"]] + (
            ["clip"] if config["reward"] == "hpsv2" else []
        )
        malformed = [
            item for item in args.reward_checkpoint if "=" not in item or not item.split("=", 1)[0]
        ]
        if malformed:
            raise ValueError(
                f"--reward-checkpoint takes NAME=PATH (e.g. hpsv2=/path/HPS_v2.1_compressed.pt), got {malformed[0]!r}"
            )
        local = {
            config["reward"]: config["reward_checkpoint"],
            **dict(item.split("=", 1) for item in args.reward_checkpoint),
        }
        if args.schnell and config["backbone"] != "flux-dev":
            raise ValueError(
                f"--schnell is the reference for flux-dev, not for {config['backbone']!r}"
            )
        for flag, value in (
            ("--count", args.count),
            ("--limit", args.limit),
            ("--batch-size", args.batch_size),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1 (got {value})")
        out_dir = args.out_dir or os.path.join(os.path.dirname(os.path.abspath(args.ckpt)), "eval")
        check_writable(out_dir)
        styles, own = (
            None,
            not (args.hpdv2 or args.prompts),
        )  # own: train.py's held-out prompts, --count contexts of them
        if args.hpdv2:
            prompt_list, styles = load_hpdv2(None if args.hpdv2 == "hub" else args.hpdv2)
        elif args.prompts or config["eval_prompts"]:  # a .jsonl's "style" or "tag" groups the table
            prompt_list, styles = (
                load_prompt_file(args.prompts or config["eval_prompts"]),
                prompt_groups(args.prompts or config["eval_prompts"]),
            )
        else:
            prompt_list = None
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        threads = backbones.BACKBONES[config["backbone"]]["threads"]
        torch.set_num_threads(threads or torch.get_num_threads())
        backbone = trained_backbone(config, device)
        backbone.check_prompts(prompt_list or [])
    except ValueError as error:
        sys.exit(f"evaluate.py: error: {error}")
    prompts, seeds = heldout_contexts(
        prompt_list or backbone.prompts,
        args.count or (config["eval_contexts"] if own else None),
        args.seed,
    )
    prompts, seeds, styles = (
        prompts[: args.limit],
        seeds[: args.limit],
        (styles or [None] * len(prompts))[: args.limit],
    )

    rewards = {}
    for name in reward_names:
        try:
            rewards[name] = reward_lib.load_reward(
                name, backbone, device=device, checkpoint=local.get(name)
            )
        except (ImportError, ValueError, OSError) as error:
            print(f"skipping reward {name!r}: {error}")
    if not rewards:
        sys.exit(f"evaluate.py: error: none of the rewards {reward_names} could be loaded")

    # every row with what identifies it: stored scores of another checkpoint iteration would be stale
    methods = {"default": default_schedule(backbone, steps)}
    identity = {"default": dict(backbone=config["backbone"], steps=steps)}
    for name, (path, method_checkpoint, method_policy) in policies.items():
        methods[name] = policy_schedule(method_policy.to(backbone.device), backbone)
        identity[name] = dict(
            checkpoint=os.path.abspath(path), iteration=method_checkpoint["iteration"], steps=steps
        )
    runs = [(backbone, methods, "reference" if args.reference else None)]
    if args.reference:
        identity["reference"] = dict(backbone=config["backbone"])
    if args.schnell:  # the same seeds give Flux-Schnell the same noise: its rows are paired too
        try:
            schnell = backbones.load_backbone(
                "flux-schnell",
                path=args.schnell_path,
                device=device,
                dtype=backbone.dtype,
                resolution=config["resolution"],
            )
            runs.append(
                (
                    schnell,
                    {f"schnell-{n}": default_schedule(schnell, n) for n in sorted({4, steps})},
                    None,
                )
            )
            identity.update(
                {f"schnell-{n}": dict(backbone="flux-schnell", steps=n) for n in sorted({4, steps})}
            )
        except ValueError as error:
            print(f"skipping Flux-Schnell (not available: {error})")
    print(
        f"backbone {config['backbone']}, L={steps}, {len(prompts)} contexts, rows {list(identity)}, "
        f"rewards {list(rewards)}, output {out_dir}"
    )

    os.makedirs(out_dir, exist_ok=True)
    store_path = os.path.join(out_dir, "scores.json")
    try:
        store = score_store(store_path, identity)
    except ValueError as error:
        sys.exit(f"evaluate.py: error: {error}")
    keys = [f"{seed}|{prompt}" for prompt, seed in zip(prompts, seeds)]
    store["contexts"].update(
        {key: dict(prompt=p, seed=s, style=y) for key, p, s, y in zip(keys, prompts, seeds, styles)}
    )

    def pending(row, index):
        return any(
            keys[index] not in store["scores"].get(row, {}).get(reward_name, {})
            for reward_name in rewards
        )

    batch_size = args.batch_size or (200 if backbone.prompts else 8)
    for run_backbone, run_methods, reference in runs:
        for scores, times in score_batches(
            run_backbone, rewards, prompts, seeds, run_methods, reference, batch_size, pending, True
        ):
            for name, per_reward in scores.items():
                for reward_name, values in per_reward.items():
                    store["scores"].setdefault(name, {}).setdefault(reward_name, {}).update(
                        {keys[i]: v for i, v in values.items()}
                    )
                store["times"].setdefault(name, {}).update(
                    {keys[i]: t for i, t in times.get(name, {}).items()}
                )
            write_json_atomic(store_path, store)

    lines = [
        f"# Evaluation of {os.path.abspath(args.ckpt)}\n\nbackbone {config['backbone']}, L = {steps} steps, {len(prompts)} "
        "contexts (prompt + noise seed), every method on the same noise. Mean ± half-width of the 95% Student-t interval; "
        "diff = paired difference to the default schedule on the same contexts. Higher is better.",
        "",
    ]
    columns = [
        column
        for reward_name in rewards
        for column in reward_lib.COLUMNS.get(reward_name, (reward_name,))
    ]
    tables = {
        column: {
            row: torch.tensor([store["scores"][row][column][key] for key in keys])
            for row in identity
        }
        for column in columns
    }
    groups = sorted(set(styles) - {None})
    for column, scores in tables.items():
        for group in [None] + groups:
            mask = torch.tensor([group is None or s == group for s in styles])
            lines += [
                f"## {column}" + (f", {group}" if group else ""),
                "",
                format_table(summarize({row: values[mask] for row, values in scores.items()})),
                "",
            ]
        if groups:  # GenEval's overall score is this mean over its tasks
            lines += [
                f"mean over the {len(groups)} groups: "
                + ", ".join(
                    f"{row} {sum(values[torch.tensor([s == g for s in styles])].mean() for g in groups) / len(groups):.4g}"
                    for row, values in scores.items()
                ),
                "",
            ]
        print(f"\n{column}\n{format_table(summarize(scores))}")
    with open(os.path.join(out_dir, "results.md"), "w") as handle:
        handle.write("\n".join(lines))
    learned_times = {
        name: torch.tensor([store["times"][name][key] for key in keys]) for name in policies
    }
    plot_results(
        os.path.join(out_dir, "results.png"),
        tables,
        learned_times,
        backbone.default_times(steps).cpu(),
    )
    print(f"\nwrote {os.path.join(out_dir, 'results.md')}, scores.json and results.png")


if __name__ == "__main__":
    main()
