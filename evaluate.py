"""
Paired evaluation of learned sampling schedules on held-out contexts.

Every method (the backbone's default schedule, the learned instance-level schedule at its Dirichlet
mean, optionally a learned global schedule and, for Flux-Dev, the distilled Flux-Schnell) samples
from the *same* initial noise for each context (prompt + seed), so differences are paired.

CPU, the embedded digits backbone (after `python train.py`):
    python evaluate.py --ckpt out/ckpt.pt
    python evaluate.py --ckpt out/ckpt.pt --global-ckpt out_global/ckpt.pt --limit 50
One GPU, HPSv2 and CLIP on the 3,200 HPDv2 test prompts (benchmark/*.json of the hub dataset
zhwang/HPDv2, fetched once with
`hf download zhwang/HPDv2 --repo-type dataset --include "benchmark/*.json" --local-dir data/HPDv2`):
    python evaluate.py --ckpt out_sd35m/ckpt.pt --hpdv2 data/HPDv2/benchmark --rewards hpsv2,clip
    python evaluate.py --ckpt out_flux/ckpt.pt --hpdv2 data/HPDv2/benchmark --schnell --limit 400

Writes under --out-dir (default: eval/ next to the checkpoint): results.md (mean and 95% CI per
method, paired difference to default with its CI, per style for HPDv2), scores.json (every
per-sample score, per method, per reward, per context) and PNG plots. A rerun loads scores.json and
only scores what is missing, so an interrupted run resumes and --limit can be raised later.

The functions above the command line part (heldout_contexts, context_noise, evaluate, summarize,
format_table, policy_schedule) are what train.py uses for its held-out table.
"""
import argparse
import json
import math
import os
import sys

import torch
from tqdm import tqdm

import policy as policy_lib
import rewards as rewards_lib
import rollout

HPDV2_STYLES = ("anime", "concept-art", "paintings", "photo")
HELDOUT_SEED = 10**6  # held-out noise seeds start here, disjoint from the seeds training draws

# -----------------------------------------------------------------------------
# configuration of the command line
parser = argparse.ArgumentParser(description="Paired evaluation of learned sampling schedules.")
# I/O
parser.add_argument("--ckpt", default="out/ckpt.pt", help="instance-level checkpoint written by train.py")
parser.add_argument("--global-ckpt", default=None, help="optional checkpoint of a global schedule (same backbone and L)")
parser.add_argument("--out-dir", default=None, help="output folder; default: eval/ next to --ckpt")
# prompts
parser.add_argument("--prompts", default=None, help="text file, one prompt per line")
parser.add_argument("--hpdv2", default=None, help="folder holding the HPDv2 benchmark anime/concept-art/paintings/photo.json")
parser.add_argument("--count", type=int, default=200, help="digits: number of held-out contexts when no prompts are given")
parser.add_argument("--seed", type=int, default=HELDOUT_SEED, help="noise seed of the first context; context i uses seed + i")
parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N contexts (HPDv2: styles interleaved)")
# methods and rewards
parser.add_argument("--rewards", default=None, help="comma-separated rewards to report; default: teacher for digits, hpsv2,clip otherwise")
parser.add_argument("--hpsv2-checkpoint", default=None, help="local HPS_v2*.pt; default: the training reward's, else the hub cache")
parser.add_argument("--clip-checkpoint", default=None, help="local CLIP folder or hub id; default: the training reward's, else rewards.py's")
parser.add_argument("--reference", action="store_true", help="also score the teacher solution (backbone.reference)")
parser.add_argument("--schnell", action="store_true", help="flux-dev only: add Flux-Schnell at 4 steps and at L as a reference")
parser.add_argument("--schnell-path", default=None, help="local Flux-Schnell folder; default: the hub cache")
# consistency checks against the checkpoint
parser.add_argument("--backbone", default=None, help="expected backbone; an error if the checkpoint was trained on another")
parser.add_argument("--steps", type=int, default=None, help="expected L; an error if the checkpoint was trained for another")
# system
parser.add_argument("--batch-size", type=int, default=None, help="contexts per batch; default 200 for digits, 8 otherwise")
parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
# -----------------------------------------------------------------------------


def heldout_contexts(backbone, count=None, seed=HELDOUT_SEED, prompts=None):
    """Fixed held-out contexts: `count` prompts cycling over `prompts` (digits: the backbone's ten
    class prompts) with noise seeds seed, seed + 1, ... Returns (prompts, seeds)."""
    prompts = prompts if prompts is not None else backbone.prompts
    if not prompts:
        raise ValueError(f"backbone {backbone.name!r} has no built-in prompts: give a prompt list")
    count = len(prompts) if count is None else count
    return [prompts[index % len(prompts)] for index in range(count)], [seed + index for index in range(count)]


def context_noise(backbone, seeds):
    """Initial noise per seed, drawn one by one, so it is identical for every method and batch size."""
    return torch.cat([backbone.sample_noise(1, torch.Generator().manual_seed(seed)) for seed in seeds])


def policy_schedule(policy, backbone, mode="mean", generator=None):
    """A method callable(noise, cond) -> times (N, L+1) from a trained policy: the Dirichlet mean
    ("mean", deterministic) or one draw ("sample"). The policy runs in eval mode, then is restored."""
    if mode not in ("mean", "sample"):
        raise ValueError(f"mode must be 'mean' or 'sample', not {mode!r}")

    @torch.no_grad()
    def times_fn(noise, cond):
        was_training = policy.training
        policy.eval()
        alpha = policy(**backbone.policy_inputs(noise, cond))  # (N, L+1)
        policy.train(was_training)
        if mode == "mean":
            increments = policy_lib.mean_increments(alpha)
        else:
            increments = policy_lib.sample_increments(alpha, 1, generator=generator)[:, 0]
        return policy_lib.times_from_increments(increments)

    return times_fn


def fixed_schedule(times):
    """A method callable giving the same schedule times (L+1,) to every context."""

    def times_fn(noise, cond):
        return times.to(noise.device).expand(noise.shape[0], -1)

    return times_fn


def default_schedule(backbone, steps):
    """A method callable giving the backbone's default schedule for L = steps to every context."""
    return fixed_schedule(backbone.default_times(steps))


def _take(noise, cond, prompts, positions):
    """The rows `positions` of a batch (all tensors in cond are batch-first)."""
    if positions == list(range(noise.shape[0])):
        return noise, cond, prompts
    index = torch.tensor(positions, device=noise.device)
    return noise[index], {key: value[index] for key, value in cond.items()}, [prompts[p] for p in positions]


def sample_method(backbone, method, noise, cond, prompts):
    """Final latents of one method and the times it used (None for the reference).
    method: callable(noise, cond) -> times; "reference" for backbone.reference; or a pair
    (other_backbone, callable) that samples with another backbone from the same noise, with its own
    text encoding (Flux-Schnell next to Flux-Dev: same latent layout and VAE)."""
    if isinstance(method, str):
        if method != "reference":
            raise ValueError(f"unknown method {method!r}")
        return backbone.reference(noise, cond), None
    if isinstance(method, tuple):
        other, times_fn = method
        other_cond = other.encode_prompts(prompts)
        times = times_fn(noise, other_cond)
        return other.sample(noise, other_cond, times), times
    times = method(noise, cond)
    return backbone.sample(noise, cond, times), times


def score_contexts(backbone, rewards, prompts, seeds, methods, batch_size=64, pending=None, progress=False):
    """Score every context with every method and reward, batch by batch, on identical noise.

    rewards: dict name -> reward callable; methods: dict name -> method (see sample_method).
    pending(method, index) -> bool: which contexts a method still has to sample (default: all); a
    batch with nothing pending is skipped before any encoding. Every reward scores what is sampled.
    Yields per batch (scores, times): scores[method][reward] = {index: float},
    times[method] = {index: list of L+1 floats} for the contexts sampled in that batch.
    """
    pending = pending or (lambda method, index: True)
    with tqdm(total=len(prompts), disable=not progress, desc="contexts") as bar:
        for start in range(0, len(prompts), batch_size):
            stop = min(start + batch_size, len(prompts))
            rows = {name: [i for i in range(start, stop) if pending(name, i)] for name in methods}
            if not any(rows.values()):
                bar.update(stop - start)
                continue
            batch_prompts = prompts[start:stop]
            noise = context_noise(backbone, seeds[start:stop])
            cond = backbone.encode_prompts(batch_prompts)
            scores, times = {}, {}
            for name, method in methods.items():
                if not rows[name]:
                    continue
                sub_noise, sub_cond, sub_prompts = _take(noise, cond, batch_prompts, [i - start for i in rows[name]])
                latents, used_times = sample_method(backbone, method, sub_noise, sub_cond, sub_prompts)
                if used_times is not None:
                    times[name] = dict(zip(rows[name], used_times.float().cpu().tolist()))
                scores[name] = {}
                for reward_name, reward in rewards.items():
                    values = reward(latents, sub_prompts, sub_noise, sub_cond).float().cpu().tolist()
                    scores[name][reward_name] = dict(zip(rows[name], values))
            bar.update(stop - start)
            yield scores, times


def evaluate(backbone, reward, prompts, seeds, methods, batch_size=64, progress=False):
    """Per-sample scores of each method on the contexts (prompts[i], seeds[i]), on identical noise.
    methods: dict name -> callable(noise, cond) -> times (N, L+1), or "reference" for the teacher.
    Returns dict name -> Tensor (N,) float32, in context order; independent of batch_size."""
    collected = {name: [math.nan] * len(prompts) for name in methods}
    for scores, _ in score_contexts(backbone, {"reward": reward}, prompts, seeds, methods, batch_size, progress=progress):
        for name, per_reward in scores.items():
            for index, value in per_reward["reward"].items():
                collected[name][index] = value
    return {name: torch.tensor(values, dtype=torch.float32) for name, values in collected.items()}


def _t_quantile(dof):
    """Two-sided 95% Student-t quantile (scipy comes with scikit-learn)."""
    from scipy.stats import t as student_t
    return float(student_t.ppf(0.975, dof))


def _mean_ci(values):
    """(mean, standard error, 95% CI half-width) of a 1-D tensor; sem and CI are nan for n < 2."""
    values = values.double()
    if values.numel() < 2:
        return values.mean().item(), math.nan, math.nan
    sem = (values.std(unbiased=True) / math.sqrt(values.numel())).item()
    return values.mean().item(), sem, _t_quantile(values.numel() - 1) * sem


def summarize(scores, baseline="default"):
    """One row per method: mean, sem, ci95 (half-width of the Student-t 95% interval) and the paired
    difference to the baseline method on the same contexts (diff_mean, diff_ci95; None for the
    baseline itself or when it is absent). scores: dict name -> Tensor (N,), same context order."""
    rows = []
    for name, values in scores.items():
        mean, sem, ci95 = _mean_ci(values)
        row = dict(method=name, n=values.numel(), mean=mean, sem=sem, ci95=ci95, diff_mean=None, diff_ci95=None)
        if baseline in scores and name != baseline:
            if scores[baseline].shape != values.shape:
                raise ValueError(f"paired difference needs the same contexts: {name} has {values.numel()}, "
                                 f"{baseline} has {scores[baseline].numel()}")
            row["diff_mean"], _, row["diff_ci95"] = _mean_ci(values - scores[baseline])
        rows.append(row)
    return rows


def _number(value):
    return "-" if value is None or math.isnan(value) else f"{value:.4g}"


def format_table(rows, baseline="default"):
    """Markdown table of summarize()'s rows: mean ± 95% CI and paired difference ± 95% CI."""
    lines = [f"| method | n | mean ± 95% CI | diff to {baseline} ± 95% CI |", "|---|---|---|---|"]
    for row in rows:
        diff = "-" if row["diff_mean"] is None else f"{row['diff_mean']:+.4g} ± {_number(row['diff_ci95'])}"
        lines.append(f"| {row['method']} | {row['n']} | {_number(row['mean'])} ± {_number(row['ci95'])} | {diff} |")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# command line: checkpoints, prompt sets, resumable scores, report and plots

def context_key(prompt, seed):
    """How a context is keyed in scores.json."""
    return f"{seed}|{prompt}"


def load_checkpoint(path, backbone=None, steps=None):
    """Load a train.py checkpoint and rebuild its policy (on CPU). backbone / steps, when given, must
    match what it was trained for: ValueError with one clear line otherwise, before anything heavy."""
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path} (train one with `python train.py`)")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    config = ckpt["config"]
    if backbone is not None and backbone != config["backbone"]:
        raise ValueError(f"{path} was trained on backbone {config['backbone']!r}, not {backbone!r}")
    if steps is not None and steps != config["steps"]:
        raise ValueError(f"{path} was trained for L={config['steps']} steps, not L={steps}")
    policy = policy_lib.build_policy(ckpt["policy_config"])
    policy.load_state_dict(ckpt["policy"])
    if policy.steps != config["steps"]:
        raise ValueError(f"{path}: policy has L={policy.steps} but the configuration says L={config['steps']}")
    return ckpt, policy.eval()


def load_trained_backbone(config, device):
    """The frozen backbone a checkpoint was trained with, rebuilt from its configuration alone."""
    dtype = getattr(torch, config["dtype"]) if config.get("dtype") else None
    return rollout.load_backbone(config["backbone"], path=config["model_path"], device=device, dtype=dtype,
                                 resolution=config["resolution"], guidance=config["guidance"])


def check_prompts(backbone, prompts):
    """A backbone with a fixed prompt set (digits) knows no other prompts: say so before sampling."""
    unknown = [prompt for prompt in prompts if backbone.prompts is not None and prompt not in backbone.prompts]
    if unknown:
        raise ValueError(f"{backbone.name} knows only the prompts {backbone.prompts[0]!r} .. {backbone.prompts[-1]!r}, "
                         f"got {unknown[0]!r}")


def load_prompt_file(path):
    """Prompts from a text file, one per line (blank lines skipped), or from a .json list of prompts
    or of records with a "prompt" field (the layout of HPDv2's train.json)."""
    if not os.path.isfile(path):
        raise ValueError(f"prompt file {path} does not exist")
    with open(path) as handle:
        if path.endswith(".json"):
            prompts = [item["prompt"] if isinstance(item, dict) else item for item in json.load(handle)]
        else:
            prompts = list(handle)
    prompts = [prompt.strip() for prompt in prompts if prompt.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def load_hpdv2(folder):
    """The HPDv2 test prompts (4 styles x 800), interleaved across styles so that any prefix (--limit)
    is balanced. Returns (prompts, styles)."""
    files = [os.path.join(folder, f"{style}.json") for style in HPDV2_STYLES]
    missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"HPDv2 test prompts not found in {folder} (missing {', '.join(missing)}): fetch them with "
                         "`hf download zhwang/HPDv2 --repo-type dataset --include \"benchmark/*.json\" "
                         "--local-dir data/HPDv2` and pass --hpdv2 data/HPDv2/benchmark")
    per_style = {}
    for style, file in zip(HPDV2_STYLES, files):
        with open(file) as handle:
            per_style[style] = json.load(handle)  # a list of prompt strings
    prompts, styles = [], []
    for index in range(max(len(p) for p in per_style.values())):
        for style in HPDV2_STYLES:
            if index < len(per_style[style]):
                prompts.append(per_style[style][index])
                styles.append(style)
    return prompts, styles


def load_store(path, methods_meta):
    """scores.json of an earlier run (or an empty one). A method scored from another checkpoint
    iteration than now is an error: its stored scores would be stale."""
    store = dict(methods={}, contexts={}, scores={}, times={})
    if os.path.isfile(path):
        with open(path) as handle:
            store = json.load(handle)
    for name, meta in methods_meta.items():
        old = store["methods"].get(name)
        if old is not None and old != meta:
            raise ValueError(f"{path} holds '{name}' scores of {old}, not {meta}: use another --out-dir")
        store["methods"][name] = meta
    return store


def write_json_atomic(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(data, handle)
    os.replace(tmp, path)


def _histograms(ax, values_by_name, colors, xlabel):
    low = min(values.min().item() for values in values_by_name.values())
    high = max(values.max().item() for values in values_by_name.values())
    bins = torch.linspace(low, high if high > low else low + 1, 31).tolist()
    for name, values in values_by_name.items():
        ax.hist(values.tolist(), bins=bins, histtype="step", linewidth=1.5, color=colors[name],
                label=f"{name} (mean {values.mean():.4g})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("contexts")
    ax.legend(fontsize=8)


def plot_scores(path, scores_per_reward, baseline="default"):
    """Per reward: a histogram of each method's per-sample scores (left), and one of the paired
    differences to the baseline method on the same contexts and noise (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(scores_per_reward), 2, figsize=(10, 3.5 * len(scores_per_reward)), squeeze=False)
    for (left, right), (reward_name, scores) in zip(axes, scores_per_reward.items()):
        colors = {name: f"C{index}" for index, name in enumerate(scores)}  # one colour per method in both panels
        _histograms(left, scores, colors, f"{reward_name} (higher is better)")
        differences = {name: values - scores[baseline] for name, values in scores.items() if name != baseline}
        if differences:
            _histograms(right, differences, colors, f"{reward_name}: method - {baseline}, paired")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_schedules(ax, learned_times, default_times, label="learned"):
    """Time per step index on `ax`: one line per context (learned_times (N, L+1)), the default in black."""
    steps = range(default_times.shape[0])
    for index, times in enumerate(learned_times):
        ax.plot(steps, times, "-", marker=".", color="tab:blue", alpha=0.5, label=label if index == 0 else None)
    ax.plot(steps, default_times, "k--o", markersize=4, label="default")
    ax.set_xlabel("step index l")
    ax.set_ylabel("time t_l (1 = noise, 0 = data)")
    ax.legend(fontsize=8)


def plot_schedules(path, learned_times, default_times):
    """Where the learned schedules put their steps: mean time per step index with a 10-90% band
    across contexts, against the default times (left), and the same as a shift from the default
    (right). learned_times: dict name -> Tensor (N, L+1)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = torch.arange(default_times.numel())
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, default_times, "k--o", markersize=4, label="default")
    right.axhline(0.0, color="black", linestyle="--", label="default")
    for name, times in learned_times.items():
        for ax, values in ((left, times), (right, times - default_times)):
            low, high = torch.quantile(values, torch.tensor([0.1, 0.9]), dim=0)
            line, = ax.plot(steps, values.mean(0), "-o", markersize=4, label=f"{name} (mean, 10-90% band)")
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.25)
    left.set_ylabel("time t_l (1 = noise, 0 = data)")
    right.set_ylabel("t_l learned - t_l default")
    for ax in (left, right):
        ax.set_xlabel("step index l")
        ax.set_xticks(steps.tolist())
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(path, header, contexts, styles, store, reward_names, method_names):
    """results.md: one table per reward over all contexts, then per style when styles are known."""
    keys = [context_key(prompt, seed) for prompt, seed in contexts]
    lines = header + [""]
    tables = {}
    for reward_name in reward_names:
        scores = {m: torch.tensor([store["scores"][m][reward_name][k] for k in keys]) for m in method_names}
        tables[reward_name] = scores
        lines += [f"## {reward_name}", "", format_table(summarize(scores)), ""]
        for style in sorted(set(s for s in styles if s is not None)):
            mask = torch.tensor([s == style for s in styles])
            lines += [f"### {reward_name}, {style}", "", format_table(summarize({m: v[mask] for m, v in scores.items()})), ""]
    with open(path, "w") as handle:
        handle.write("\n".join(lines))
    return tables


def main(argv=None):
    args = parser.parse_args(argv)

    # --- checkpoints and prompt sets: cheap checks before anything heavy ---
    try:
        ckpt, learned = load_checkpoint(args.ckpt, args.backbone, args.steps)
        config = ckpt["config"]
        steps = config["steps"]
        policies = {"learned": (args.ckpt, ckpt, learned)}
        if args.global_ckpt:
            global_ckpt, global_policy = load_checkpoint(args.global_ckpt, config["backbone"], steps)
            policies["global"] = (args.global_ckpt, global_ckpt, global_policy)
        reward_names = (args.rewards or ("teacher" if config["backbone"] == "digits" else "hpsv2,clip")).split(",")
        unknown = [name for name in reward_names if name not in rewards_lib.REWARDS]
        if unknown:
            raise ValueError(f"unknown reward {unknown[0]!r}; known: {', '.join(rewards_lib.REWARDS)}")
        if args.schnell and config["backbone"] != "flux-dev":
            raise ValueError(f"--schnell is the reference for flux-dev, not for {config['backbone']!r}")
        styles = None
        if args.hpdv2:
            prompt_list, styles = load_hpdv2(args.hpdv2)
        elif args.prompts:
            prompt_list = load_prompt_file(args.prompts)
        elif config["backbone"] == "digits":
            prompt_list = None  # the ten class prompts, cycled over --count contexts
        else:
            raise ValueError(f"backbone {config['backbone']!r} needs prompts: --hpdv2 DIR or --prompts FILE")
    except ValueError as error:
        sys.exit(f"evaluate.py: error: {error}")

    batch_size = args.batch_size or (200 if config["backbone"] == "digits" else 8)
    out_dir = args.out_dir or os.path.join(os.path.dirname(os.path.abspath(args.ckpt)), "eval")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    # --- backbone, rewards and methods ---
    try:
        backbone = load_trained_backbone(config, device)
        check_prompts(backbone, prompt_list or [])
    except ValueError as error:
        sys.exit(f"evaluate.py: error: {error}")
    if prompt_list is None:
        prompts, seeds = heldout_contexts(backbone, args.count, seed=args.seed)
    else:
        prompts, seeds = heldout_contexts(backbone, len(prompt_list), seed=args.seed, prompts=prompt_list)
    styles = styles or [None] * len(prompts)
    if args.limit is not None:
        prompts, seeds, styles = prompts[:args.limit], seeds[:args.limit], styles[:args.limit]

    reward_checkpoints = {"hpsv2": args.hpsv2_checkpoint, "clip": args.clip_checkpoint}  # rewards with a model
    rewards = {}
    for name in reward_names:
        options = {}
        if name in reward_checkpoints:
            trained = config.get("reward_checkpoint") if name == config.get("reward") else None
            options["checkpoint"] = reward_checkpoints[name] or trained
        try:
            rewards[name] = rewards_lib.load_reward(name, backbone, device=device, **options)
        except (ImportError, ValueError, OSError) as error:
            hint = f" (a local copy: --{name}-checkpoint PATH)" if name in reward_checkpoints else ""
            print(f"skipping reward {name!r}{hint}: {error}")
    if not rewards:
        sys.exit(f"evaluate.py: error: none of the rewards {reward_names} could be loaded")

    methods = {"default": default_schedule(backbone, steps)}
    methods_meta = {"default": dict(backbone=config["backbone"], steps=steps)}
    for name, (path, method_ckpt, method_policy) in policies.items():
        methods[name] = policy_schedule(method_policy.to(backbone.device), backbone, mode="mean")
        methods_meta[name] = dict(checkpoint=os.path.abspath(path), iteration=method_ckpt.get("iteration"), steps=steps)
    if args.reference:
        methods["reference"] = "reference"
        methods_meta["reference"] = dict(backbone=config["backbone"])
    if args.schnell:
        try:
            schnell = rollout.load_backbone("flux-schnell", path=args.schnell_path, device=device,
                                            dtype=backbone.dtype, resolution=config["resolution"])
            for schnell_steps in sorted({4, steps}):
                methods[f"schnell-{schnell_steps}"] = (schnell, default_schedule(schnell, schnell_steps))
                methods_meta[f"schnell-{schnell_steps}"] = dict(backbone="flux-schnell", steps=schnell_steps)
        except ValueError as error:
            print(f"skipping Flux-Schnell (not available: {error})")

    print(f"backbone {config['backbone']}, L={steps}, {len(prompts)} contexts, batch {batch_size}, "
          f"methods {list(methods)}, rewards {list(rewards)}, output {out_dir}")

    # --- scores, resumable: only what scores.json does not hold yet ---
    os.makedirs(out_dir, exist_ok=True)
    scores_path = os.path.join(out_dir, "scores.json")
    try:
        store = load_store(scores_path, methods_meta)
    except ValueError as error:
        sys.exit(f"evaluate.py: error: {error}")
    for name in methods:
        store["scores"].setdefault(name, {})
        store["times"].setdefault(name, {})
        for reward_name in rewards:
            store["scores"][name].setdefault(reward_name, {})
    keys = [context_key(prompt, seed) for prompt, seed in zip(prompts, seeds)]
    for key, prompt, seed, style in zip(keys, prompts, seeds, styles):
        store["contexts"][key] = dict(prompt=prompt, seed=seed, style=style)

    def pending(method, index):
        return any(keys[index] not in store["scores"][method][reward_name] for reward_name in rewards)

    for scores, times in score_contexts(backbone, rewards, prompts, seeds, methods, batch_size, pending, progress=True):
        for name, per_reward in scores.items():
            for reward_name, values in per_reward.items():
                store["scores"][name][reward_name].update({keys[i]: v for i, v in values.items()})
        for name, per_context in times.items():
            store["times"][name].update({keys[i]: t for i, t in per_context.items()})
        write_json_atomic(scores_path, store)
    write_json_atomic(scores_path, store)

    # --- report and plots ---
    header = [f"# Evaluation of {os.path.abspath(args.ckpt)}", "",
              f"backbone {config['backbone']}, L = {steps} steps, {len(prompts)} contexts (prompt + noise seed), "
              "every method on the same noise. Mean ± half-width of the 95% Student-t interval; "
              "diff = paired difference to the default schedule on the same contexts. Higher is better."]
    tables = write_report(os.path.join(out_dir, "results.md"), header, list(zip(prompts, seeds)), styles, store,
                          list(rewards), list(methods))
    plot_scores(os.path.join(out_dir, "scores.png"), tables)
    learned_times = {name: torch.tensor([store["times"][name][k] for k in keys]) for name in policies}
    plot_schedules(os.path.join(out_dir, "schedules.png"), learned_times, backbone.default_times(steps).cpu())
    for reward_name, scores in tables.items():
        print(f"\n{reward_name}\n{format_table(summarize(scores))}")
    print(f"\nwrote {os.path.join(out_dir, 'results.md')}, scores.json, scores.png, schedules.png")


if __name__ == "__main__":
    main()
