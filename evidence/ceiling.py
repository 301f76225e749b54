"""
A reward-trained ceiling for the instance policy class on the trained miniatures.
(docs/RESULTS.md, section "ceiling"). Where REINFORCE's instance policy equals its global schedule,
can any policy of the class gain? The class trained on the reward's own gradient, two controls, and
how the per-context searched schedules' gain survives a change of context; per miniature, L = 3:

- The ceiling: the instance network (policy.SchedulePolicy, the miniature's size) trained
  on its mean schedule (the Dirichlet mean) by the exact gradient of the preference scorer through
  the sampler and the VAE decode (the pixels before the reward's 8-bit rounding,
  instance_study.differentiable_score), Adam, each step on BATCH fresh contexts (a training prompt
  and a noise seed no step draws again) for ITERATIONS steps; scored every EVERY steps on
  VALIDATION tuning contexts by the reward itself (rounding included), the best iterate kept. It
  starts at the cell's best single schedule (instance_study's fit), the best single one known.
- The controls: its global twin (policy.GlobalPolicy) from the same start on the same contexts
  with the same budget, and the instance policy's average schedule (its mean schedule over the
  TRAINING tuning contexts, as one schedule). On HELDOUT held-out contexts, paired, per seed:
  instance - global and instance - average.
- Perturbation: each of the first SEARCHED held-out contexts' own searched schedule
  (instance_study.best_each from the best single schedule) against the best single schedule, on
  its own context (the per-context gap), on its noise perturbed, x' = sqrt(1 - e^2) x + e z for e
  in NOISE_LEVELS, given to other contexts (the mean over SWAPS cyclic shifts), and their mean
  used as one schedule: the share of the per-context gap each keeps.

The decision rule, fixed before any run: where instance - global and instance - average are below
ABSOLUTE with their upper 95% bounds below SHARE x the cell's per-context gap, for every seed in
every cell, "no policy of this class gains on these miniatures"; otherwise "the ceiling gains", and
REINFORCE's miss is one of sample complexity. verdict(rows) applies it.

Cost, an estimate: 6 steps of 32 contexts per miniature, timed on 2 cores that other runs kept
busy (load 3), took 0.25 (mini-sd3), 0.20 (mini-flux) and 0.37 s (mini-sdxl) a step, a validation
score 0.2-0.4 s; the 18 trainings of 800 steps (4,800 steps a cell) and each cell's oracles (300
steps of 64, 81 of 64, about 75 scorings of 64) come to about 80 min of one such core: about 40
min with --jobs 2, less on idle cores.

    python -m evidence.ceiling --jobs 2
    python -m evidence.ceiling --backbones mini-sd3 --seeds 0 --jobs 2   # a part of it

Cells and trainings that this commit finished are read, not repeated; the folder of another
commit's code is removed first (evidence.results.this_commit_only).
"""

import argparse
import itertools
import json
import logging
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

import torch

import backbones
from evaluate import POLICIES, mean_ci
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
    this_commit_only,
    write_json_atomic,
)
from miniatures.data import prompt_lists
from policy import make_policy
from prompts import HELDOUT_SEED, TUNING_SEED, context_noise, context_seed
from rewards import load_reward
from rewards.digits import digit_of

HELDOUT, TRAINING, VALIDATION, SEARCHED = 256, 256, 64, 64  # contexts (module docstring)
ITERATIONS, BATCH, LR, EVERY = 800, 32, 3e-3, 25  # the ceiling's training; validation interval

parser = argparse.ArgumentParser("python -m evidence.ceiling", description=__doc__.split("\n")[1])
add = parser.add_argument
add("--out-dir", default="out/ceiling", help="cells and trainings go below this")
add("--backbones", nargs="+", default=["mini-sd3", "mini-flux", "mini-sdxl"])
add("--steps", type=int, nargs="+", default=[3], help="the L of each cell")
add("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the ceiling's seeds")
add("--jobs", type=int, default=1, help="cells and trainings at the same time, one thread each")
add("--iterations", type=int, default=ITERATIONS, help="the ceiling's Adam steps")
add("--batch", type=int, default=BATCH, help="fresh contexts per step")
add("--lr", type=float, default=LR, help="the ceiling's Adam rate")

NOISE_LEVELS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # e of the perturbed noise
SWAPS = 4  # cyclic shifts of the searched schedules over the contexts
PERTURB_SEED = 3 * 10**6  # the noise z of the perturbation, apart from held-out and tuning seeds
KINDS = ("instance", "global")
# the decision rule (module docstring)
ABSOLUTE, SHARE = 0.05, 0.25
NO_GAIN, GAINS = "no policy of this class gains on these miniatures", "the ceiling gains"
CONTRASTS = ("instance - global", "instance - average")


# -----------------------------------------------------------------------------
# the objective, the contexts and the trainer
class Preference:
    """The preference reward of contexts sampled with their times (N, L+1): objective() with
    gradients to the times (the pixels before the 8-bit rounding), reward() as train.py scores."""

    def __init__(self, backbone, reward):
        self.backbone, self.model = backbone, reward

    def objective(self, contexts, times):
        return differentiable_score(self.backbone, self.model.scorer, contexts, times)

    def reward(self, contexts, times):
        return score(self.backbone, self.model, contexts, times)[0]


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


def train_ceiling(
    backbone, scorer, kind, steps, start_times, contexts_stream, validation, iterations=ITERATIONS,
    lr=LR, every=EVERY, network="embedded", seed=0,
):  # fmt: skip
    """The policy `kind` from the schedule start_times (L+1,), trained on its mean schedule: Adam on
    -scorer.objective of the next batch of contexts_stream; scored by scorer.reward on
    `validation` at the start, every `every` steps and at the end, the best iterate kept.
    Returns (the policy, in eval mode; [(step, mean validation reward)])."""
    torch.manual_seed(seed)
    policy = make_policy(POLICIES[kind], backbone.policy_dims, steps, start_times, network)
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


# -----------------------------------------------------------------------------
# the jobs: a cell's oracles and perturbations, and one training; each worker loads a miniature once
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
    """The job's result: read where this commit wrote it, else computed and written."""
    if os.path.isfile(path):
        with open(path) as file:
            return dict(json.load(file), read=True)
    result = compute()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, result)
    return dict(result, read=False)


def oracle(args, name, steps):
    """The best single schedule (instance_study's fit from the best shift or the uniform schedule),
    each searched context's own schedule, and per perturbation row its gain over the best single
    schedule per context."""

    def compute():
        backbone, scorer, sets = load(name)
        training, searched = sets["training"], sets["heldout"][:SEARCHED]

        def on(contexts):
            return lambda index, times: scorer.objective(contexts[index], times)

        def rewards(contexts, times):
            return scorer.reward(contexts, times.expand(len(contexts), -1))

        default = backbone.default_times(steps)
        starts = [shifted(default, s) for s in SHIFTS] + [torch.linspace(1, 0, steps + 1)]
        starts = [times_of(logits_of(times)) for times in starts]  # a policy's: t_0 = 1, t_L > 0
        tried = torch.stack([rewards(training, times).mean() for times in starts])
        start = starts[int(tried.argmax())]
        fit = best_single(on(training), len(training), start, SINGLE_ITERATIONS, SINGLE_BATCH, 0)
        single = next(fit)
        if rewards(training, single).mean() < tried.max():  # the fit lost: keep its start
            single = start
        alone = rewards(searched, single)
        found = next(best_each(on(searched), single.expand(len(searched), -1), SEARCH_ITERATIONS))
        better = scorer.reward(searched, found) > alone
        own = torch.where(better[:, None], found, single)  # the search, or its start where better
        rows = {"own context": scorer.reward(searched, own) - alone}
        z = context_noise(backbone, [PERTURB_SEED + i for i in range(len(searched))])
        for e in NOISE_LEVELS:
            noise = (1 - e**2) ** 0.5 * searched.noise + e * z
            moved = Contexts(searched.prompts, noise, searched.cond, searched.digits)
            rows[f"noise perturbed, e = {e}"] = scorer.reward(moved, own) - rewards(moved, single)
        swapped = [scorer.reward(searched, own.roll(shift, 0)) for shift in range(1, SWAPS + 1)]
        rows["given to other contexts"] = torch.stack(swapped).mean(0) - alone
        rows["their mean as one schedule"] = rewards(searched, own.mean(0)) - alone
        heldout = rewards(sets["heldout"], single)
        return dict(single=single.tolist(), single_heldout=heldout.tolist(),
                    rows={row: values.tolist() for row, values in rows.items()})  # fmt: skip

    return cached(os.path.join(args.out_dir, name, f"L{steps}", "oracle.json"), compute)


def training(args, name, steps, kind, seed, start):
    """The ceiling (or its global twin) from `start`: its held-out rewards and times, its
    validation history; for the instance policy also its average schedule's rewards."""

    def compute():
        backbone, scorer, sets = load(name)
        stream = fresh_contexts(backbone, sets["prompts"], args.batch, seed)
        network = backbones.BACKBONES[name]["policy"]
        policy, history = train_ceiling(backbone, scorer, kind, steps, torch.tensor(start), stream,
                                        sets["validation"], args.iterations, args.lr,
                                        network=network, seed=seed)  # fmt: skip
        heldout = sets["heldout"]
        with torch.no_grad():
            times = {kind: mean_times(policy, backbone, heldout)}
            if kind == "instance":  # its mean schedule over the training contexts, as one
                average = mean_times(policy, backbone, sets["training"]).mean(0)
                times["average"] = average.expand(len(heldout), -1)
        rows = {
            row: dict(reward=scorer.reward(heldout, value).tolist(), times=value.tolist())
            for row, value in times.items()
        }
        return dict(rows=rows, history=history)

    path = os.path.join(args.out_dir, name, f"L{steps}", f"{kind}-seed{seed}.json")
    return cached(path, compute)


# -----------------------------------------------------------------------------
# the rule and the report
def verdict(rows):
    """(conclusion, the rows that break the rule). rows: one per cell, seed and contrast, with its
    paired "mean", the 95% half-width "half" and its cell's per-context "gap"; NO_GAIN where every
    mean is below ABSOLUTE and every upper bound below SHARE x the gap (a nan bound breaks it)."""
    if not rows:
        raise ValueError("the rule needs at least one row")
    broken = [
        row
        for row in rows
        if not (row["mean"] < ABSOLUTE and row["mean"] + row["half"] < SHARE * row["gap"])
    ]
    return (GAINS if broken else NO_GAIN), broken


def cell_lines(name, steps, found, trained, seeds):
    """A cell's tables (the ceiling per seed, the perturbations) and its rows for verdict()."""
    gain = {row: torch.tensor(values) for row, values in found["rows"].items()}
    gap, gap_half = mean_ci(gain["own context"])
    single = torch.tensor(found["single_heldout"])
    lines = [
        f"\n{name}, L = {steps}: the per-context gap (own searched schedule - best single "
        f"schedule, first {len(gain['own context'])} held-out contexts) {gap:+.3f} ± "
        f"{gap_half:.3f}; the best single schedule {single.mean():.3f} on all {len(single)}; the "
        f"rule: means below {ABSOLUTE}, upper bounds below {SHARE * gap:.3f}",
        "",
        "| seed | instance | global | average | instance - global | instance - average | "
        "instance - best single | instance times' sd | kept step (instance, global) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for seed in seeds:
        runs = {kind: trained[kind, seed] for kind in KINDS}
        reward = {row: torch.tensor(values["reward"]) for run in runs.values()
                  for row, values in run["rows"].items()}  # fmt: skip
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
    lines += ["", "| schedule, against the best single one | gain (95%) | share of the gap |"]
    lines.append("|---|---|---|")
    for row, values in gain.items():
        mean, half = mean_ci(values)
        lines.append(f"| {row} | {mean:+.3f} ± {half:.3f} | {mean / gap:+.0%} |")
    return lines, rows


def main(args):
    started, clock = commit(), time.time()
    this_commit_only(args.out_dir)  # no cache of other code is read
    cells = [(name, steps) for name in args.backbones for steps in args.steps]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        oracles = {pool.submit(oracle, args, *key): key for key in cells}
        found, pending = {}, {}
        for future in as_completed(oracles):  # a cell's trainings start from its best single
            key = oracles[future]
            found[key] = future.result()
            for kind, seed in itertools.product(KINDS, args.seeds):
                job = (args, *key, kind, seed, found[key]["single"])
                pending[key + (kind, seed)] = pool.submit(training, *job)
        trained = {job: future.result() for job, future in pending.items()}
    lines = report(args, {key: found[key] for key in cells}, trained, started, clock)
    print("\n".join(lines))
    record("ceiling", " ".join(["python -m evidence.ceiling", *sys.argv[1:]]), lines, at=started)


def report(args, found, trained, started, clock):
    """The section: the rule, the setup, each cell's tables, the verdict and how it ran. found:
    (name, L) -> oracle(); trained: (name, L, kind, seed) -> training()."""
    rule = (
        f"The rule, fixed before the run: where instance - global and instance - average are "
        f"below {ABSOLUTE} with their upper 95% bounds below {SHARE:.0%} of the cell's per-context "
        f'gap, for every seed in every cell: "{NO_GAIN}"; otherwise "{GAINS}" (REINFORCE\'s miss '
        "is then one of sample complexity)."
    )
    setup = (
        f"The ceiling: the instance network trained on its mean schedule by the exact gradient of "
        f"the preference scorer (pixels before the rounding), Adam lr {args.lr}, {args.iterations} "
        f"steps of {args.batch} fresh contexts, from the cell's best single schedule; the best of "
        f"its iterates every {EVERY} steps on {VALIDATION} validation contexts by the reward. "
        f"Global: its twin on constant inputs, the same start, contexts and budget. Average: the "
        f"instance policy's mean schedule over {TRAINING} training contexts, as one. Rewards on "
        f"{HELDOUT} held-out contexts, paired 95% intervals over them, per seed. Perturbations: "
        f"each of the first {SEARCHED} held-out contexts' own searched schedule "
        f"({SEARCH_ITERATIONS} Adam steps from the best single one, itself fitted "
        f"{SINGLE_ITERATIONS} steps on batches of {SINGLE_BATCH} of {TRAINING} training contexts) "
        f"against the best single one, on noise sqrt(1 - e^2) x + e z, given to other contexts "
        f"({SWAPS} cyclic shifts), and their mean as one schedule."
    )
    lines, rows = [rule, "", setup], []
    for key, cell in found.items():
        part = {(kind, seed): trained[key + (kind, seed)] for kind in KINDS for seed in args.seeds}
        table, cell_rows = cell_lines(*key, cell, part, args.seeds)
        lines += table
        rows += cell_rows
    conclusion, broken = verdict(rows)
    beyond = "; ".join(
        f"{row['backbone']} L = {row['steps']} seed {row['seed']} {row['contrast']} "
        f"{row['mean']:+.3f} ± {row['half']:.3f}"
        for row in broken
    )
    lines += ["", f"Verdict: {conclusion}." + (f" Beyond the rule: {beyond}." if broken else "")]
    jobs = list(found.values()) + list(trained.values())
    read, minutes = sum(job["read"] for job in jobs), (time.time() - clock) / 60
    return lines + ["", f"Ran at {started} in {minutes:.0f} min with {args.jobs} worker "
                    f"process(es) on {os.cpu_count()} cores: {len(jobs) - read} of its {len(jobs)} "
                    f"jobs computed here, {read} read from this commit's earlier run."]  # fmt: skip


if __name__ == "__main__":
    with one_line_errors():
        main(parser.parse_args())
