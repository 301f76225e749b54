"""
Schedules scored on held-out contexts, paired: every method samples from the same initial noise for
each context (prompt + seed). A method is a callable (noise, cond) -> times (N, L+1), or -> (times,
latents) when it samples itself (a policy's `schedule`). summarize and format_table give each
method's mean and its paired difference to the default, with 95% Student-t intervals.
"""

import math
import os

import torch
from tqdm import tqdm

import rewards as reward_lib
from backbones import BACKBONES
from prompts import context_noise
from rewards.images import quantize
from scoring.realism import COMPONENTS, realism_measure
from store.files import write_json_atomic

SMALL_REALISM = 4 * COMPONENTS  # contexts below which realism estimates are noisy
GAIN_CONTEXTS = 32  # held-out contexts of the gain logged at each checkpoint (heldout_gain)


# -----------------------------------------------------------------------------
# methods: callables (noise, cond) -> times (N, L+1)
def policy_schedule(policy, backbone, draws=None):
    """A trained policy's schedule and latents: its mean, or one draw from the generator `draws`."""
    return torch.no_grad()(lambda noise, cond: policy.schedule(backbone, noise, cond, draws))


def run_method(backbone, method, noise, cond):
    """(times, latents) of a method: its times run by the sampler, or what it sampled itself."""
    used = method(noise, cond)
    return used if isinstance(used, tuple) else (used, backbone.sample(noise, cond, used))


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
    """Score contexts (prompts[i], seeds[i]) with every method (name -> method) and reward (name ->
    reward), batch by batch, on the same noise; `reference` names a row of backbone.reference (the
    teacher). pending(row, index): the contexts a row still needs (default: all). Yields per batch
    scores[row][column] = {index: float}, times[row] = {index: [L+1 floats]}."""
    samplers = {**methods, **({reference: None} if reference else {})}  # None: the teacher
    pending = pending or (lambda row, index: True)
    batches = range(0, len(prompts), batch_size)
    for start in tqdm(batches, disable=not progress, desc=f"{len(prompts)} contexts"):
        stop = min(start + batch_size, len(prompts))
        todo = {name: [i for i in range(start, stop) if pending(name, i)] for name in samplers}
        if not any(todo.values()):  # skipped before encoding
            continue
        noise = context_noise(backbone, seeds[start:stop])
        cond = backbone.encode_prompts(prompts[start:stop])
        scores, times = {}, {}
        for name, schedule in samplers.items():
            if not todo[name]:
                continue
            pick = [i - start for i in todo[name]]
            sub_noise = noise[pick]
            sub_cond = {key: value[pick] for key, value in cond.items()}
            if schedule is None:
                latents = backbone.reference(sub_noise, sub_cond)
            else:
                used, latents = run_method(backbone, schedule, sub_noise, sub_cond)
                times[name] = dict(zip(todo[name], used.float().cpu().tolist()))
            samples = (latents, [prompts[i] for i in todo[name]], sub_noise, sub_cond)
            scores[name] = {}
            for reward_name, reward in rewards.items():  # for OCR and GenEval a second column
                for column, values in reward_lib.metrics(reward, reward_name, *samples).items():
                    scores[name][column] = dict(zip(todo[name], values.tolist()))
        yield scores, times


def score_table(
    backbone, rewards, prompts, seeds, methods, reference=None, batch_size=64, progress=False
):
    """Per-sample scores of each row and column (each reward's metrics) on the contexts (prompts[i],
    seeds[i]): row -> column -> Tensor (N,) in context order (the batches' order)."""
    table = {}
    batches = score_batches(
        backbone, rewards, prompts, seeds, methods, reference, batch_size, progress=progress
    )
    for scores, _ in batches:
        for name, columns in scores.items():
            for column, values in columns.items():
                table.setdefault(name, {}).setdefault(column, []).extend(values.values())
    return {
        name: {column: torch.tensor(v) for column, v in row.items()} for name, row in table.items()
    }


def score_methods(
    backbone, reward, prompts, seeds, methods, reference=None, batch_size=64, progress=False
):
    """score_table for one reward: name -> Tensor (N,)."""
    table = score_table(
        backbone, {"reward": reward}, prompts, seeds, methods, reference, batch_size, progress
    )
    return {name: columns["reward"] for name, columns in table.items()}


def mean_ci(values):
    """(mean, 95% Student-t half-width) of a 1-D tensor; the half-width is nan for n < 2."""
    from scipy.stats import t as student_t  # scipy comes with scikit-learn

    values, n = values.double(), values.numel()
    if n < 2:
        return values.mean().item(), math.nan
    sem = (values.std() / math.sqrt(n)).item()
    return values.mean().item(), float(student_t.ppf(0.975, n - 1)) * sem


def summarize(scores):
    """One row per method: n, mean, ci95 (half-width of the 95% interval) and the paired difference
    to the default method on the same contexts (diff_mean, diff_ci95; None for the default)."""
    rows, default = [], scores.get("default")
    for name, values in scores.items():
        row = dict(method=name, n=values.numel(), diff_mean=None, diff_ci95=None)
        row["mean"], row["ci95"] = mean_ci(values)
        if default is not None and name != "default":
            if default.shape != values.shape:
                counts = f"{name} has {values.numel()}, default has {default.numel()}"
                raise ValueError(f"paired difference needs the same contexts: {counts}")
            row["diff_mean"], row["diff_ci95"] = mean_ci(values - default)
        for key in ("ci95", "diff_ci95"):  # one context has no interval: null in JSON, not NaN
            if row[key] is not None and math.isnan(row[key]):
                row[key] = None
        rows.append(row)
    return rows


def format_table(rows):
    """Markdown table of summarize()'s rows: mean ± 95% CI and paired difference ± 95% CI."""

    def number(value):
        return "-" if value is None or math.isnan(value) else f"{value:.4g}"

    lines = ["| method | n | mean ± 95% CI | diff to default ± 95% CI |", "|---|---|---|---|"]
    for row in rows:
        mean, diff = f"{number(row['mean'])} ± {number(row['ci95'])}", "-"
        if row["diff_mean"] is not None:
            diff = f"{row['diff_mean']:+.4g} ± {number(row['diff_ci95'])}"
        lines.append(f"| {row['method']} | {row['n']} | {mean} | {diff} |")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# train.py's held-out curve and final report


def heldout_gain(backbone, reward, heldout, steps):
    """A function policy -> the mean paired gain of its mean schedule over the default on the first
    GAIN_CONTEXTS held-out contexts, the same at every checkpoint: train.py's curve."""
    prompts, seeds = (part[:GAIN_CONTEXTS] for part in heldout)
    methods = {"default": default_schedule(backbone, steps)}
    default = score_methods(backbone, reward, prompts, seeds, methods)["default"]

    def gain(policy):
        methods = {"learned": policy_schedule(policy, backbone)}
        learned = score_methods(backbone, reward, prompts, seeds, methods)["learned"]
        return (learned - default).mean().item()

    return gain


def heldout_report(
    out_dir, backbone, reward, policy, prompts, seeds, reward_name, iteration, seed=0
):
    """train.py's final table on its held-out contexts, printed and written to eval.json (last, and
    atomically: evidence/ablation.py takes an existing one as a finished run)."""
    draws = torch.Generator().manual_seed(seed)
    methods = {
        "default": default_schedule(backbone, policy.steps),
        "learned (mean)": policy_schedule(policy, backbone),
        "learned (sampled)": policy_schedule(policy, backbone, draws),
    }
    teacher = "limit (teacher)" if reward_name == "teacher" else None  # the reward's target
    rows = summarize(
        score_methods(backbone, reward, prompts, seeds, methods, teacher, progress=True)
    )
    print(
        f"\nheld-out evaluation: {len(seeds)} contexts, reward {reward_name}, L = {policy.steps}\n"
        f"{format_table(rows)}"
    )
    report = dict(rows=rows, steps=policy.steps, contexts=len(seeds), reward=reward_name)
    report.update(iteration=iteration)  # of the checkpoint: train.py's finished() compares them
    if BACKBONES[backbone.name].get("folder"):  # a miniature: realism beside the reward
        measure = realism_measure()
        compared = {name: methods[name] for name in ("default", "learned (mean)")}
        realism = realism_table(backbone, compared, prompts, seeds, measure)
        floor = measure.floor(len(seeds))
        print("realism against real digits (Frechet distance lower, precision and recall higher):")
        real = f"unseen real digits, the same {len(seeds)}"  # what data as real as the data scores
        for name, row in {**realism, real: floor}.items():
            print(f"  {name}: " + ", ".join(f"{key} {value:.3f}" for key, value in row.items()))
        if len(seeds) < SMALL_REALISM:
            print(
                f"  (below {SMALL_REALISM} contexts these are estimates of {COMPONENTS} "
                "components' covariance from few images: noisy, and real digits can score worse "
                "than samples)"
            )
        report.update(realism=realism, realism_floor=floor)
    write_json_atomic(os.path.join(out_dir, "eval.json"), report)


@torch.no_grad()
def sample_images(backbone, method, prompts, seeds, batch_size=128):
    """The decoded 8-bit images (N, 3, H, W) in [0, 1] of the contexts (prompts[i], seeds[i])
    sampled with `method`, batch by batch."""
    images = []
    for start in range(0, len(prompts), batch_size):
        noise = context_noise(backbone, seeds[start : start + batch_size])
        cond = backbone.encode_prompts(prompts[start : start + batch_size])
        latents = run_method(backbone, method, noise, cond)[1]
        images.append(quantize(backbone.decode(latents)).clamp(0, 1).cpu())
    return torch.cat(images)


def realism_table(backbone, methods, prompts, seeds, realism):
    """method name -> the realism of its samples of the contexts (prompts[i], seeds[i])."""
    return {
        name: realism(sample_images(backbone, method, prompts, seeds))
        for name, method in methods.items()
    }
