"""
Everything train.py does around its loop that is not the method: check the configuration, pick the
ranks and devices, take the run folder, open the frozen backbone with the prompts checked against
it, build the policy, continue a checkpoint; in the loop, gather the rewards, log and checkpoint;
at the end write the held-out report.

Bad input fails here in one line (SystemExit "error: ..."), before anything heavy is loaded, and
nothing a run folder already holds is changed by a refused start.
"""

import contextlib
import dataclasses
import json
import math
import os
import types

import torch
import torch.distributed as dist

from backbones import BACKBONES, make_policy, update_cost
from baselines import MIN_CONTEXTS
from checkpoints import (
    WriteFailed,
    check_backbone_files,
    check_reward_files,
    check_writable,
    claim_run,
    existing_run,
    metric_rows,
    read_json,
    restore,
    save_checkpoint,
    save_policy,
    trained_backbone,
    write_failed,
    write_json_atomic,
)
from evaluate import (
    default_schedule,
    evaluate,
    format_table,
    policy_schedule,
    summarize,
)
from figures import context_labels, plot_training
from miniature import realism_measure
from prompts import DEFAULT, SHIPPED, context_noise, heldout_contexts, load_prompt_file
from realism import realism_table
from rewards import IMAGE_CONTENT, check_digits, check_prompts

LEAST = dict(
    steps=1,
    rollouts=2,
    iterations=1,
    ckpt_interval=1,
    log_interval=1,
    ppo_epochs=1,
    ppo_minibatches=1,
    eval_contexts=1,
    rollout_batch=1,
    resolution=8,
    threads=1,
)


GAIN_CONTEXTS = 32  # held-out contexts of the gain logged at each checkpoint (heldout_gain)
# a larger seed would take the training contexts' noise seeds (prompts.context_seed) past 2^63
MAX_SEED = 2**27


# -----------------------------------------------------------------------------
# the start: checks, ranks, the run folder, what the run trains


def _fail(message):
    raise SystemExit(f"error: {message}")


@contextlib.contextmanager
def written(path=None):
    """Writes to the run folder: one that fails (disk full, read-only storage) ends in one line
    naming the folder (checkpoints.write_failed); the last good checkpoint stays as it was."""
    try:
        yield
    except WriteFailed as error:
        _fail(error)
    except OSError as error:
        _fail(write_failed(error.filename or path, error))


def finished(config, checkpoint):
    """Whether out_dir holds this run, finished: its last checkpoint and its held-out report."""
    done = checkpoint is not None and checkpoint["iteration"] >= config.iterations
    return done and os.path.isfile(os.path.join(config.out_dir, "eval.json"))


def default_prompts(config):
    """The (training, held-out) prompt files a run uses unless told: the miniatures' paraphrases,
    the shipped set of the reward for the other real backbones, None (the built-in prompts) for the
    embedded ones."""
    spec = BACKBONES[config.backbone]
    if spec["family"] == "mixture":
        return None, None
    return spec.get("prompts") or SHIPPED.get(config.reward, DEFAULT)


def check_config(config, world_size):
    """What argparse cannot say fails here in one line, before anything heavy is loaded; fills the
    prompt files and the thread count. Returns the training and held-out prompts (None: the
    backbone's own) and the checkpoint out_dir already holds (or None)."""
    least = dict(LEAST, contexts=MIN_CONTEXTS[config.baseline])
    for key, minimum in least.items():
        value = getattr(config, key)
        if value is not None and value < minimum:
            why = {
                "rollouts": " for a leave-one-out baseline",
                "contexts": f" for --baseline {config.baseline}",
            }.get(key, "")
            _fail(f"--{key.replace('_', '-')} must be at least {minimum}{why} (got {value})")
    # True: must be > 0, False: >= 0
    strict = dict(
        lr=True,
        grad_clip=True,
        ppo_clip=True,
        adam_eps=True,
        concentration=True,
        weight_decay=False,
        guidance=False,
    )
    for key, positive in strict.items():
        value = getattr(config, key)
        if value is not None and not (
            math.isfinite(value) and (value > 0 if positive else value >= 0)
        ):
            bound = "> 0" if positive else ">= 0"
            _fail(f"--{key.replace('_', '-')} must be a finite number {bound} (got {value})")
    if config.adam_beta2 is not None and not 0 <= config.adam_beta2 < 1:
        _fail(f"--adam-beta2 must be in [0, 1) (got {config.adam_beta2})")
    if not 0 <= config.seed < MAX_SEED:
        _fail(f"--seed must be an integer from 0 to {MAX_SEED - 1:,} (got {config.seed})")
    if config.device == "cuda" and not torch.cuda.is_available():
        _fail(
            f"--device cuda, but this machine has no CUDA device (torch {torch.__version__}); drop "
            "--device to run on the CPU"
        )
    spec = BACKBONES[config.backbone]
    if config.guidance is not None and spec["guidance"] is None:
        _fail(
            f"--guidance {config.guidance}: {config.backbone} has no guidance input and runs no "
            "CFG (as FLUX.1-schnell, or an exact mixture); drop --guidance"
        )
    stepwise_only = dict(init="tpdm", policy_inputs="hidden", inference="mode")
    for key, value in stepwise_only.items():
        if config.policy != "stepwise" and getattr(config, key) == value:
            flag = "--" + key.replace("_", "-")
            _fail(f"{flag} {value} is the step-wise policy's, not the {config.policy} policy's")
    if config.policy_inputs == "hidden" and spec["family"] == "mixture":
        _fail(
            f"--policy-inputs hidden reads a denoiser's hidden states; {config.backbone} is an "
            "exact mixture with none: use --policy-inputs sampler"
        )
    config.threads = config.threads or spec["threads"]
    if config.threads and config.threads > (os.cpu_count() or 1):
        print(
            f"note: --threads {config.threads} is more than the {os.cpu_count()} CPU cores; using "
            f"{os.cpu_count()}"
        )
        config.threads = os.cpu_count()
    if config.contexts % world_size:
        _fail(
            f"--contexts {config.contexts} is not divisible by the {world_size} ranks; choose a "
            "multiple of the number of processes"
        )
    if spec["hub_id"] is not None and config.device is None and not torch.cuda.is_available():
        _fail(
            f"{config.backbone} on a CPU takes hours per update; run on a CUDA machine, or pass "
            "--device cpu to insist (or try --backbone digits)"
        )
    try:
        check_digits(config.reward, config.backbone, spec)
    except ValueError as error:
        _fail(error)
    if spec["family"] == "mixture" and config.reward in IMAGE_CONTENT:
        _fail(
            f"the {config.reward} reward reads text or objects, which the 8x8 {config.backbone} "
            "images do not have; use a real backbone, or --reward teacher"
        )
    shipped = default_prompts(config)
    config.prompts, config.eval_prompts = (
        config.prompts or shipped[0],
        config.eval_prompts or shipped[1],
    )
    try:
        if not config.out_dir:  # else existing_run would take the working folder for the run's
            check_writable(config.out_dir)
        prompts = load_prompt_file(config.prompts) if config.prompts else None
        heldout = load_prompt_file(config.eval_prompts) if config.eval_prompts else None
        check_prompts(config.reward, (prompts or []) + (heldout or []))
        checkpoint = existing_run(dataclasses.asdict(config))
        if not finished(config, checkpoint):  # a finished run is reported, even if read-only
            check_writable(config.out_dir)
        return prompts, heldout, checkpoint
    except ValueError as error:
        _fail(error)


def ranks(config):
    """(rank, world_size, device, distributed): torchrun's process group (nccl on GPUs, gloo on
    CPUs), or one process."""
    if "RANK" not in os.environ:
        return (
            0,
            1,
            torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu")),
            False,
        )
    use_cuda = torch.cuda.is_available() and config.device != "cpu"
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device, True


def report_finished(config, checkpoint, eval_path):
    """The same command again on a finished run: say what is there, neither failing nor
    overwriting."""
    again = "delete it and run the same command again to write the held-out report afresh"
    report = read_json(eval_path, again)
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
        _fail(f"{eval_path} is not the held-out report of train.py; {again}")
    table = format_table(report["rows"])
    print(
        f"{config.out_dir} holds this run, finished at iteration {checkpoint['iteration']}; its "
        f"held-out table:\n{table}\nto train again, pass another --out-dir (or --iterations N > "
        f"{checkpoint['iteration']} to continue)"
    )


def start(config):
    """Ranks and devices, the configuration checked (check_config), the model files checked and the
    cost of one update printed: a namespace with rank, world_size, master, device, distributed;
    prompts and heldout_prompts (None: the backbone's own); checkpoint (the one out_dir holds, or
    None); ckpt_path, metrics_path, eval_path. None when out_dir holds this run, finished: the same
    command again reports it."""
    rank, world_size, device, distributed = ranks(config)
    run = types.SimpleNamespace(
        rank=rank, world_size=world_size, master=rank == 0, device=device, distributed=distributed
    )
    run.prompts, run.heldout_prompts, run.checkpoint = check_config(config, world_size)
    run.ckpt_path, run.metrics_path, run.eval_path = (
        os.path.join(config.out_dir, name) for name in ("ckpt.pt", "metrics.jsonl", "eval.json")
    )
    if finished(config, run.checkpoint):
        if run.master:
            try:
                report_finished(config, run.checkpoint, run.eval_path)
            except ValueError as error:
                _fail(error)
        return None
    if config.threads:
        torch.set_num_threads(config.threads)
    if run.master:  # what one update costs, before anything loads
        teacher = (
            f" (the teacher solves {config.contexts} contexts)"
            if config.reward == "teacher"
            else ""
        )
        print(
            update_cost(
                config.backbone, config.contexts, config.rollouts, config.steps, config.guidance
            )
            + teacher
        )
    missing = []  # every missing piece in one message, before either model loads
    for check in (
        lambda: check_reward_files(config.reward, config.reward_checkpoint),
        lambda: check_backbone_files(config.backbone, config.model_path),
    ):
        try:
            check()
        except ValueError as error:
            missing.append(str(error))
    if missing:
        _fail("; ".join(missing))
    return run


def backbone_and_prompts(config, run):
    """The frozen backbone (checkpoints.trained_backbone), the training prompts and the held-out
    contexts (prompts, seeds), checked against it: a prompt it cannot take fails here in one line,
    not at an iteration."""
    try:
        backbone = trained_backbone(dataclasses.asdict(config), run.device)
        prompts = run.prompts or backbone.prompts
        heldout = heldout_contexts(run.heldout_prompts or backbone.prompts, config.eval_contexts)
        backbone.check_prompts(prompts + heldout[0], config.reward)
    except ValueError as error:
        _fail(error)
    return backbone, prompts, heldout


def claim(config, run):
    """One writer per run folder until this process ends (held by keeping the file open in
    run.lock), taken once the inputs passed: a refused start leaves no folder behind."""
    try:
        with written(config.out_dir):
            run.lock = claim_run(config.out_dir, fresh=not run.checkpoint) if run.master else None
    except ValueError as error:
        _fail(error)


def new_policy(config, backbone):
    """The policy the configuration names at its start (backbones.make_policy): the backbone's
    default schedule, equal increments or TPDM's rates, at --concentration."""
    init_times = backbone.default_times(config.steps) if config.init == "default" else None
    options = dict(init="tpdm") if config.init == "tpdm" else {}
    if config.concentration is not None:
        options.update(concentration=config.concentration)
    if config.policy == "stepwise":
        options.update(inputs=config.policy_inputs, inference=config.inference)
    try:  # a concentration too small for the start's smallest increment
        return make_policy(
            config.policy,
            backbone.policy_dims,
            config.steps,
            preset=BACKBONES[config.backbone]["policy"],
            init_times=init_times,
            backbone=config.backbone,
            **options,
        )
    except ValueError as error:
        _fail(f"--concentration {config.concentration}: {error}")


def resume(config, run, policy, optimizer):
    """The iteration the loop starts at: 0 for a new run (its policy kept as snapshot 0), else the
    checkpoint's, whose weights, optimizer and RNG state are restored and metrics.jsonl cut back to
    it. run.rows: the rows of metrics.jsonl, which every checkpoint carries."""
    start, run.rows = 0, []
    if run.checkpoint:
        with written():
            metrics_path = run.metrics_path if run.master else None
            start = restore(run.checkpoint, policy, optimizer, metrics_path)
        if run.master:
            run.rows = metric_rows(run.metrics_path)[0]
            print(f"continuing {run.ckpt_path} from iteration {start}")
    elif run.master:
        snapshot(config, policy, 0)
    return start


def summary(config, run, policy):
    """What this run trains, in three lines."""
    size = sum(p.numel() for p in policy.parameters())
    return (
        f"backbone {config.backbone} | L = {config.steps} steps | {config.policy} policy, "
        f"{size:,} parameters\nB = {config.contexts} contexts x K = {config.rollouts} rollouts "
        f"= {config.contexts * config.rollouts} samples per update | {run.world_size} rank(s), "
        f"{config.contexts // run.world_size} contexts each | baseline {config.baseline} | reward "
        f"{config.reward}\n{optimizer_line(config)}"
    )


def optimizer_line(config):
    """The update's settings in one line (with --optimizer ppo, TPDM's by default)."""
    ppo = f"PPO {config.ppo_epochs} epochs x {config.ppo_minibatches} minibatches, clip "
    update = ppo + f"{config.ppo_clip:g}" if config.optimizer == "ppo" else "REINFORCE"
    start = f" | start {config.init}"
    if config.policy == "stepwise":
        start += f", inputs {config.policy_inputs}, the Beta {config.inference} at inference"
    return (
        f"{update} | AdamW(0.9, {config.adam_beta2:g}), eps {config.adam_eps:g}, weight decay "
        f"{config.weight_decay:g}, lr {config.lr:g} {config.lr_decay}{start}"
    )


# -----------------------------------------------------------------------------
# in the loop: rewards of every rank, logs and checkpoints


def gather(run, rewards):
    """The rewards (B/world, K) of every rank, concatenated in rank order (B, K)."""
    if not run.distributed:
        return rewards
    gathered = [torch.empty_like(rewards) for _ in range(run.world_size)]
    dist.all_gather(gathered, rewards)
    return torch.cat(gathered)


def check_finite(config, run, iteration, rewards):
    """Every baseline pools rewards: one NaN would reach every gradient. Stops in one line saying
    what can cause it and where the last good state is."""
    if torch.isfinite(rewards).all():
        return
    last = (
        f"{run.ckpt_path} holds the last good state"
        if os.path.isfile(run.ckpt_path)
        else "no checkpoint was written yet"
    )
    bad = int((~torch.isfinite(rewards)).sum())
    _fail(
        f"iteration {iteration + 1}: {bad} rewards are NaN or inf: the policy diverged (learning "
        f"rate too high? --lr {config.lr:g}) or the backbone ({config.dtype or 'default'} dtype) "
        f"or the reward model overflowed; {last}"
    )


def log(config, run, row, progress):
    """One row of metrics.jsonl per iteration; a line on the console every log_interval."""
    run.rows.append(row)
    with written(run.metrics_path), open(run.metrics_path, "a") as file:
        file.write(json.dumps(row) + "\n")
    done = row["iteration"]
    if done % config.log_interval == 0 or done == config.iterations:
        clipped = f" | clipped {row['clip_fraction']:.2f}" if config.optimizer == "ppo" else ""
        progress.write(
            f"iter {done:5d} | reward {row['reward']:+.5f} | shrinkage a "
            f"{row['shrinkage']:.3f} | loss {row['loss']:+.4f} | grad "
            f"{row['grad_norm']:.3f} | concentration {row['concentration']:.1f} | "
            f"stop margin {row['stop_margin']:.4f}{clipped}"
        )


def checkpoint(config, run, policy, optimizer, done):
    """ckpt.pt after `done` iterations: what a resume needs to continue exactly. Every draw in the
    loop has its own seeded generator; the global RNG state is kept should anything draw from it."""
    state = dict(
        policy=policy.state_dict(),
        policy_config=policy.config,
        optimizer=optimizer.state_dict(),
        iteration=done,
        config=dataclasses.asdict(config),
        rng={"torch": torch.get_rng_state()},
        metrics=run.rows,  # restore() writes back a row that a torn line of metrics.jsonl lost
    )
    with written(run.ckpt_path):
        save_checkpoint(run.ckpt_path, state)
    snapshot(config, policy, done)


def snapshot(config, policy, done):
    """With --snapshots, the policy after `done` iterations in snapshots/policy-<done>.pt (what
    baseline_study.py measures the gradient's variance at); kept, unlike ckpt.pt, and read as it is
    (checkpoints.load_checkpoint), without the optimizer and RNG state a resume needs."""
    if config.snapshots:
        path = os.path.join(config.out_dir, "snapshots", f"policy-{done}.pt")
        state = dict(policy=policy.state_dict(), policy_config=policy.config, iteration=done)
        with written(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_checkpoint(path, dict(state, config=dataclasses.asdict(config)))


def heldout_gain(backbone, reward, heldout, steps):
    """A function policy -> the mean paired gain (a number) of its mean schedule over the default on
    the first GAIN_CONTEXTS held-out contexts: the curve of train.py's figure, logged at each
    checkpoint (unlike the batch reward, on the same contexts every time)."""
    prompts, seeds = (part[:GAIN_CONTEXTS] for part in heldout)
    methods = {"default": default_schedule(backbone, steps)}
    default = evaluate(backbone, reward, prompts, seeds, methods)["default"]

    def gain(policy):
        methods = {"learned": policy_schedule(policy, backbone)}
        learned = evaluate(backbone, reward, prompts, seeds, methods)["learned"]
        return (learned - default).mean().item()

    return gain


# -----------------------------------------------------------------------------
# the end: figure, policy folder, held-out report


def finish(config, run, backbone, reward, policy, heldout):
    """The training figure, the policy in the Hub format and the held-out report (rank 0; its
    eval.json last, as it marks the run finished), then the end of the process group."""
    if run.master:
        prompts, seeds = (part[:8] for part in heldout)  # a few held-out contexts
        noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
        used = policy_schedule(policy, backbone)(noise, cond)
        learned = (used[0] if isinstance(used, tuple) else used).cpu()  # step-wise: with latents
        default = backbone.default_times(policy.steps).cpu()
        labels = context_labels(prompts, seeds)
        with written(config.out_dir):
            curve = len(heldout[0][:GAIN_CONTEXTS])  # the contexts of heldout_gain
            plot_training(config.out_dir, learned, default, labels, config.reward, curve)
            save_policy(
                os.path.join(config.out_dir, "policy"),
                policy,
                dataclasses.asdict(config),
                config.iterations,
            )
            heldout_report(
                config.out_dir, backbone, reward, policy, *heldout, config.reward, config.seed
            )
        print(
            f"wrote {run.ckpt_path}, {run.metrics_path}, {run.eval_path}, the figure train.png and "
            f"policy/ (Hub format) in {config.out_dir}"
        )
    if run.distributed:
        dist.barrier()
        dist.destroy_process_group()


def heldout_report(out_dir, backbone, reward, policy, prompts, seeds, reward_name, seed=0):
    """train.py's final table on its held-out contexts, the same noises for every method: printed
    and written to eval.json (atomically: ablation.py takes an existing one as a finished run)."""
    draws = torch.Generator().manual_seed(seed)
    methods = {
        "default": default_schedule(backbone, policy.steps),
        "learned (mean)": policy_schedule(policy, backbone),
        "learned (sampled)": policy_schedule(policy, backbone, "sample", draws),
    }
    # the teacher row: the reward's own target, error 0
    teacher = "limit (teacher)" if reward_name == "teacher" else None
    scores = evaluate(backbone, reward, prompts, seeds, methods, reference=teacher, progress=True)
    rows = summarize(scores)
    print(
        f"\nheld-out evaluation: {len(seeds)} contexts, reward {reward_name}, L = {policy.steps}\n"
        f"{format_table(rows)}"
    )
    report = dict(rows=rows, steps=policy.steps, contexts=len(seeds), reward=reward_name)
    if BACKBONES[backbone.name].get("folder"):  # a miniature: realism beside the reward
        measure = realism_measure()
        compared = {name: methods[name] for name in ("default", "learned (mean)")}
        realism = realism_table(backbone, compared, prompts, seeds, measure)
        floor = measure.floor(len(seeds))
        print(
            "realism against real digits (Frechet distance lower, precision and recall higher):\n"
            + "\n".join(
                f"  {name}: " + ", ".join(f"{key} {value:.3f}" for key, value in row.items())
                for name, row in {**realism, "real digits (floor)": floor}.items()
            )
        )
        report.update(realism=realism, realism_floor=floor)
    write_json_atomic(os.path.join(out_dir, "eval.json"), report)
