"""
A reward-trained ceiling for the instance policy class on the trained miniatures, calibrated
(docs/RESULTS.md, section "ceiling"). Where REINFORCE's instance policy equals its global schedule,
can any policy of the class gain, and could this trainer have shown it? Per miniature, L = 3:

- The fair start: the best single schedule, fitted (instance_study's fit) from the best on training
  contexts of the time shifts, the uniform schedule and REINFORCE's global schedules (`python
  train.py --backbone B --steps L --policy global --seed S` at the miniature's defaults, seeds
  --seeds), kept where the fit loses; every arm starts there, its t_L included (the network's stop
  margin is that schedule's own t_L, not policy.py's 0.005).
- The ceiling: the instance network (policy.SchedulePolicy, the miniature's size) trained on its
  mean schedule (the Dirichlet mean) by the exact gradient of the preference scorer through the
  sampler and the VAE decode (the pixels before the reward's 8-bit rounding,
  instance_study.differentiable_score), Adam, each step on BATCH fresh contexts (a training prompt
  and a noise seed no step draws again) for ITERATIONS steps; scored every EVERY steps on
  VALIDATION tuning contexts by the reward itself (rounding included), the best iterate kept.
- Its controls: its global twin (policy.GlobalPolicy) from the same start on the same contexts with
  the same budget, and the instance policy's average schedule (its mean schedule over the TRAINING
  tuning contexts, as one schedule). On HELDOUT held-out contexts, paired, per seed: instance -
  global and instance - average.
- Two positive controls: the same trainer, steps, rate and fresh contexts from the same start, on
  the preference reward plus a built-in term -w (t_1 - c - d s)^2 whose optimum t_1 = c + d s is set
  by s = +-1, a feature of the context (FEATURES): "noise", the sign of the mean of x_T (as
  digits-noise; it calibrates coarse signals of the noise only), and "prompt", the parity of the
  digit the prompt names (held-out paraphrases). c is the start's t_1, d = min(DISTANCE, half the
  room to t_0 and t_2), and w makes the term alone beat its best single schedule by the cell's
  per-context gap on the held-out contexts: w d^2 (1 - mean(s)^2) = gap. Both twins (instance,
  global) train on the sum; instance - global on it, held-out and paired, per seed of
  --control-seeds, is what the trainer shows of an optimum of the cell's size.
- Perturbation: each of the first SEARCHED held-out contexts' own searched schedule
  (instance_study.best_each from the best single schedule) against the best single schedule, on
  its own context (the per-context gap), on its noise perturbed, x' = sqrt(1 - e^2) x + e z for e
  in NOISE_LEVELS, on its noise split by resolution (x_T's per-channel 2x2 block means from fresh
  noise z, the rest kept; then the rest from z, the means kept: x' stays standard normal), given
  to other contexts (the mean over SWAPS cyclic shifts), and their mean used as one schedule: the
  share of the per-context gap each keeps.

The rules, fixed before any run (verdict(rows, controls) applies them):
- a positive control passes in a cell where, in every control seed, its instance - global is at
  least CONTROL_SHARE of the built-in gap with its lower 95% bound above 0;
- where instance - global and instance - average are below ABSOLUTE with their upper 95% bounds
  below SHARE x the cell's per-context gap, for every seed in every cell, and both controls pass in
  every cell: NO_GAIN, a statement of this network trained this way, on these miniatures; where
  those rows hold but a control fails: UNCALIBRATED, naming it (in that cell the null bounds
  nothing for that kind of signal); where a row breaks them: GAINS, and REINFORCE's miss is one of
  sample complexity.
The prediction, written before the run: the fair start lifts mini-sdxl's single schedule by about
0.3 (REINFORCE's global schedule stops at t_L near 1e-5) and changes the other two by less than
0.05; both controls pass in every cell (the network reads x_T's mean and the prompt); the plain rows
stay within the rule: NO_GAIN.

Cost, an estimate: a REINFORCE global run takes about 70 s; the ceiling's steps of 32 contexts take
0.2 to 0.4 s on one core; 9 global runs, 30 trainings of 800 steps (18 plain, 12 controls at one
seed) and the cells' oracles come to about 130 min of one core: about an hour with --jobs 2.

    python -m evidence.ceiling --jobs 2
    python -m evidence.ceiling --backbones mini-sd3 --seeds 0 --jobs 2   # a part of it

Cells, runs and trainings that this code finished are read, not repeated; the folder of other code
is removed first (evidence.results.this_commit_only).
"""

import argparse
import itertools
import json
import logging
import os
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from multiprocessing import get_context

import torch
import torch.nn.functional as F

import backbones
from evaluate import POLICIES, load_policy, mean_ci
from evidence.ablation import SHIFTS, shifted
from evidence.instance_study import (
    SEARCH_ITERATIONS,
    SINGLE_BATCH,
    SINGLE_ITERATIONS,
    Contexts,
    best_each,
    best_single,
    differentiable_score,
    logits_of,
    score,
    times_of,
)
from evidence.results import (
    commit,
    one_line_errors,
    record,
    run_training,
    this_commit_only,
    write_json_atomic,
)
from miniatures.data import prompt_lists
from policy import ALPHA_MIN, increments_from_times, make_policy
from prompts import HELDOUT_SEED, TUNING_SEED, context_noise, context_seed
from rewards import load_reward
from rewards.digits import digit_of

HELDOUT, TRAINING, VALIDATION, SEARCHED = 256, 256, 64, 64  # contexts (module docstring)
ITERATIONS, BATCH, LR, EVERY = 800, 32, 3e-3, 25  # the ceiling's training; validation interval

parser = argparse.ArgumentParser("python -m evidence.ceiling", description=__doc__.split("\n")[1])
add = parser.add_argument
add("--out-dir", default="out/ceiling", help="cells, runs and trainings go below this")
add("--backbones", nargs="+", default=["mini-sd3", "mini-flux", "mini-sdxl"])
add("--steps", type=int, nargs="+", default=[3], help="the L of each cell")
add("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the ceiling's and REINFORCE's seeds")
add("--control-seeds", type=int, nargs="+", default=[0], help="the positive controls' seeds")
add("--jobs", type=int, default=1, help="cells and trainings at the same time, one thread each")
add("--iterations", type=int, default=ITERATIONS, help="the ceiling's Adam steps")
add("--batch", type=int, default=BATCH, help="fresh contexts per step")
add("--lr", type=float, default=LR, help="the ceiling's Adam rate")

NOISE_LEVELS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # e of the perturbed noise
SPLITS = ("x_T's 2x2 block means from fresh noise", "the rest of x_T from fresh noise")
SWAPS = 4  # cyclic shifts of the searched schedules over the contexts
PERTURB_SEED = 3 * 10**6  # the noise z of the perturbation, apart from held-out and tuning seeds
KINDS = ("instance", "global")
CONCENTRATION = 100.0  # policy.SchedulePolicy's, raised where the start's t_L needs it
# the positive controls: s = +-1 of each context
FEATURES = {
    "noise": lambda contexts: contexts.noise.flatten(1).mean(1).sign(),  # the sign of x_T's mean
    "prompt": lambda contexts: 1.0 - 2.0 * (contexts.digits % 2).float(),  # even +1, odd -1
}
DISTANCE = 0.1  # the largest d of a control's optimum t_1 = c + d s
# the rules (module docstring)
ABSOLUTE, SHARE, CONTROL_SHARE = 0.05, 0.25, 0.5
NO_GAIN = (
    "this network, trained this way, learns no input dependence that carries to fresh contexts on "
    "these miniatures, though it learns a built-in noise-set and prompt-set optimum of each cell's "
    "per-context gap"
)
UNCALIBRATED = (
    "no gain found, but the trainer missed a built-in optimum of its cell's gap: there the null "
    "bounds nothing for that kind of signal"
)
GAINS = "the ceiling gains"
CONTRASTS = ("instance - global", "instance - average")


# -----------------------------------------------------------------------------
# the objectives, the contexts and the trainer
class Preference:
    """The preference reward of contexts sampled with their times (N, L+1): objective() with
    gradients to the times (the pixels before the 8-bit rounding), reward() as train.py scores."""

    def __init__(self, backbone, reward):
        self.backbone, self.model = backbone, reward

    def objective(self, contexts, times):
        return differentiable_score(self.backbone, self.model.scorer, contexts, times)

    def reward(self, contexts, times):
        return score(self.backbone, self.model, contexts, times)[0]


class Control:
    """A positive control: `scorer` plus the built-in term -w (t_1 - c - d s)^2, s = +-1 the
    context's `feature` (FEATURES), c the start's t_1 (module docstring); w sized on `contexts` so
    that the term alone beats its best single schedule by `gap` there."""

    def __init__(self, scorer, feature, start, gap, contexts):
        self.scorer, self.feature, self.centre, self.gap = scorer, feature, float(start[1]), gap
        self.distance = min(DISTANCE, (1 - self.centre) / 2, (self.centre - float(start[2])) / 2)
        balance = FEATURES[feature](contexts).mean().item()  # the best single t_1 is c + d balance
        self.weight = gap / (self.distance**2 * (1 - balance**2))

    def term(self, contexts, times):
        target = self.centre + self.distance * FEATURES[self.feature](contexts)
        return -self.weight * (times[:, 1] - target).square()

    def objective(self, contexts, times):
        return self.scorer.objective(contexts, times) + self.term(contexts, times)

    def reward(self, contexts, times):
        return self.scorer.reward(contexts, times) + self.term(contexts, times)


def fresh_contexts(backbone, prompts, batch, seed):
    """`batch` new contexts per step: prompts drawn at random, noise seeds that no step repeats
    (prompts.context_seed: apart from the held-out and tuning seeds)."""
    generator = torch.Generator().manual_seed(seed)
    for step in itertools.count():
        picks = torch.randint(len(prompts), (batch,), generator=generator).tolist()
        chosen = [prompts[i] for i in picks]
        noise = context_noise(backbone, [context_seed(seed, step, c) for c in range(batch)])
        digits = torch.tensor([digit_of(prompt) for prompt in chosen])
        yield Contexts(chosen, noise, backbone.encode_prompts(chosen), digits)


def mean_times(policy, backbone, contexts):
    return policy.times(backbone, contexts.noise, contexts.cond)  # the Dirichlet mean's


def starting_at(times):
    """make_policy's options for a network that starts at `times` (L+1,) exactly: its own t_L as
    the stop margin, the concentration raised so that its smallest increment stays above
    policy.ALPHA_MIN."""
    smallest = increments_from_times(torch.as_tensor(times, dtype=torch.float64)).min().item()
    return dict(
        stop_margin=float(times[-1]), concentration=max(CONCENTRATION, 2 * ALPHA_MIN / smallest)
    )


def train_ceiling(
    backbone, scorer, kind, steps, start_times, contexts_stream, validation, iterations=ITERATIONS,
    lr=LR, every=EVERY, network="embedded", seed=0,
):  # fmt: skip
    """The policy `kind` from the schedule start_times (L+1,), trained on its mean schedule: Adam on
    -scorer.objective of the next batch of contexts_stream; scored by scorer.reward on
    `validation` at the start, every `every` steps and at the end, the best iterate kept.
    Returns (the policy, in eval mode; [(step, mean validation reward)])."""
    torch.manual_seed(seed)
    options = starting_at(start_times)
    policy = make_policy(
        POLICIES[kind], backbone.policy_dims, steps, start_times, network, **options
    )
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    history, best, kept = [], -float("inf"), None
    for step in range(iterations + 1):
        if step % every == 0 or step == iterations:
            with torch.no_grad():
                value = scorer.reward(validation, mean_times(policy, backbone, validation))
            history.append((step, value.mean().item()))
            if history[-1][1] > best:
                best, kept = history[-1][1], {k: v.clone() for k, v in policy.state_dict().items()}
        if step == iterations:
            break
        contexts = next(contexts_stream)
        loss = -scorer.objective(contexts, mean_times(policy, backbone, contexts)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    policy.load_state_dict(kept)
    return policy.eval(), history


def split(backbone, noise, fresh, part):
    """x_T (N, ...) with its per-channel 2x2 block means (part 0) or the rest (part 1) taken from
    `fresh`: the means and the rest are independent, so x_T stays standard normal."""
    flux = isinstance(backbone, backbones.families.FluxBackbone)  # packed: unpacked to split
    x, z = (backbone.as_image(noise), backbone.as_image(fresh)) if flux else (noise, fresh)
    means = [F.interpolate(F.avg_pool2d(v, 2), scale_factor=2.0) for v in (x, z)]
    mixed = means[1] + x - means[0] if part == 0 else means[0] + z - means[1]
    return backbone.pack(mixed) if flux else mixed


# -----------------------------------------------------------------------------
# the jobs: REINFORCE's global runs, a cell's oracles and perturbations, and one training; each
# worker loads a miniature once
LOADED = {}


def load(name):
    """(backbone, Preference, contexts) of a miniature, built at this worker's first job on it."""
    if name not in LOADED:
        torch.set_num_threads(1)
        # SD-XL's decode casts its VAE at every call; diffusers warns each time
        logging.getLogger("diffusers.models.modeling_utils").setLevel(logging.ERROR)
        backbone = backbones.load_backbone(name)
        train_prompts, heldout_prompts = prompt_lists()
        backbone.keep_encoded(train_prompts + heldout_prompts)
        tuning = Contexts.of(backbone, train_prompts, TRAINING + VALIDATION, TUNING_SEED)
        heldout = Contexts.of(backbone, heldout_prompts, HELDOUT, HELDOUT_SEED)
        sets = dict(prompts=train_prompts, training=tuning[:TRAINING])
        sets.update(validation=tuning[TRAINING:], heldout=heldout)
        LOADED[name] = backbone, Preference(backbone, load_reward("preference", backbone)), sets
    return LOADED[name]


def cached(path, compute):
    """The job's result: read where this code wrote it, else computed and written."""
    if os.path.isfile(path):
        with open(path) as file:
            return dict(json.load(file), read=True)
    result = compute()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, result)
    return dict(result, read=False)


def reinforce_run(args, name, steps, seed):
    """REINFORCE's global schedule at the miniature's defaults (trained, or read where this code
    finished it): the folder of its policy."""
    out_dir = os.path.join(args.out_dir, name, f"L{steps}", f"reinforce-global-seed{seed}")
    flags = ["--backbone", name, "--steps", str(steps), "--seed", str(seed), "--policy", "global"]
    run_training(out_dir, flags + ["--without-realism"])
    return os.path.join(out_dir, "policy")


def gap_of(found):
    return torch.tensor(found["rows"]["own context"]).mean().item()


def oracle(args, name, steps, runs=()):
    """The best single schedule (the fair start: instance_study's fit from the best of the shifts,
    the uniform schedule and REINFORCE's global schedules in `runs`), each searched context's own
    schedule, and per perturbation row its gain over the best single schedule per context."""

    def compute():
        backbone, scorer, sets = load(name)
        training, searched = sets["training"], sets["heldout"][:SEARCHED]

        def on(contexts):
            return lambda index, times: scorer.objective(contexts[index], times)

        def rewards(contexts, times):
            return scorer.reward(contexts, times.expand(len(contexts), -1))

        default = backbone.default_times(steps)
        starts = {f"shift {s}": shifted(default, s) for s in SHIFTS}
        starts["uniform"] = torch.linspace(1, 0, steps + 1)
        starts = {what: times_of(logits_of(times)) for what, times in starts.items()}  # t_L > 0
        for seed, run in enumerate(runs):  # a global policy's schedule: the same for every context
            with torch.no_grad():
                starts[f"REINFORCE global, seed {seed}"] = mean_times(
                    load_policy(run)[0], backbone, training[:1]
                )[0]
        tried = {what: rewards(training, times).mean().item() for what, times in starts.items()}
        start = max(tried, key=tried.get)
        fit = best_single(on(training), len(training), starts[start], SINGLE_ITERATIONS,
                          SINGLE_BATCH, 0, margin=float(starts[start][-1]))  # fmt: skip
        single = next(fit)
        if rewards(training, single).mean() < tried[start]:  # the fit lost: keep its start
            single = starts[start]
        alone = rewards(searched, single)
        many = single.expand(len(searched), -1)
        found = next(best_each(on(searched), many, SEARCH_ITERATIONS, margin=float(single[-1])))
        better = scorer.reward(searched, found) > alone
        own = torch.where(better[:, None], found, single)  # the search, or its start where better
        rows = {"own context": scorer.reward(searched, own) - alone}
        z = context_noise(backbone, [PERTURB_SEED + i for i in range(len(searched))])
        noises = {f"noise perturbed, e = {e}": (1 - e**2) ** 0.5 * searched.noise + e * z
                  for e in NOISE_LEVELS}  # fmt: skip
        noises |= {row: split(backbone, searched.noise, z, part) for part, row in enumerate(SPLITS)}
        for row, noise in noises.items():
            moved = Contexts(searched.prompts, noise, searched.cond, searched.digits)
            rows[row] = scorer.reward(moved, own) - rewards(moved, single)
        swapped = [scorer.reward(searched, own.roll(shift, 0)) for shift in range(1, SWAPS + 1)]
        rows["given to other contexts"] = torch.stack(swapped).mean(0) - alone
        rows["their mean as one schedule"] = rewards(searched, own.mean(0)) - alone
        reinforce = {what: rewards(sets["heldout"], times).mean().item()
                     for what, times in starts.items() if what.startswith("REINFORCE")}  # fmt: skip
        heldout = rewards(sets["heldout"], single)
        return dict(single=single.tolist(), single_heldout=heldout.tolist(), start=start,
                    tried=tried, reinforce=reinforce,
                    rows={row: values.tolist() for row, values in rows.items()})  # fmt: skip

    return cached(os.path.join(args.out_dir, name, f"L{steps}", "oracle.json"), compute)


def training(args, name, steps, kind, seed, found, control=None):
    """The ceiling (or its global twin) from the cell's best single schedule, on the preference
    reward or on a positive `control` (FEATURES) sized by the cell's gap: its held-out rewards
    and times, its validation history; for the ceiling itself also its average schedule's."""

    def compute():
        backbone, scorer, sets = load(name)
        start, heldout = torch.tensor(found["single"]), sets["heldout"]
        if control:
            scorer = Control(scorer, control, start, gap_of(found), heldout)
        stream = fresh_contexts(backbone, sets["prompts"], args.batch, seed)
        network = backbones.BACKBONES[name]["policy"]
        policy, history = train_ceiling(backbone, scorer, kind, steps, start, stream,
                                        sets["validation"], args.iterations, args.lr,
                                        network=network, seed=seed)  # fmt: skip
        with torch.no_grad():
            times = {kind: mean_times(policy, backbone, heldout)}
            if kind == "instance" and not control:  # its mean schedule over training contexts
                average = mean_times(policy, backbone, sets["training"]).mean(0)
                times["average"] = average.expand(len(heldout), -1)
        rows = {
            row: dict(reward=scorer.reward(heldout, value).tolist(), times=value.tolist())
            for row, value in times.items()
        }
        return dict(rows=rows, history=history)

    job = f"{control}-control-{kind}-seed{seed}" if control else f"{kind}-seed{seed}"
    return cached(os.path.join(args.out_dir, name, f"L{steps}", f"{job}.json"), compute)


# -----------------------------------------------------------------------------
# the rules and the report
def passes(control):
    """A positive control's row: instance - global at least CONTROL_SHARE of its built-in gap, its
    lower 95% bound above 0 (a nan fails)."""
    mean, half, gap = control["mean"], control["half"], control["gap"]
    return mean >= CONTROL_SHARE * gap and mean - half > 0


def verdict(rows, controls):
    """(conclusion, the rows that decide it). rows: one per cell, seed and contrast, with its paired
    "mean", the 95% half-width "half" and its cell's per-context "gap"; controls: one per cell,
    control and seed, with "mean", "half" and its built-in "gap". GAINS with the rows where a mean
    reaches ABSOLUTE or an upper bound SHARE x the gap (a nan bound breaks the rule); else
    UNCALIBRATED with the controls that fail; else NO_GAIN."""
    if not rows or not controls:
        raise ValueError("the rules need at least one row and one control")
    broken = [
        row
        for row in rows
        if not (row["mean"] < ABSOLUTE and row["mean"] + row["half"] < SHARE * row["gap"])
    ]
    if broken:
        return GAINS, broken
    failed = [control for control in controls if not passes(control)]
    return (UNCALIBRATED if failed else NO_GAIN), failed


def rewards_of(job):
    return {row: torch.tensor(values["reward"]) for row, values in job["rows"].items()}


def cell_lines(name, steps, found, trained, seeds, control_seeds):
    """A cell's tables (the ceiling per seed, the controls, the perturbations), its rows and its
    controls for verdict()."""
    gain = {row: torch.tensor(values) for row, values in found["rows"].items()}
    gap, gap_half = mean_ci(gain["own context"])
    single = torch.tensor(found["single_heldout"])
    reinforce = ", ".join(f"{value:.3f}" for value in found["reinforce"].values())
    lines = [
        f"\n{name}, L = {steps}: the per-context gap (own searched schedule - best single "
        f"schedule, first {len(gain['own context'])} held-out contexts) {gap:+.3f} ± "
        f"{gap_half:.3f}; the best single schedule {single.mean():.3f} on all {len(single)} "
        f"(fitted from {found['start']}; REINFORCE's global schedules {reinforce or 'not run'}); "
        f"the rule: means below {ABSOLUTE}, upper bounds below {SHARE * gap:.3f}",
        "",
        "| seed | instance | global | average | instance - global | instance - average | "
        "instance - best single | instance times' sd | kept step (instance, global) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows, controls = [], []
    for seed in seeds:
        runs = {kind: trained[kind, seed] for kind in KINDS}
        reward = rewards_of(runs["instance"]) | rewards_of(runs["global"])
        cells = []
        for contrast, other in zip(CONTRASTS, (reward["global"], reward["average"])):
            mean, half = mean_ci(reward["instance"] - other)
            rows.append(dict(backbone=name, steps=steps, seed=seed, contrast=contrast,
                             mean=mean, half=half, gap=gap))  # fmt: skip
            cells.append(f"{mean:+.3f} ± {half:.3f}")
        cells.append("{:+.3f} ± {:.3f}".format(*mean_ci(reward["instance"] - single)))
        spread = torch.tensor(runs["instance"]["rows"]["instance"]["times"]).std(0).max()
        kept = ", ".join(str(max(runs[k]["history"], key=lambda p: p[1])[0]) for k in KINDS)
        means = " | ".join(f"{reward[row].mean():.3f}" for row in ("instance", "global", "average"))
        lines.append(f"| {seed} | {means} | {' | '.join(cells)} | {spread:.3f} | {kept} |")
    lines += [
        "",
        f"Positive controls (built-in gap {gap:.3f}; a control passes where instance - global is "
        f"at least {CONTROL_SHARE * gap:.3f} with its lower bound above 0):",
        "",
        "| control | seed | instance | global | instance - global | share of the built-in gap | "
        "instance t_1's sd | passes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for control, seed in itertools.product(FEATURES, control_seeds):
        runs = {kind: trained[f"{control} control, {kind}", seed] for kind in KINDS}
        reward = rewards_of(runs["instance"]) | rewards_of(runs["global"])
        mean, half = mean_ci(reward["instance"] - reward["global"])
        controls.append(dict(backbone=name, steps=steps, control=control, seed=seed, mean=mean,
                             half=half, gap=gap))  # fmt: skip
        spread = torch.tensor(runs["instance"]["rows"]["instance"]["times"])[:, 1].std()
        lines.append(
            f"| {control} | {seed} | {reward['instance'].mean():.3f} | "
            f"{reward['global'].mean():.3f} | {mean:+.3f} ± {half:.3f} | {mean / gap:+.0%} | "
            f"{spread:.3f} | {'yes' if passes(controls[-1]) else 'no'} |"
        )
    lines += ["", "| schedule, against the best single one | gain (95%) | share of the gap |"]
    lines.append("|---|---|---|")
    for row, values in gain.items():
        mean, half = mean_ci(values)
        lines.append(f"| {row} | {mean:+.3f} ± {half:.3f} | {mean / gap:+.0%} |")
    return lines, rows, controls


def main(args):
    started = commit()
    this_commit_only(args.out_dir)  # no cache of other code is read
    cells = [(name, steps) for name in args.backbones for steps in args.steps]
    with ThreadPoolExecutor(args.jobs) as threads:  # REINFORCE's global runs, each in a worker
        runs = {cell: [threads.submit(reinforce_run, args, *cell, seed) for seed in args.seeds]
                for cell in cells}  # fmt: skip
        runs = {cell: [future.result() for future in futures] for cell, futures in runs.items()}
    trainings = [(kind, seed, None) for kind, seed in itertools.product(KINDS, args.seeds)]
    trainings += list(itertools.product(KINDS, args.control_seeds, FEATURES))
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        oracles = {pool.submit(oracle, args, *key, runs[key]): key for key in cells}
        found, pending = {}, {}
        for future in as_completed(oracles):  # a cell's trainings start from its best single
            key = oracles[future]
            found[key] = future.result()
            for kind, seed, control in trainings:
                job = (args, *key, kind, seed, found[key], control)
                row = f"{control} control, {kind}" if control else kind
                pending[key + (row, seed)] = pool.submit(training, *job)
        trained = {job: future.result() for job, future in pending.items()}
    lines = report(args, {key: found[key] for key in cells}, trained)
    print("\n".join(lines))
    record("ceiling", " ".join(["python -m evidence.ceiling", *sys.argv[1:]]), lines, at=started)


def report(args, found, trained):
    """The section: the rules, the setup, each cell's tables, the verdict and how it ran. found:
    (name, L) -> oracle(); trained: (name, L, row, seed) -> training(), row a kind or
    "<control> control, <kind>"."""
    rule = (
        f"The rules, fixed before the run: a positive control passes in a cell where in every "
        f"control seed its instance - global is at least {CONTROL_SHARE:.0%} of the built-in gap "
        f"with its lower 95% bound above 0. Where instance - global and instance - average are "
        f"below {ABSOLUTE} with their upper 95% bounds below {SHARE:.0%} of the cell's "
        f"per-context gap, for every seed in every cell, and every control passes: "
        f'"{NO_GAIN}"; where those rows hold and a control fails: "{UNCALIBRATED}"; where a row '
        f'breaks them: "{GAINS}" (REINFORCE\'s miss is then one of sample complexity).'
    )
    setup = (
        f"Every arm starts at the cell's best single schedule, its t_L included: instance_study's "
        f"fit ({SINGLE_ITERATIONS} Adam steps on batches of {SINGLE_BATCH} of {TRAINING} training "
        f"contexts) from the best of the time shifts, the uniform schedule and REINFORCE's global "
        f"schedules (seeds {args.seeds}, the miniature's defaults), kept where the fit loses. The "
        f"ceiling: the instance network trained on its mean schedule by the exact gradient of the "
        f"preference scorer (pixels before the rounding), Adam lr {args.lr}, {args.iterations} "
        f"steps of {args.batch} fresh contexts; the best of its iterates every {EVERY} steps on "
        f"{VALIDATION} validation contexts by the reward. Global: its twin on constant inputs, the "
        f"same start, contexts and budget. Average: the instance policy's mean schedule over "
        f"{TRAINING} training contexts, as one. Positive controls (seeds {args.control_seeds}): "
        f"both twins trained so on the reward plus -w (t_1 - c - d s)^2, s = +-1 the sign of x_T's "
        f'mean ("noise", a coarse signal of the noise) or the parity of the prompt\'s digit '
        f'("prompt"), c the start\'s t_1, d = min({DISTANCE}, half the room to t_0 and t_2), w '
        f"such that the term alone beats its best single schedule by the cell's per-context gap "
        f"on the held-out contexts; scored by that sum. Rewards on {HELDOUT} held-out contexts, "
        f"paired 95% intervals over them, per seed. Perturbations: each of the first {SEARCHED} "
        f"held-out contexts' own searched schedule ({SEARCH_ITERATIONS} Adam steps from the best "
        f"single one) against the best single one, on noise sqrt(1 - e^2) x + e z, on x_T with "
        f"its per-channel 2x2 block means or the rest taken from z, given to other contexts "
        f"({SWAPS} cyclic shifts), and their mean as one schedule."
    )
    lines, rows, controls = [rule, "", setup], [], []
    for key, cell in found.items():
        part = {row[2:]: job for row, job in trained.items() if row[:2] == key}
        table, cell_rows, cell_controls = cell_lines(
            *key, cell, part, args.seeds, args.control_seeds
        )
        lines += table
        rows += cell_rows
        controls += cell_controls
    conclusion, deciding = verdict(rows, controls)
    named = "; ".join(
        f"{row['backbone']} L = {row['steps']} seed {row['seed']} "
        f"{row.get('contrast') or row['control'] + ' control'} "
        f"{row['mean']:+.3f} ± {row['half']:.3f}"
        for row in deciding
    )
    lines += ["", f"Verdict: {conclusion}." + (f" Deciding: {named}." if deciding else "")]
    jobs = list(found.values()) + list(trained.values())
    read = sum(job["read"] for job in jobs)
    return lines + ["", f"{len(jobs) - read} of its {len(jobs)} jobs computed here, {read} read "
                    "from this code's earlier run (REINFORCE's global runs are the trainings "
                    "below)."]  # fmt: skip


if __name__ == "__main__":
    with one_line_errors():
        main(parser.parse_args())
