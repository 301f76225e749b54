"""
train.py's setup and finish, what it does around its loop that is not the method.

setup(config) checks the input, picks the ranks and devices, opens the frozen backbone and the
reward, takes the run folder, builds the policy and its optimiser and continues a checkpoint: it
returns a Run, everything the loop needs, with named fields. finish(config, run) writes the policy
in the Hub format, the held-out report and, when asked, the figure. Bad input fails here in one
line (SystemExit "error: ..."), before anything heavy is loaded, and nothing a run folder already
holds is changed by a refused start.
"""

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import backbones
import rewards as reward_lib
from baselines import MIN_CONTEXTS
from prompts import context_noise, heldout_contexts, load_prompt_file
from rollout import Backbone
from scoring.figures import context_labels, plot_training
from scoring.paired import (
    GAIN_CONTEXTS,
    format_table,
    heldout_gain,
    heldout_report,
    policy_schedule,
)
from store.checkpoint import (
    existing_run,
    make_policy,
    restore,
    save_checkpoint,
    save_policy,
)
from store.files import (
    WriteFailed,
    check_writable,
    claim_run,
    foreign_files,
    metric_rows,
    read_json,
    write_failed,
)
from store.track import check_tracker, open_tracker

# the least value of each setting (contexts: the baseline's own, baselines.MIN_CONTEXTS)
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
# settings that must be finite and > 0 (True) or >= 0 (False)
POSITIVE = dict(
    lr=True,
    grad_clip=True,
    ppo_clip=True,
    adam_eps=True,
    concentration=True,
    weight_decay=False,
    guidance=False,
)
# A training context's noise seed is prompts.context_seed(seed, iteration, context), which must stay
# below 2^63 (torch's manual_seed) for every iteration and context of a run: a seed below 2^27
# leaves room for 2^16 contexts per iteration and 2^20 iterations; held-out and evaluation seeds
# (sample.py, evaluate.py) are plain noise seeds, any integer from 0 to 2^63 - 1.
MAX_SEED = 2**27
# a training prompt set whose encoding fits in this many bytes is encoded once, at setup
ENCODED_BYTES = 64 * 2**20
# the settings only the step-wise policy has, with the value that names them
STEPWISE_ONLY = dict(init="tpdm", policy_inputs="hidden", inference="mode")


@dataclass
class Run:
    """What train.py's loop needs, built by setup: where it runs (rank, world_size, device,
    distributed; the master rank writes), the frozen backbone and the reward, the training prompts
    and the held-out contexts (prompts, seeds), the policy (unwrapped) and its optimiser, the
    iteration to start at, the rows of metrics.jsonl so far (every checkpoint carries them), the
    run folder's files, and heldout_gain(policy) -> its gain over the default schedule on a few
    held-out contexts (the master rank's, logged at each checkpoint)."""

    rank: int
    world_size: int
    device: torch.device
    distributed: bool
    backbone: Backbone
    reward: Callable
    prompts: list
    heldout: tuple
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    start: int
    rows: list
    ckpt_path: str
    metrics_path: str
    eval_path: str
    heldout_gain: Callable | None
    lock: object | None  # the open run.lock of the master rank: one writer per run folder
    tracker: object | None  # --track's TensorBoard or W&B mirror (the master rank's)
    encoded: dict | None  # the training prompts encoded once, when they are few (ENCODED_BYTES)

    @property
    def master(self):
        return self.rank == 0

    def encode(self, picks):
        """The backbone's encoding (cond) of the training prompts numbered `picks`: rows of the
        set encoded at setup when it is small, else encoded now. The text encoders work row by row,
        so the rows are those of encoding the batch itself."""
        if self.encoded is None:
            return self.backbone.encode_prompts([self.prompts[i] for i in picks])
        index = torch.tensor(picks)
        return {key: value[index.to(value.device)] for key, value in self.encoded.items()}

    def __enter__(self):
        return self

    def __exit__(self, *error):
        """However the run ends: the trackers flushed, the process group left, the run folder
        released for the next writer."""
        if self.tracker is not None:
            self.tracker.close()
        if self.distributed:
            dist.destroy_process_group()
        if self.lock is not None:
            self.lock.close()


def fail(message):
    raise SystemExit(f"error: {message}")


@contextlib.contextmanager
def written(path=None):
    """Writes to the run folder: one that fails (disk full, read-only storage) ends in one line
    naming the folder (store.files.write_failed); the last good checkpoint stays as it was."""
    try:
        yield
    except WriteFailed as error:
        fail(error)
    except OSError as error:
        fail(write_failed(error.filename or path, error))


# -----------------------------------------------------------------------------
# setup


def check(config, world_size):
    """What argparse cannot say fails here in one line, before anything heavy is loaded. Returns
    the training and held-out prompts (None: the backbone's own) and the checkpoint out_dir
    already holds (or None)."""
    least = dict(LEAST, contexts=MIN_CONTEXTS[config.baseline])
    for key, minimum in least.items():
        value = getattr(config, key)
        if value is not None and value < minimum:
            why = {
                "rollouts": " for a leave-one-out baseline",
                "contexts": f" for --baseline {config.baseline}",
            }.get(key, "")
            fail(f"--{key.replace('_', '-')} must be at least {minimum}{why} (got {value})")
    for key, positive in POSITIVE.items():
        value = getattr(config, key)
        if value is not None and not (
            math.isfinite(value) and (value > 0 if positive else value >= 0)
        ):
            bound = "> 0" if positive else ">= 0"
            fail(f"--{key.replace('_', '-')} must be a finite number {bound} (got {value})")
    if not 0 <= config.adam_beta2 < 1:
        fail(f"--adam-beta2 must be in [0, 1) (got {config.adam_beta2})")
    if not 0 <= config.seed < MAX_SEED:
        fail(
            f"--seed must be an integer from 0 to {MAX_SEED - 1:,} (got {config.seed}): a training "
            "context's noise seed is built from it and must stay below 2^63"
        )
    if config.device == "cuda" and not torch.cuda.is_available():
        fail(
            f"--device cuda, but this machine has no CUDA device (torch {torch.__version__}); drop "
            "--device to run on the CPU"
        )
    spec = backbones.BACKBONES[config.backbone]
    if config.guidance is not None and spec["guidance"] is None:
        fail(
            f"--guidance {config.guidance}: {config.backbone} has no guidance input and runs no "
            "CFG (as FLUX.1-schnell, or an exact mixture); drop --guidance"
        )
    for key, value in STEPWISE_ONLY.items():
        if config.policy != "stepwise" and getattr(config, key) == value:
            flag = "--" + key.replace("_", "-")
            fail(f"{flag} {value} is the step-wise policy's, not the {config.policy} policy's")
    if config.policy_inputs == "hidden" and spec["family"] == "mixture":
        fail(
            f"--policy-inputs hidden reads a denoiser's hidden states; {config.backbone} is an "
            "exact mixture with none: use --policy-inputs sampler"
        )
    if config.contexts % world_size:
        fail(
            f"--contexts {config.contexts} is not divisible by the {world_size} ranks; choose a "
            "multiple of the number of processes"
        )
    if spec["hub_id"] is not None and config.device is None and not torch.cuda.is_available():
        fail(
            f"{config.backbone} on a CPU takes hours per update; run on a CUDA machine, or pass "
            "--device cpu to insist (or try --backbone digits)"
        )
    try:
        reward_lib.check_digits(config.reward, config.backbone, spec)
    except ValueError as error:
        fail(error)
    if spec["family"] == "mixture" and config.reward in reward_lib.IMAGE_CONTENT:
        fail(
            f"the {config.reward} reward reads text or objects, which the 8x8 {config.backbone} "
            "images do not have; use a real backbone, or --reward teacher"
        )
    try:
        check_tracker(config.track)
        if not config.out_dir:  # else existing_run would take the working folder for the run's
            check_writable(config.out_dir)
        prompts = load_prompt_file(config.prompts) if config.prompts else None
        heldout = load_prompt_file(config.eval_prompts) if config.eval_prompts else None
        reward_lib.check_prompts(config.reward, (prompts or []) + (heldout or []))
        checkpoint = existing_run(dataclasses.asdict(config))
        if not finished(config, checkpoint):  # a finished run is reported, even if read-only
            check_writable(config.out_dir)
        foreign = [] if checkpoint else foreign_files(config.out_dir)
        if foreign:  # a user's files where this run would write its own: never overwritten
            fail(
                f"--out-dir {config.out_dir} holds {', '.join(foreign)}, which no run of train.py "
                "wrote (there is no run.lock); pass another --out-dir, or move them away"
            )
        return prompts, heldout, checkpoint
    except ValueError as error:
        fail(error)


def ranks(config):
    """(rank, world_size, device, distributed): torchrun's process group (nccl on GPUs, gloo on
    CPUs), or one process."""
    if "RANK" not in os.environ:
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, torch.device(device), False
    use_cuda = torch.cuda.is_available() and config.device != "cpu"
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device, True


def finished(config, checkpoint):
    """Whether out_dir holds this run, finished: its last checkpoint and its held-out report."""
    done = checkpoint is not None and checkpoint["iteration"] >= config.iterations
    return done and os.path.isfile(os.path.join(config.out_dir, "eval.json"))


def report_finished(config, checkpoint):
    """The same command again on a finished run: say what is there, neither failing nor
    overwriting."""
    eval_path = os.path.join(config.out_dir, "eval.json")
    again = "delete it and run the same command again to write the held-out report afresh"
    try:
        report = read_json(eval_path, again)
    except ValueError as error:
        fail(error)
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
        fail(f"{eval_path} is not the held-out report of train.py; {again}")
    print(
        f"{config.out_dir} holds this run, finished at iteration {checkpoint['iteration']}; its "
        f"held-out table:\n{format_table(report['rows'])}\nto train again, pass another --out-dir "
        f"(or --iterations N > {checkpoint['iteration']} to continue)"
    )


def new_policy(config, backbone):
    """The policy the configuration names at its start (store.checkpoint.make_policy): the
    backbone's default schedule, equal increments or TPDM's rates, at --concentration, at the size
    its backbone gets (store.checkpoint.PRESETS)."""
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
            preset=backbones.BACKBONES[config.backbone]["policy"],
            init_times=init_times,
            backbone=config.backbone,
            **options,
        )
    except ValueError as error:
        fail(f"--concentration {config.concentration}: {error}")


def snapshot(config, policy, done):
    """With --snapshots, the policy after `done` iterations in snapshots/policy-<done>.pt (what
    evidence/baseline_study.py measures the gradient's variance at); kept, unlike ckpt.pt, and read
    as it is (store.checkpoint.load_checkpoint), without the optimizer and RNG state a resume
    needs."""
    if config.snapshots:
        path = os.path.join(config.out_dir, "snapshots", f"policy-{done}.pt")
        state = dict(policy=policy.state_dict(), policy_config=policy.config, iteration=done)
        with written(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_checkpoint(path, dict(state, config=dataclasses.asdict(config)))


def setup(config, make_optimizer):
    """Everything train.py's loop needs (Run), built in this order: the ranks and devices, the
    input checked (check), the model files checked and the cost of one update printed, the frozen
    backbone with the prompts checked against it, the run folder taken (one writer), the reward,
    the default schedule's held-out scores, the policy at its start and its optimiser
    (make_optimizer(parameters)), and a checkpoint continued. None when out_dir holds this run,
    finished: the same command again reports it."""
    rank, world_size, device, distributed = ranks(config)
    master = rank == 0
    prompts, heldout_prompts, checkpoint = check(config, world_size)
    if finished(config, checkpoint):
        if master:
            report_finished(config, checkpoint)
        return None
    if config.threads:
        torch.set_num_threads(config.threads)
    if master:  # what one update costs, before anything loads
        teacher = f" (the teacher solves {config.contexts} contexts)"
        cost = backbones.update_cost(
            config.backbone, config.contexts, config.rollouts, config.steps, config.guidance
        )
        print(cost + (teacher if config.reward == "teacher" else ""))
    missing = []  # every missing piece in one message, before either model loads
    for check_files in (
        lambda: reward_lib.check_reward(config.reward, config.reward_checkpoint),
        lambda: backbones.check_files(config.backbone, config.model_path),
    ):
        try:
            check_files()
        except ValueError as error:
            missing.append(str(error))
    if missing:
        fail("; ".join(missing))

    torch.manual_seed(config.seed)  # the policy's initialisation; the loop's draws seed their own
    try:  # the frozen backbone; a prompt it cannot take fails here, not at an iteration
        backbone = backbones.trained_backbone(dataclasses.asdict(config), device)
        prompts = prompts or backbone.prompts
        heldout = heldout_contexts(heldout_prompts or backbone.prompts, config.eval_contexts)
        backbone.check_prompts(prompts + heldout[0], config.reward)
    except ValueError as error:
        fail(error)
    lock = None
    if master:  # taken once the inputs passed: a refused start leaves no folder behind
        try:
            with written(config.out_dir):
                lock = claim_run(config.out_dir, fresh=not checkpoint)
        except ValueError as error:
            fail(error)
    reward = reward_lib.load_reward(
        config.reward, backbone, device=device, checkpoint=config.reward_checkpoint
    )
    gain = heldout_gain(backbone, reward, heldout, config.steps) if master else None
    policy = new_policy(config, backbone).to(device)
    optimizer = make_optimizer(policy.parameters())
    paths = [os.path.join(config.out_dir, name) for name in ("ckpt.pt", "metrics.jsonl")]
    start, rows = 0, []
    if checkpoint:  # weights, optimizer and RNG state; metrics.jsonl cut back to its iteration
        with written():
            start = restore(checkpoint, policy, optimizer, paths[1] if master else None)
        if master:
            rows = metric_rows(paths[1])[0]
            print(f"continuing {paths[0]} from iteration {start}")
    elif master:
        snapshot(config, policy, 0)
    if master:
        size = sum(p.numel() for p in policy.parameters())
        print(
            f"policy: {config.policy}, {size:,} parameters | {world_size} rank(s), "
            f"{config.contexts // world_size} contexts each"
        )
    eval_path = os.path.join(config.out_dir, "eval.json")
    tracker = open_tracker(config.track, config.out_dir, config) if master else None
    few = prompts[:2]  # what a prompt's encoding costs in memory
    size = sum(v.nelement() * v.element_size() for v in backbone.encode_prompts(few).values())
    size /= len(few)
    encoded = backbone.encode_prompts(prompts) if size * len(prompts) <= ENCODED_BYTES else None
    return Run(
        rank, world_size, device, distributed, backbone, reward, prompts, heldout, policy,
        optimizer, start, rows, *paths, eval_path, gain, lock, tracker, encoded,
    )  # fmt: skip


# -----------------------------------------------------------------------------
# in the loop


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
    fail(
        f"iteration {iteration + 1}: {bad} rewards are NaN or inf: the policy diverged (learning "
        f"rate too high? --lr {config.lr:g}) or the backbone ({config.dtype or 'default'} dtype) "
        f"or the reward model overflowed; {last}"
    )


# -----------------------------------------------------------------------------
# finish


def finish(config, run):
    """The policy in the Hub format, the held-out report and (--figure) the training figure
    (rank 0; eval.json last, as it marks the run finished); the other ranks wait for it."""
    if run.master:
        backbone, policy = run.backbone, run.policy
        with written(config.out_dir):
            if config.figure:
                draw_training(config, run)
            save_policy(
                os.path.join(config.out_dir, "policy"),
                policy,
                dataclasses.asdict(config),
                config.iterations,
            )
            heldout_report(
                config.out_dir, backbone, run.reward, policy, *run.heldout, config.reward,
                config.seed,
            )  # fmt: skip
        figure = ", the figure train.png" if config.figure else ""
        print(
            f"wrote {run.ckpt_path}, {run.metrics_path}, {run.eval_path}{figure} and policy/ (Hub "
            f"format) in {config.out_dir}"
        )
    if run.distributed:
        dist.barrier()


def draw_training(config, run):
    """train.png (--figure): the held-out gain at each checkpoint, and the learned schedules of a
    few held-out contexts against the default."""
    backbone, policy = run.backbone, run.policy
    prompts, seeds = (part[:8] for part in run.heldout)  # a few held-out contexts
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    used = policy_schedule(policy, backbone)(noise, cond)
    learned = (used[0] if isinstance(used, tuple) else used).cpu()  # step-wise: with latents
    default = backbone.default_times(policy.steps).cpu()
    curve = len(run.heldout[0][:GAIN_CONTEXTS])  # the contexts of heldout_gain
    labels = context_labels(prompts, seeds)
    plot_training(config.out_dir, learned, default, labels, config.reward, curve)


def interrupted(config):
    """The one line a Ctrl-C ends train.py with: what the run folder keeps, and how to go on."""
    path = os.path.join(config.out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        return (
            f"interrupted before the first checkpoint: nothing of this run is kept in "
            f"{config.out_dir}; the same command starts it afresh"
        )
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return (
        f"interrupted: {path} holds iteration {state['iteration']} of {config.iterations}; the "
        "same command continues from there"
    )
