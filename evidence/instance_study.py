"""
Could any instance policy gain on the trained miniatures, and does the learned one take it?
(docs/RESULTS.md, section "instance"). For each miniature and L, on HELDOUT held-out contexts
(held-out paraphrases, fresh noise; each context's own search on the first SEARCHED of them), every
row scored by the preference reward, realism beside it:

- Oracles in two families. Time shifts of the default schedule (evidence.ablation's SHIFTS), and
  full schedules, the policy's own action space. Each as the best single schedule, chosen on
  training contexts, and as each context's own best, chosen on the context itself (hindsight).
  Sampler and reward are deterministic given the context and the schedule, so each context's own
  best is reachable by a policy that predicts it: the per-instance gap, each context's best minus
  the best single schedule, is what any instance policy could gain at most, where the best single
  schedule was found (its checks below).
- The learnable share: the instance policy's own network and inputs (policy.SchedulePolicy on the
  initial noise and the prompt's embeddings) trained supervised to output each training context's
  best full schedule (the Dirichlet likelihood of it), scored at its mean, for growing numbers of
  training contexts; the step with the best likelihood on validation contexts is kept. Beside it
  the same network on constant inputs (policy.GlobalPolicy), fitted the same way: what the targets
  alone give, their average, so that the share is what the inputs add to it; and the network
  reading a richer input as well: the denoiser's first prediction of the clean sample from x_T
  (one model call more per sample).
- What REINFORCE takes: train.py with the miniature's defaults, instance and global, over SEEDS;
  the instance policy's times averaged over training contexts into one schedule; and, at L =
  BUDGET_STEPS, the instance policy with BUDGET times the iterations and the rollouts, to see
  whether more training changes it.

The full schedules are found by gradient ascent through the sampler, the VAE and the preference
scorer (all differentiable): times from a softmax over the L+1 increments, Adam, the scorer reading
the decoded pixels before the 8-bit rounding the reward applies. The best single schedule is fitted
on random batches of training contexts from the best, on them, of the best single shift, the uniform
schedule and REINFORCE's global schedules (a local search stays in its basin), and is that start
where the fit does not beat it there (the gradient of the scorer on pixels before their rounding can
lead away from a better schedule); its fit continued for as many iterations again (the same
batch stream) and REINFORCE's global schedule are the checks that it was found; the section says
where one of them is above it beyond the interval. Each context's own search starts from it and
keeps the best schedule it met, scored by the reward itself; continued for as many iterations
again, the change in its mean is the convergence check. Each context's best found is a lower bound
on its true best; the gap is one too only where the best single schedule was found.

    python -m evidence.instance_study --jobs 2   # 3 miniatures x L = 2, 3, 4; its time recorded
    python -m evidence.instance_study --backbones mini-sdxl --steps 2 --jobs 2   # a part of it

Trainings and cells (oracles.json) that this commit finished are read, not repeated; the folder of
another commit's code is removed first (evidence.results.this_commit_only).
"""

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context

import torch

import backbones
from evaluate import load_policy, mean_ci
from evidence.ablation import SHIFTS, shifted
from evidence.results import (
    REPOSITORY,
    commit,
    one_line_errors,
    record,
    run_training,
    this_commit_only,
    write_json_atomic,
)
from miniatures.data import prompt_lists
from miniatures.realism import realism_measure
from policy import (
    GlobalPolicy,
    SchedulePolicy,
    increments_from_times,
    log_prob,
    make_policy,
    mean_increments,
    times_from_increments,
)
from prompts import HELDOUT_SEED, TUNING_SEED, context_noise, heldout_contexts
from rewards import load_reward
from rewards.digits import digit_of

parser = argparse.ArgumentParser(
    "python -m evidence.instance_study", description=__doc__.split("\n")[1]
)
add = parser.add_argument
add("--out-dir", default="out/instance-study", help="cells and trainings go below this")
add("--backbones", nargs="+", default=["mini-sd3", "mini-flux", "mini-sdxl"])
add("--steps", type=int, nargs="+", default=[2, 3, 4], help="the L of each cell")
add("--seeds", type=int, nargs="+", default=[0, 1, 2], help="REINFORCE and supervised seeds")
add("--jobs", type=int, default=1, help="cells and trainings at the same time, one thread each")

HELDOUT, TRAINING, VALIDATION = 256, 256, 64  # contexts: held-out, training oracles, validation
# the first held-out contexts, each searched for its own best: the gap's interval about doubles
SEARCHED = 64  # (mini-sd3's ±0.035 on all 256 to ±0.07), small beside gaps of 0.2-0.8
SIZES = (32, 64, 128, 256)  # the supervised predictor's numbers of training contexts
SINGLE_ITERATIONS, SINGLE_BATCH = 300, 64  # the best single schedule's fit, from the best shift
SEARCH_ITERATIONS, LR, STOP_MARGIN = 80, 0.1, 5e-3  # each context's search; its start's t_L
UPDATES, BATCH, PREDICTOR_LR = 600, 64, 1e-3  # the supervised predictor
BUDGET, BUDGET_STEPS = 2, 3  # "more training": 2 x the iterations and rollouts, at L = 3
EXAMPLES = 6  # contexts drawn in the figure
EVALUATED = 16  # train.py's held-out table (no realism): the section scores the checkpoints itself
# single schedules found otherwise, which the best single schedule must not fall below
CHECKS = ("best single schedule, twice the iterations", "REINFORCE global")


# -----------------------------------------------------------------------------
# contexts and scores
class Contexts:
    """Contexts as the samplers take them: prompts, their noise, text conditioning and the digit
    each prompt asks for; `of(backbone, prompts, count, seed)` draws `count` of them, prompts
    cycling, noise seeds from `seed`."""

    def __init__(self, prompts, noise, cond, digits):
        self.prompts, self.noise, self.cond, self.digits = prompts, noise, cond, digits

    @classmethod
    def of(cls, backbone, prompts, count, seed):
        prompts, seeds = heldout_contexts(prompts, count, seed)
        digits = torch.tensor([digit_of(prompt) for prompt in prompts])
        noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
        return cls(prompts, noise, cond, digits)

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, index):
        """The contexts `index` (a slice or a tensor of positions)."""
        picked = range(len(self))[index] if isinstance(index, slice) else index.tolist()
        cond = {key: value[index] for key, value in self.cond.items()}
        prompts = [self.prompts[i] for i in picked]
        return Contexts(prompts, self.noise[index], cond, self.digits[index])


def batches(count, size=128):
    return [torch.arange(start, min(start + size, count)) for start in range(0, count, size)]


def differentiable_score(backbone, scorer, contexts, times):
    """The preference scorer's score (N,) of the samples of `times` (N, L+1), with gradients to
    the times: the pixels before the reward's 8-bit rounding."""
    latents = backbone.sample(contexts.noise, contexts.cond, times)
    images = (backbone.decode_raw(latents).float() / 2 + 0.5).clamp(0, 1)
    return scorer(images).float().gather(1, contexts.digits[:, None]).squeeze(1)


@torch.no_grad()
def score(backbone, reward, contexts, times):
    """The reward (N,) of each context sampled with its times (N, L+1), and its 8-bit images."""
    scores, images = [], []
    for index in batches(len(contexts)):
        part = contexts[index]
        latents = backbone.sample(part.noise, part.cond, times[index])
        scores.append(reward.details(latents, part.prompts)[0].cpu())
        images.append(reward.pixels(latents).cpu())
    return torch.cat(scores), torch.cat(images)


# -----------------------------------------------------------------------------
# oracles
def logits_of(times, margin=STOP_MARGIN):
    """The increments' logits of schedules (..., L+1), t_0 raised to 1 (learned schedules start
    from pure noise, as policy.initial_logits does) and t_L to at least `margin`."""
    times = times.double().clone()
    times[..., 0] = 1.0
    increments = increments_from_times(times)
    increments[..., -1] = increments[..., -1].clamp_min(margin)
    return (increments / increments.sum(-1, keepdim=True)).log().float()


def times_of(logits):
    return times_from_increments(torch.softmax(logits, -1))


def best_single(objective, count, start, iterations, batch, seed, margin=STOP_MARGIN):
    """One schedule (L+1,) maximising the mean of objective(index, times) over `count` contexts:
    Adam from the schedule `start` (its t_L raised to `margin`) on random batches of `batch`
    contexts. Yields it after `iterations` steps, then after each `iterations` more: the same fit
    continued."""
    logits = logits_of(start, margin).requires_grad_(True)
    optimizer = torch.optim.Adam([logits], lr=LR)
    generator = torch.Generator().manual_seed(seed)
    while True:
        for _ in range(iterations):
            index = torch.randperm(count, generator=generator)[:batch]
            loss = -objective(index, times_of(logits).expand(len(index), -1)).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        yield times_of(logits.detach())


def best_each(objective, starts, iterations, margin=STOP_MARGIN):
    """Each context's own schedule (N, L+1) maximising objective(index, times) (N,) for it: Adam
    from `starts` (N, L+1; t_L raised to `margin`), batch by batch, keeping the best schedule each
    context met. Yields it after `iterations` steps, then after each `iterations` more: the same
    searches continued."""
    found, searches = starts.clone(), []
    for index in batches(len(starts)):
        logits = logits_of(starts[index], margin).requires_grad_(True)
        best = torch.full((len(index),), -float("inf"))
        searches.append((index, logits, torch.optim.Adam([logits], lr=LR), best))
    passes = iterations + 1  # a pass scores the current step, then takes the next
    while True:
        for index, logits, optimizer, best in searches:
            for _ in range(passes):
                times = times_of(logits)
                values = objective(index, times)
                better = values.detach() > best
                best.copy_(torch.where(better, values.detach(), best))
                found[index] = torch.where(better[:, None], times.detach(), found[index])
                optimizer.zero_grad(set_to_none=True)
                (-values.sum()).backward()  # each context's logits see only their own score
                optimizer.step()
        yield found.clone()
        passes = iterations  # the step after the last one scored is taken


# -----------------------------------------------------------------------------
# the learnable share
@torch.no_grad()
def first_prediction(backbone, contexts):
    """The denoiser's prediction of the clean sample from x_T at t = 1, in the policy's image layout
    (one model call): x - s * derivative, as rollout.run_schedule's first step sees it."""
    start = torch.ones(len(contexts))
    derivative, state, level = backbone.ode(contexts.noise, contexts.cond, start)
    sigma = (level or (lambda t: t))(start).float().view(-1, *[1] * (state.dim() - 1))
    return backbone.as_image(state - sigma * derivative(state, start).float()).float()


def predictor_inputs(backbone, contexts, richer):
    """The instance policy's inputs of the contexts; `richer`: the first prediction beside x_T."""
    inputs = backbone.policy_inputs(contexts.noise, contexts.cond)
    if richer:
        inputs["latent"] = torch.cat([inputs["latent"], first_prediction(backbone, contexts)], 1)
    return inputs


def fit_predictor(policy, inputs, targets, validation, validation_targets, seed):
    """Train `policy` to output each context's target schedule (N, L+1): Adam on the Dirichlet
    negative log-likelihood of the target increments; the weights of the step with the best
    validation likelihood (checked every 25 steps) are kept."""
    torch.manual_seed(seed)
    goal, held_goal = increments_from_times(targets), increments_from_times(validation_targets)
    optimizer = torch.optim.Adam(policy.parameters(), lr=PREDICTOR_LR)
    generator = torch.Generator().manual_seed(seed)
    best, kept = float("inf"), None
    for update in range(UPDATES + 1):
        if update % 25 == 0:
            with torch.no_grad():
                loss = -log_prob(policy(**validation), held_goal[:, None]).mean().item()
            if loss < best:
                best, kept = loss, {k: v.clone() for k, v in policy.state_dict().items()}
        index = torch.randperm(len(goal), generator=generator)[:BATCH]
        alpha = policy(**{key: value[index] for key, value in inputs.items()})
        loss = -log_prob(alpha, goal[index][:, None]).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    policy.load_state_dict(kept)
    return policy.eval()


# -----------------------------------------------------------------------------
# the trainings
def run_dir(args, name, steps, kind, seed):
    return os.path.join(args.out_dir, name, f"L{steps}", f"{kind}-seed{seed}")


def trainings(args):
    """train.py's runs per cell: the defaults, instance and global, and at L = BUDGET_STEPS the
    instance policy with BUDGET x the iterations and the rollouts; each seed."""
    return [
        (name, steps, kind, seed)
        for name in args.backbones
        for steps in args.steps
        for kind in kinds(steps)
        for seed in args.seeds
    ]


def kinds(steps):
    return ("instance", "global") + (("instance-budget",) if steps == BUDGET_STEPS else ())


def train(args, run):
    from train import PRESETS  # the miniature's defaults, which the budget multiplies

    name, steps, kind, seed = run
    flags = ["--backbone", name, "--steps", str(steps), "--seed", str(seed), "--without-realism"]
    flags += ["--policy", kind.split("-")[0], "--eval-contexts", str(EVALUATED)]
    if kind == "instance-budget":
        preset = PRESETS[name]
        flags += ["--iterations", str(BUDGET * preset["iterations"])]
        flags += ["--rollouts", str(BUDGET * preset["rollouts"])]
    return run_training(run_dir(args, name, steps, kind, seed), flags)


# -----------------------------------------------------------------------------
# one cell: a miniature at one L
def cell(args, name, steps):
    """The oracles, the supervised predictors and the trained policies of one miniature at one L on
    the held-out contexts: each row's reward per context, its times and realism; in oracles.json."""
    path = os.path.join(args.out_dir, name, f"L{steps}", "oracles.json")
    if os.path.isfile(path):
        with open(path) as file:
            return json.load(file)
    torch.set_num_threads(1)
    backbone = backbones.load_backbone(name)
    reward = load_reward("preference", backbone)
    train_prompts, heldout_prompts = prompt_lists()
    heldout = Contexts.of(backbone, heldout_prompts, HELDOUT, HELDOUT_SEED)
    contexts = Contexts.of(backbone, train_prompts, TRAINING + VALIDATION, TUNING_SEED)
    training, validation = contexts[:TRAINING], contexts[TRAINING:]
    realism, rows = realism_measure(), {}

    def objective(contexts):
        return lambda index, times: differentiable_score(
            backbone, reward.scorer, contexts[index], times
        )

    def scored(times, contexts=heldout):
        times = times.expand(len(contexts), -1) if times.dim() == 1 else times
        return times, *score(backbone, reward, contexts, times)

    def add(row, times, contexts=heldout):
        times, scores, images = scored(times, contexts)
        rows[row] = dict(reward=scores.tolist(), times=times.tolist(), **realism(images))
        return scores

    def own_best(contexts, single, iterations):
        """Each context's best: its own search's schedule, or the single one where that scores
        higher by the reward; after `iterations` steps, then after each `iterations` more."""
        alone = scored(single, contexts)[1]
        for found in best_each(objective(contexts), single.expand(len(contexts), -1), iterations):
            better = scored(found, contexts)[1] > alone
            yield torch.where(better[:, None], found, single)

    default = backbone.default_times(steps)
    add("default", default)
    shifts = torch.stack([shifted(default, s) for s in SHIFTS])  # (S, L+1)
    fitted = torch.stack([scored(times, training)[1].mean() for times in shifts])
    per_shift = torch.stack([scored(times)[1] for times in shifts])  # (S, N)
    best_shift = shifts[int(fitted.argmax())]
    add("best single shift", best_shift)
    add("per-context best shift", shifts[per_shift.argmax(0)])
    # restarts: the fit starts from the best, on training contexts, of the best shift, the
    # uniform schedule and REINFORCE's global schedules (a local search stays in its basin)
    starts = {"best shift": best_shift, "uniform": torch.linspace(1, 0, steps + 1)}
    trained = reinforce_rows(args, name, steps, backbone, reward, heldout, training, realism)
    for seed in args.seeds:  # a global policy's schedule is the same for every context
        row = f"REINFORCE global, seed {seed}"
        starts[row] = torch.tensor(trained[row]["times"][0])
    tried = {what: scored(times, training)[1].mean().item() for what, times in starts.items()}
    start = starts[max(tried, key=tried.get)]
    fit = best_single(objective(training), TRAINING, start, SINGLE_ITERATIONS, SINGLE_BATCH, 0)
    single, longer = next(fit), next(fit)  # the fit, and it continued as long again
    if scored(single, training)[1].mean() < max(tried.values()):  # the fit lost: keep its start
        single = start
    add("best single schedule", single)
    add("best single schedule, twice the iterations", longer)
    searched = heldout[:SEARCHED]
    search = own_best(searched, single, SEARCH_ITERATIONS)
    found = add("per-context best schedule", next(search), searched)
    same = realism(scored(single, searched)[2])["frechet"]  # the distance depends on the count
    rows["per-context best schedule"]["single frechet"] = same
    convergence = (scored(next(search), searched)[1] - found).tolist()
    targets = next(own_best(training, single, SEARCH_ITERATIONS))
    validation_targets = next(own_best(validation, single, SEARCH_ITERATIONS))
    preset, largest = backbones.BACKBONES[name]["policy"], SIZES[-1]
    for seed in args.seeds:  # what the predictor gets from the targets alone: their average
        policy = make_policy(GlobalPolicy, backbone.policy_dims, steps, single, preset)
        inputs = predictor_inputs(backbone, training[:largest], False)
        held = predictor_inputs(backbone, validation, False)
        fit_predictor(policy, inputs, targets[:largest], held, validation_targets, seed)
        with torch.no_grad():
            times = policy.times(backbone, heldout.noise, heldout.cond)
        add(f"supervised (constant inputs), {largest} contexts, seed {seed}", times)
    for richer in (False, True):
        dims = dict(backbone.policy_dims)
        dims["latent_channels"] *= 2 if richer else 1
        inputs = predictor_inputs(backbone, training, richer)
        held = predictor_inputs(backbone, validation, richer)
        test = predictor_inputs(backbone, heldout, richer)
        for size in SIZES[-1:] if richer else SIZES:
            for seed in args.seeds:
                policy = make_policy(SchedulePolicy, dims, steps, single, preset)
                first = {key: value[:size] for key, value in inputs.items()}
                fit_predictor(policy, first, targets[:size], held, validation_targets, seed)
                with torch.no_grad():
                    times = times_from_increments(mean_increments(policy(**test)))
                what = "noise, prompt and first prediction" if richer else "noise and prompt"
                add(f"supervised ({what}), {size} contexts, seed {seed}", times)
    rows.update(trained)
    result = dict(rows=rows, convergence=convergence, starts=tried)
    write_json_atomic(path, result)
    return result


@torch.no_grad()
def reinforce_rows(args, name, steps, backbone, reward, heldout, training, realism):
    """The trained policies' rows on the held-out contexts (read from their checkpoints): the
    instance policy, its times averaged over training contexts, the global one, the budget's."""
    rows = {}
    for kind in kinds(steps):
        for seed in args.seeds:
            folder = run_dir(args, name, steps, kind, seed)
            policy = load_policy(os.path.join(folder, "ckpt.pt"))[0]
            schedules = {f"REINFORCE {kind}": policy.times(backbone, heldout.noise, heldout.cond)}
            if kind == "instance":  # its times over training contexts, averaged
                mean = policy.times(backbone, training.noise, training.cond).mean(0)
                schedules["REINFORCE instance averaged"] = mean.expand(HELDOUT, -1)
            for row, times in schedules.items():
                scores, images = score(backbone, reward, heldout, times)
                rows[f"{row}, seed {seed}"] = dict(
                    reward=scores.tolist(), times=times.tolist(), **realism(images)
                )
    return rows


# -----------------------------------------------------------------------------
# the report
def grouped(rows):
    """Rows of several seeds as one: name -> [row of each seed]."""
    groups = {}
    for row, values in rows.items():
        groups.setdefault(row.split(", seed ")[0], []).append(values)
    return groups


def cell_lines(name, steps, rows, convergence, starts=None):
    """The cell's table: per row its mean reward (mean over seeds, their range), the paired gain
    over the best single schedule with its 95% interval over the contexts (per context, the mean
    over seeds; a row on the first n contexts, on those), the share of the per-instance gap, and
    realism (Frechet distance; a row on n contexts: beside the best single schedule's on them,
    "single frechet"); then what twice the search's iterations add (convergence: per searched
    context), and the best single schedule's starts (their mean reward on training contexts)."""
    groups = grouped(rows)
    reward = {row: torch.tensor([v["reward"] for v in members]) for row, members in groups.items()}
    single = reward["best single schedule"][0]
    own = reward["per-context best schedule"][0]
    gap = (own - single[: len(own)]).mean().item()
    lines = [
        f"\n{name}, L = {steps}",
        "",
        "| row | preference reward | - best single schedule (paired 95%) | share of the "
        "per-instance gap | Frechet distance |",
        "|---|---|---|---|---|",
    ]
    for row, values in reward.items():
        means = values.mean(1)
        spread = f" ({means.min():.3f} to {means.max():.3f})" if len(means) > 1 else ""
        label, count = row, values.shape[1]
        difference, half = mean_ci(values.mean(0) - single[:count])
        frechet = f"{sum(v['frechet'] for v in groups[row]) / len(groups[row]):.3f}"
        if count < len(single):  # a row on the first contexts only
            label += f", first {count} contexts"
            frechet += f" (best single schedule {groups[row][0]['single frechet']:.3f})"
        lines.append(
            f"| {label} | {means.mean():.3f}{spread} | {difference:+.3f} ± {half:.3f} | "
            f"{difference / gap:+.0%} | {frechet} |"
        )
    more, half = mean_ci(torch.tensor(convergence))
    blind = reward.get(f"supervised (constant inputs), {SIZES[-1]} contexts")
    lines.append("")
    for what in ("noise and prompt", "noise, prompt and first prediction"):
        seen = reward.get(f"supervised ({what}), {SIZES[-1]} contexts")
        if seen is not None and blind is not None:
            share, spread = mean_ci(seen.mean(0) - blind.mean(0))
            lines.append(
                f"- learnable share, {what}: supervised minus the same fit on constant inputs, "
                f"{share:+.3f} ± {spread:.3f} ({share / gap:+.0%} of the gap)"
            )
    lines += [
        f"- convergence: the search continued to twice its iterations adds {more:+.3f} ± "
        f"{half:.3f} on its {len(convergence)} contexts ({more / gap:+.0%} of the gap)",
    ]
    if starts:
        tried = ", ".join(f"{what} {value:.3f}" for what, value in starts.items())
        lines.append(
            f"- the best single schedule's starts, mean reward on training contexts: {tried}"
        )
    checks = [row for row in CHECKS if row in reward]  # what the best single schedule must beat
    if checks:
        beyond = {row: mean_ci(reward[row].mean(0) - single) for row in checks}
        above = [row for row, (mean, half) in beyond.items() if mean - half > 0]
        found = ", ".join(f"{row} {mean:+.3f} ± {half:.3f}" for row, (mean, half) in beyond.items())
        verdict = (
            f"not found: {' and '.join(above)} above it beyond the interval, so the per-context "
            "searches started below the best single schedule and the gap is no bound"
            if above
            else "none of them above it beyond the interval"
        )
        lines.append(f"- the best single schedule against its checks ({found}): {verdict}")
    return lines


def plot(path, results):
    """For EXAMPLES held-out contexts of each miniature at its middle L: each one's best schedule
    against the best single one."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(4.5 * len(results), 3.8), layout="tight")
    panels = figure.subplots(1, len(results), squeeze=False)[0]
    for axes, ((name, steps), rows) in zip(panels, results.items()):
        own = torch.tensor(rows["per-context best schedule"]["times"][:EXAMPLES])
        single = torch.tensor(rows["best single schedule"]["times"][0])
        for index, times in enumerate(own):
            axes.plot(range(steps + 1), times, "-o", markersize=3, label=f"context {index}")
        axes.plot(range(steps + 1), single, "k--", linewidth=2, label="best single")
        axes.set(title=f"{name}, L = {steps}", xlabel="step l", ylabel="t_l")
        axes.legend(fontsize=6)
    figure.savefig(path, dpi=110)


def main(args):
    started = commit()
    this_commit_only(args.out_dir)  # no cache of other code is read
    cells = [(name, steps) for name in args.backbones for steps in args.steps]
    with ThreadPoolExecutor(args.jobs) as threads:
        list(threads.map(lambda run: train(args, run), trainings(args)))
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as processes:
        longest = sorted(cells, key=lambda key: -key[1])  # first: no long cell left to the end
        made = {key: processes.submit(cell, args, *key) for key in longest}
        results = {key: made[key].result() for key in cells}
    lines = [
        f"{HELDOUT} held-out contexts (held-out paraphrases, fresh noise) per cell, the first "
        f"{SEARCHED} of them each searched for its own best schedule: the per-context best row and "
        "the per-instance gap (it minus the best single schedule) are on those; trained rows over "
        f"seeds {args.seeds} (mean, range). The oracles search by gradient ascent (Adam, lr {LR}): "
        f"the best single schedule {SINGLE_ITERATIONS} steps from the best start (each cell lists "
        f"them) on batches of {SINGLE_BATCH} of {TRAINING} training contexts, each context's own "
        f"schedule {SEARCH_ITERATIONS} steps from it; each checked by the same fit or searches "
        "continued as many steps again (the row with twice the steps, the convergence line). "
        f"Supervised: the instance network fitted to the own best schedules of {TRAINING} training "
        f"contexts ({UPDATES} Adam steps, the best of {VALIDATION} validation contexts). "
        f"REINFORCE: train.py's defaults; the budget row (L = {BUDGET_STEPS}) {BUDGET}x the "
        "iterations and the rollouts."
    ]
    for key, result in results.items():
        lines += cell_lines(*key, result["rows"], result["convergence"], result.get("starts"))
    middle = args.steps[len(args.steps) // 2]
    middle = {key: result["rows"] for key, result in results.items() if key[1] == middle}
    plot(os.path.join(REPOSITORY, "docs", "instance.png"), middle)
    figure = "Each context's best schedule against the best single one: [docs/instance.png]"
    lines += ["", figure + "(instance.png)"]
    print("\n".join(lines))
    command = " ".join(["python -m evidence.instance_study", *sys.argv[1:]])
    record("instance", command, lines, at=started)


if __name__ == "__main__":
    with one_line_errors():
        main(parser.parse_args())
