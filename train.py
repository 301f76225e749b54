"""
Train an instance-level sampling schedule with REINFORCE and a James-Stein baseline (Yu et al.,
CVPR 2026, arXiv 2511.22177; the method in README.md, the choices behind it in docs/DESIGN.md).

CPU, the embedded digits backbone (no download; about a minute):
    python train.py
CPU, a trained miniature SD3 / Flux / SD-XL pipeline shipped in miniatures/ (a few minutes):
    python train.py --backbone mini-sd3 --steps 3
One GPU, a frozen Stable Diffusion 3.5 Medium with the HPSv2 reward, on the shipped prompts:
    python train.py --backbone sd35m --steps 10
Several GPUs (the global batch is the same; each rank takes its share of contexts):
    torchrun --standalone --nproc_per_node=8 train.py --backbone flux-dev --steps 5

Each iteration draws B contexts c = (prompt, initial noise x_T); the policy maps each to the
concentration alpha of a Dirichlet over the L+1 increments of a schedule; K schedules tau ~
Dir(alpha) are drawn per context, each sampled with the frozen backbone (L model calls) and scored;
then one REINFORCE step with a baseline b:
    loss = -mean_{c,i} (r[c,i] - b[c,i]) * log pi(tau[c,i] | x_T, c)
A run folder is never overwritten: the same command again continues a killed run from its last
checkpoint, or reports a finished one.
"""

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import signal
import sys
import textwrap
import time
from dataclasses import dataclass, field

if __name__ == "__main__":  # Ctrl-C while torch and diffusers import: one line, not a traceback
    from store.files import interrupt_quietly

    interrupt_quietly("train.py")

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import backbones
import rewards as reward_lib
from baselines import BASELINES, MIN_CONTEXTS, shrinkage
from comparator import tpdm
from prompts import SHIPPED, context_seed, heldout_contexts, load_prompt_file
from scoring import paired
from scoring.figures import plot_training
from scoring.realism import NEIGHBOURS
from store import checkpoint, files, track

# -----------------------------------------------------------------------------
# configuration: Config's defaults are the digits backbone's; --backbone X takes PRESETS[X]; a flag
# given on the command line overrides either


def arg(default, help, least=None, positive=None):
    """A field: its default, its help, and its bound (at least `least`; > 0 if positive, >= 0 if
    positive is False), checked at the door."""
    return field(default=default, metadata=dict(help=help, least=least, positive=positive))


@dataclass
class Config:
    # I/O
    out_dir: str | None = arg(None, "run folder; default: out/<backbone>-L<steps>-<policy>-s<seed>")
    resume: bool = arg(False, "insist on continuing out_dir/ckpt.pt (a run is never overwritten)")
    ckpt_interval: int = arg(50, "iterations between checkpoints (a kill loses at most this)", 1)
    log_interval: int = arg(10, "iterations between log lines", 1)
    snapshots: bool = arg(False, "keep the policy at the start and each checkpoint (snapshots/)")
    figure: bool = arg(False, "also draw train.png: the held-out gain, the learned schedules")
    track: str | None = arg(None, "mirror each log row to tensorboard | wandb; default: neither")
    # backbone
    backbone: str = arg("digits", "a name in PRESETS (mini-*: the trained miniatures)")
    model_path: str | None = arg(None, "local diffusers folder replacing the hub id")
    resolution: int | None = arg(None, "image side in pixels; default: the backbone's own", 8)
    guidance: float | None = arg(
        None, "CFG (flux-dev: distilled); default: the backbone's", positive=False
    )
    prompts: str | None = arg(None, "training prompts: a file (.txt, .json, .jsonl) or hpdv2")
    eval_prompts: str | None = arg(None, "held-out prompt file")
    # policy
    policy: str = arg("instance", "instance | global | stepwise (the comparator, comparator/)")
    steps: int = arg(4, "L, model calls per sample; one policy per L", 1)
    init: str = arg("default", "default (the backbone's schedule) | uniform | tpdm (comparator/)")
    concentration: float = arg(
        100.0, "initial sum(alpha) (--init uniform: L+1 is flat)", positive=True
    )
    # reward
    reward: str = arg("teacher", "a name in rewards.REWARDS")
    reward_checkpoint: str | None = arg(None, "local reward-model weights (offline machines)")
    # baseline
    baseline: str = arg("js", "js | js-unbiased | rloo | xctx (baselines.py)")
    contexts: int = arg(32, "B, contexts (prompt + noise) per update, over all ranks")
    rollouts: int = arg(2, "K, schedules drawn per context", 2)
    rollout_batch: int | None = arg(None, "samples per backbone call (memory); default: all", 1)
    # optim
    optimizer: str = arg("reinforce", "reinforce (one step per batch) | ppo (comparator/)")
    iterations: int = arg(300, "policy updates", 1)
    lr: float = arg(3e-3, "AdamW peak learning rate", positive=True)
    lr_decay: str = arg("cosine", "cosine (to 0 at the end) | constant")
    weight_decay: float = arg(1e-4, "AdamW weight decay", positive=False)
    adam_beta2: float = arg(0.999, "AdamW's beta2 (beta1 is 0.9)")
    adam_eps: float = arg(1e-8, "AdamW's epsilon", positive=True)
    grad_clip: float = arg(1.0, "gradient-norm clip", positive=True)
    # evaluation
    eval_contexts: int = arg(256, "held-out contexts for the final table", 1)
    # system
    seed: int = arg(0, "seeds contexts, rollouts and the policy initialisation")
    device: str | None = arg(None, "cpu | cuda; default: cuda if available")
    dtype: str | None = arg(None, "backbone dtype; default: bfloat16 on CUDA, float32 on CPU")
    threads: int | None = arg(1, "CPU threads (1 suits the small backbones); none: torch's", 1)


# Each backbone's training configuration (the rest is Config's). The paper states K = 2 and a
# "batch size" of 32 (SD-XL, SD3.5-M) or 16 (SD3.5-L, Flux-Dev); reading it as B contexts, and the
# rest, are this project's choices. threads None: torch's own count (real models use every core).
REAL = dict(
    steps=4,
    rollouts=2,
    iterations=1000,
    lr=1e-4,
    reward="hpsv2",
    prompts="prompts/train.jsonl",
    eval_prompts="prompts/heldout.jsonl",
    threads=None,
)
# the embedded exact mixtures draw their own prompts ("a handwritten 0" .. "9")
EMBEDDED = dict(steps=4, contexts=32, iterations=300, lr=3e-3, reward="teacher", threads=1)
MINIATURE = dict(
    steps=3,
    contexts=16,
    rollouts=4,
    iterations=200,
    lr=3e-3,
    reward="preference",
    prompts="prompts/digit_train.txt",
    eval_prompts="prompts/digit_heldout.txt",
    threads=1,
)
PRESETS = {
    "sd35m": dict(REAL, contexts=32, rollout_batch=16),
    "sd35l": dict(REAL, contexts=16, rollout_batch=8),
    "sdxl": dict(REAL, contexts=32, rollout_batch=16),
    "flux-dev": dict(REAL, contexts=16, rollout_batch=8),
    "flux-schnell": dict(REAL, contexts=16, rollout_batch=8),
    "digits": dict(EMBEDDED, rollouts=2),
    "digits-prompt": dict(EMBEDDED, rollouts=8),
    # the noise's signal is weaker than the prompt's; digits-xor's interaction: docs/DESIGN.md
    "digits-noise": dict(EMBEDDED, rollouts=8, iterations=600),
    "digits-xor": dict(EMBEDDED, rollouts=8, iterations=2000),
    "mini-sd3": MINIATURE,
    "mini-flux": MINIATURE,
    "mini-sdxl": MINIATURE,
    # a few-step distilled model is asked at the budget it was distilled for
    "mini-flux-schnell": dict(MINIATURE, steps=4),
}
CHOICES = dict(
    track=list(track.TRACKERS),
    backbone=list(PRESETS),
    policy=list(checkpoint.POLICIES),
    init=["default", "uniform", "tpdm"],
    reward=list(reward_lib.REWARDS),
    baseline=list(BASELINES),
    optimizer=["reinforce", "ppo"],
    lr_decay=["cosine", "constant"],
    device=["cpu", "cuda"],
    dtype=["bfloat16", "float16", "float32"],
)


def add_fields(parser, fields):
    """One --flag per dataclass field, its help ending in its default."""
    for item in fields:
        flag, default = "--" + item.name.replace("_", "-"), item.default
        if item.type is bool:
            parser.add_argument(flag, action="store_true", help=item.metadata["help"])
            continue
        shown = "" if default is None else f" (default: {default})"
        kind = next(t for t in getattr(item.type, "__args__", [item.type]) if t is not type(None))
        choices = CHOICES.get(item.name) or item.metadata.get("choices")
        parser.add_argument(flag, type=kind, choices=choices, help=item.metadata["help"] + shown)


def parse_config(argv=None):
    """The command line over the backbone's preset (PRESETS) over Config's defaults, with the
    comparator's own settings in config.tpdm. Printed once (rank 0)."""
    presets = [
        f"  {name}: " + " ".join(f"{k}={v}" for k, v in row.items())
        for name, row in PRESETS.items()
    ]
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="each backbone's preset (over the defaults above):\n" + "\n".join(presets),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # what the command line gave, and nothing else
    )
    parser.error = lambda message: parser.exit(2, f"train.py: error: {message}\n")  # one line
    add_fields(parser, dataclasses.fields(Config))
    add_fields(parser.add_argument_group(tpdm.FLAGS), dataclasses.fields(tpdm.Settings))
    given = vars(parser.parse_args(argv))
    backbone = given.get("backbone", Config.backbone)
    values = dict(PRESETS[backbone])
    if given.get("reward") in SHIPPED and "prompts" not in given:  # its own prompt set
        values["prompts"], values["eval_prompts"] = SHIPPED[given["reward"]]
    values.update(tpdm.preset(given, values, backbones.BACKBONES[backbone]), **given)
    config = Config(**{key: value for key, value in values.items() if key not in tpdm.FIELDS})
    config.tpdm = tpdm.Settings(**{key: values[key] for key in tpdm.FIELDS if key in values})
    if config.out_dir is None:  # one folder per run: the same command finds its own run again
        kind = config.policy + ("-ppo" if config.optimizer == "ppo" else "")
        config.out_dir = os.path.join(
            "out", f"{config.backbone}-L{config.steps}-{kind}-s{config.seed}"
        )
    if int(os.environ.get("RANK", "0")) == 0:
        settings = " ".join(f"{key}={value}" for key, value in saved(config).items())
        print("configuration: " + textwrap.fill(settings, 100, subsequent_indent="  "))
    return config


def saved(config):
    """The run's configuration as the checkpoint records it: one flat dict."""
    return {**dataclasses.asdict(config), **dataclasses.asdict(config.tpdm)}


# -----------------------------------------------------------------------------
# the door: every input checked in one line, before anything heavy loads

# A training context's noise seed is prompts.context_seed(seed, iteration, context), which must stay
# below 2^63 (torch's manual_seed) for every iteration and context of a run: a seed below 2^27
# leaves room for 2^16 contexts per iteration and 2^20 iterations.
MAX_SEED = 2**27


def fail(message):
    """Stop in one line: under torchrun every rank checks, and rank 0 says why."""
    raise SystemExit(f"error: {message}" if int(os.environ.get("RANK", "0")) == 0 else 1)


def check(config, world_size):
    """What argparse cannot say fails here in one line, before anything heavy loads and with the
    run folder unchanged. Returns the training and held-out prompts (None: the backbone's own), the
    checkpoint out_dir holds (or None), where the backbone's files are, and the folder's claim."""
    try:
        prompts, heldout, location = check_input(config, world_size)
    except ValueError as error:
        fail(error)
    claim, unwritable = None, None  # the folder taken (one writer, our marker) before it is read
    try:
        if int(os.environ.get("RANK", "0")) == 0:
            try:
                claim = files.claim_folder(config.out_dir, "train.py", files.RUN_FILES)
            except files.WriteFailed as error:  # read-only: a finished run is still reported
                unwritable = error
        found = checkpoint.existing_run(saved(config))
        if found and found.get("prompts_digest") not in (None, prompts_digest(prompts, heldout)):
            raise ValueError(
                f"{config.out_dir} holds a run on other prompts: a prompt file changed since it "
                "began; restore the file, or pass another --out-dir for the new prompts"
            )
        if found and found["iteration"] > config.iterations:
            raise ValueError(
                f"{config.out_dir} holds iteration {found['iteration']} of this run, past "
                f"--iterations {config.iterations}; pass --iterations {found['iteration']} or "
                "more, or another --out-dir"
            )
        if not finished(config, found):
            files.check_writable(config.out_dir)
            if unwritable:
                raise unwritable
        return prompts, heldout, found, location, claim
    except BaseException as error:  # a refused or failed start leaves the folder as it was
        if claim is not None:
            files.release(claim)
        if not isinstance(error, ValueError):
            raise
        fail(error)


def check_input(config, world_size):
    """ValueError in one line for the first setting that cannot run. Returns the training and
    held-out prompts (None: the backbone's own) and where the backbone's files are."""
    for item in dataclasses.fields(Config):  # the bounds declared with each field (arg)
        value, flag = getattr(config, item.name), "--" + item.name.replace("_", "-")
        least, positive = item.metadata["least"], item.metadata["positive"]
        why = " for a leave-one-out baseline" if item.name == "rollouts" else ""
        if item.name == "contexts":  # the baseline's own (baselines.MIN_CONTEXTS)
            least, why = MIN_CONTEXTS[config.baseline], f" for --baseline {config.baseline}"
        if value is not None and least is not None and value < least:
            raise ValueError(f"{flag} must be at least {least}{why} (got {value})")
        bound = "> 0" if positive else ">= 0"
        if value is not None and positive is not None:
            if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
                raise ValueError(f"{flag} must be a finite number {bound} (got {value})")
    if not 0 <= config.adam_beta2 < 1:
        raise ValueError(f"--adam-beta2 must be in [0, 1) (got {config.adam_beta2})")
    if not 0 <= config.seed < MAX_SEED:
        raise ValueError(
            f"--seed must be an integer from 0 to {MAX_SEED - 1:,} (got {config.seed}): a training "
            "context's noise seed is built from it and must stay below 2^63"
        )
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device cuda, but this machine has no CUDA device (torch {torch.__version__}); drop "
            "--device to run on the CPU"
        )
    spec = backbones.BACKBONES[config.backbone]
    if config.guidance is not None and spec["guidance"] is None:
        raise ValueError(
            f"--guidance {config.guidance}: {config.backbone} has no guidance input and runs no "
            "CFG (as FLUX.1-schnell, or an exact mixture); drop --guidance"
        )
    if config.contexts % world_size:
        raise ValueError(
            f"--contexts {config.contexts} is not divisible by the {world_size} ranks; choose a "
            "multiple of the number of processes"
        )
    if spec["hub_id"] is not None and config.device is None and not torch.cuda.is_available():
        raise ValueError(
            f"{config.backbone} on a CPU takes hours per update; run on a CUDA machine, or pass "
            "--device cpu to insist (or try --backbone digits)"
        )
    side = spec["resolution"]
    if spec["hub_id"] is None and config.resolution not in (None, side):
        raise ValueError(
            f"--resolution {config.resolution}: {config.backbone} draws {side}x{side} images (its "
            "reward and realism measure read that size); drop --resolution"
        )
    if "folder" in spec and config.eval_contexts <= NEIGHBOURS:
        raise ValueError(
            f"--eval-contexts must be at least {NEIGHBOURS + 1} on a miniature (got "
            f"{config.eval_contexts}): its realism measure compares {NEIGHBOURS}-nearest neighbours"
        )
    if config.threads and config.threads > (os.cpu_count() or 1):
        print(f"note: --threads {config.threads} is more than the {os.cpu_count()} CPU cores")
        config.threads = os.cpu_count()
    if spec["family"] == "mixture" and config.reward in reward_lib.IMAGE_CONTENT:
        raise ValueError(
            f"the {config.reward} reward reads text or objects, which the 8x8 {config.backbone} "
            "images do not have; use a real backbone, or --reward teacher"
        )
    tpdm.check(config, config.tpdm, spec)
    reward_lib.check_digits(config.reward, config.backbone, spec)
    track.check_tracker(config.track)
    if not config.out_dir:  # else existing_run would take the working folder for the run's
        files.check_writable(config.out_dir)
    prompts = load_prompt_file(config.prompts) if config.prompts else None
    heldout = load_prompt_file(config.eval_prompts) if config.eval_prompts else None
    reward_lib.check_prompts(config.reward, (prompts or []) + (heldout or []))
    missing, location = [], None  # every missing model in one message, before either loads
    try:
        reward_lib.check_reward(config.reward, config.reward_checkpoint)
    except ValueError as error:
        missing.append(str(error))
    try:  # where the backbone's files are, each checked whole
        location = backbones.check_files(config.backbone, config.model_path)
    except ValueError as error:
        missing.append(str(error))
    if missing:
        raise ValueError("; ".join(missing))
    return prompts, heldout, location


def prompts_digest(train_prompts, eval_prompts):
    """The prompt files' content, hashed: what a continued run must find unchanged."""
    return hashlib.sha256(json.dumps([train_prompts, eval_prompts]).encode()).hexdigest()[:16]


def finished(config, found):
    """Whether out_dir holds this run, finished: its last checkpoint and the held-out report of
    that checkpoint's iteration (a continuation killed before its report is not finished)."""
    eval_path = os.path.join(config.out_dir, "eval.json")
    if found is None or found["iteration"] < config.iterations or not os.path.isfile(eval_path):
        return False
    try:
        report = files.read_json(eval_path, "")
    except ValueError:  # damaged: report_finished says so
        return True
    return not isinstance(report, dict) or report.get("iteration") == found["iteration"]


def report_finished(config, found):
    """The same command again on a finished run: what is there, neither failing nor overwriting."""
    eval_path = os.path.join(config.out_dir, "eval.json")
    again = "delete it and run the same command again to write the held-out report afresh"
    try:
        report = files.read_json(eval_path, again)
    except ValueError as error:
        fail(error)
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
        fail(f"{eval_path} is not the held-out report of train.py; {again}")
    print(
        f"{config.out_dir} holds this run, finished at iteration {found['iteration']}; its "
        f"held-out table:\n{paired.format_table(report['rows'])}\nto train again, pass another "
        f"--out-dir (or --iterations N > {found['iteration']} to continue)"
    )
    ignored = [flag for flag in ("figure", "track") if getattr(config, flag)]
    if ignored:
        flags = " and ".join("--" + flag for flag in ignored)
        verb = "apply" if len(ignored) > 1 else "applies"
        print(f"note: {flags} {verb} to a run that trains; this one is finished")


# -----------------------------------------------------------------------------
# the run


def main(config):
    # ---------------- ranks and device ----------------
    distributed = "RANK" in os.environ
    if distributed:  # torchrun: nccl on GPUs, gloo on CPUs
        use_cuda = torch.cuda.is_available() and config.device != "cpu"
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if use_cuda else "cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        device, rank, world_size = backbones.check_device(config.device), 0, 1
    master = rank == 0
    if master:  # what one update costs, before anything is checked or loaded
        cost = backbones.update_cost(
            config.backbone, config.contexts, config.rollouts, config.steps, config.guidance
        )
        teacher = f" (the teacher solves {config.contexts} contexts)"
        print(cost + (teacher if config.reward == "teacher" else ""))
    train_prompts, eval_prompts, found, location, claim = check(config, world_size)
    if finished(config, found):
        if master:
            report_finished(config, found)
        if claim is not None:
            claim[0].close()
        return
    if config.threads:
        torch.set_num_threads(config.threads)

    # ---------------- backbone, prompts, reward, policy: whatever can refuse, before any write ----
    torch.manual_seed(config.seed)  # the policy's initialisation; the loop's draws seed their own
    try:  # a refused or failed start leaves the folder as it was
        backbone = backbones.trained_backbone(saved(config), device, location)
        prompts = train_prompts or backbone.prompts
        heldout = heldout_contexts(eval_prompts or backbone.prompts, config.eval_contexts)
        backbone.check_prompts(prompts + heldout[0], config.reward)  # here, not at an iteration
        reward = reward_lib.load_reward(
            config.reward, backbone, device=device, checkpoint=config.reward_checkpoint
        )
        encode = prompt_encoder(backbone, prompts)
        # the method's policy, or the comparator's
        init_times = backbone.default_times(config.steps) if config.init == "default" else None
        try:
            raw_policy = checkpoint.make_policy(
                config.policy,
                backbone.policy_dims,
                config.steps,
                init_times=init_times,
                preset=backbones.BACKBONES[config.backbone]["policy"],
                backbone=config.backbone,
                concentration=config.concentration,
                **tpdm.policy_options(config, config.tpdm, backbone),  # the step-wise policy's
            ).to(device)
        except ValueError as error:  # a concentration too small for the smallest increment
            raise ValueError(f"--concentration {config.concentration}: {error}") from None
    except BaseException as error:
        if claim is not None:
            files.release(claim)
        if not isinstance(error, ValueError):
            raise
        fail(error)
    lock, tracker = (claim or (None,))[0], None
    try:
        if master:
            with files.write_or_exit(config.out_dir):
                files.start_run(config.out_dir, fresh=not found)

        # ---------------- update and optimiser: the method's, or the comparator's ----------------
        update = reinforce_update
        if config.optimizer == "ppo":  # TPDM's update: clipped steps on each batch
            update = functools.partial(tpdm.ppo_update, config.tpdm, config.seed)
        policy = DistributedDataParallel(raw_policy) if distributed else raw_policy
        optimizer = make_optimizer(config, raw_policy.parameters())
        if master:
            size = sum(p.numel() for p in raw_policy.parameters())
            print(f"policy: {config.policy}, {size:,} parameters | {world_size} rank(s), "
                  f"{config.contexts // world_size} contexts each")  # fmt: skip
            heldout_gain = paired.heldout_gain(backbone, reward, heldout, config.steps)
            start = found["iteration"] if found else 0  # the resume below continues there
            tracker = track.open_tracker(config.track, config.out_dir, saved(config), start)

        # ---------------- resume ----------------
        ckpt_path = os.path.join(config.out_dir, "ckpt.pt")
        metrics_path = os.path.join(config.out_dir, "metrics.jsonl")
        start, rows = 0, []
        if found:  # weights, optimizer and RNG state; metrics.jsonl cut back to its iteration
            with files.write_or_exit():
                start = checkpoint.restore(found, raw_policy, optimizer, master and metrics_path)
            if master:
                rows = files.metric_rows(metrics_path)[0]
                print(f"continuing {ckpt_path} from iteration {start}")
        elif master:
            checkpoint.snapshot(config.out_dir, raw_policy, 0, saved(config), config.snapshots)

        # ---------------- the loop ----------------
        contexts_per_rank = config.contexts // world_size
        first = rank * contexts_per_rank  # this rank's contexts in the global batch
        K = config.rollouts
        progress = tqdm(range(start, config.iterations), initial=start, total=config.iterations,
                        disable=not master)  # fmt: skip
        for iteration in progress:
            t0 = time.time()
            # ---------------- contexts: a prompt and an initial noise x_T each, seeded ----------
            generators = [
                torch.Generator().manual_seed(context_seed(config.seed, iteration, first + c))
                for c in range(contexts_per_rank)
            ]
            picks = [torch.randint(len(prompts), (1,), generator=g).item() for g in generators]
            batch_prompts = [prompts[i] for i in picks]
            # ---------------- rollout: K schedules per context, sampled without gradients -------
            noise = torch.cat([backbone.sample_noise(1, g) for g in generators])
            cond = encode(picks)
            rollouts = raw_policy.rollouts(policy, backbone, noise, cond, generators, K)
            with torch.no_grad():
                noise_k = noise.repeat_interleave(K, 0)  # context-major, as the rollouts
                cond_k = {key: v.repeat_interleave(K, 0) for key, v in cond.items()}
                prompts_k = [prompt for prompt in batch_prompts for _ in range(K)]
                rewards = []
                for part in torch.arange(len(prompts_k)).split(
                    config.rollout_batch or len(prompts_k)
                ):
                    cond_part = {key: value[part] for key, value in cond_k.items()}
                    latents = rollouts.sample(part, noise_k[part], cond_part)  # L model calls
                    part_prompts = [prompts_k[i] for i in part]
                    rewards.append(reward(latents, part_prompts, noise_k[part], cond_part))
                rewards = torch.cat(rewards).float().view(contexts_per_rank, -1)  # (B/world, K)
            t_rollout = time.time() - t0

            # ---------------- baselines: pooled over the global batch ----------------
            all_rewards = rewards  # (B, K): every rank's, in rank order
            if distributed:
                gathered = [torch.empty_like(rewards) for _ in range(world_size)]
                dist.all_gather(gathered, rewards)
                all_rewards = torch.cat(gathered)
            check_finite(config, iteration, all_rewards, ckpt_path)
            advantages = all_rewards - BASELINES[config.baseline](all_rewards)  # (B, K), r - b
            advantages = advantages[first : first + contexts_per_rank].flatten().to(device)

            # ---------------- policy gradient ----------------
            lr = get_lr(config, iteration)
            step = functools.partial(optimizer_step, config, raw_policy, optimizer, lr)
            loss, grad_norm, clip_fraction = update(iteration, rollouts, policy, advantages, step)

            # ---------------- log and checkpoint (rank 0) ----------------
            done = iteration + 1
            checkpoint_now = done % config.ckpt_interval == 0 or done == config.iterations
            if not master:
                continue
            row = dict(
                iteration=done,
                reward=all_rewards.mean().item(),
                reward_std=all_rewards.std().item(),
                # the plug-in James-Stein weight of this batch, whichever baseline trains
                shrinkage=shrinkage(all_rewards).item() if config.contexts >= 3 else None,
                loss=loss.item(),
                grad_norm=grad_norm.item(),
                clip_fraction=clip_fraction,
                concentration=rollouts.concentration.item(),  # the Dirichlet's, or each Beta's
                stop_margin=rollouts.stop_margin.item(),  # the mean t_L
                rollout_s=t_rollout,
                step_s=time.time() - t0,
            )
            if checkpoint_now:  # the mean schedule's gain over the default on held-out contexts
                row["heldout_gain"] = heldout_gain(raw_policy)
            rows.append(row)
            with files.write_or_exit(metrics_path), open(metrics_path, "a") as file:
                file.write(json.dumps(row) + "\n")
            if tracker:
                tracker.log(row)
            if done % config.log_interval == 0 or done == config.iterations:
                progress.write(log_line(row))
            if checkpoint_now:  # what a resume needs to continue exactly; every draw is seeded
                state = dict(
                    policy=raw_policy.state_dict(),
                    policy_config=raw_policy.config,
                    optimizer=optimizer.state_dict(),
                    iteration=done,
                    config=saved(config),
                    rng={"torch": torch.get_rng_state()},
                    metrics=rows,  # a resume writes back a row that a torn line lost
                    prompts_digest=prompts_digest(train_prompts, eval_prompts),
                )
                with files.write_or_exit(ckpt_path):
                    checkpoint.save_checkpoint(ckpt_path, state)
                checkpoint.snapshot(
                    config.out_dir, raw_policy, done, saved(config), config.snapshots
                )

        # ---------------- the policy in the Hub format, the held-out report (eval.json last) ----
        if master:
            with files.write_or_exit(config.out_dir):
                if config.figure:
                    plot_training(config.out_dir, backbone, raw_policy, heldout, config.reward)
                policy_dir = os.path.join(config.out_dir, "policy")
                checkpoint.save_policy(policy_dir, raw_policy, saved(config), config.iterations)
                paired.heldout_report(config.out_dir, backbone, reward, raw_policy, *heldout,
                                      config.reward, config.iterations, config.seed)  # fmt: skip
            figure = ", the figure train.png" if config.figure else ""
            print(f"wrote {ckpt_path}, {metrics_path}, eval.json{figure} and policy/ (Hub format) "
                  f"in {config.out_dir}")  # fmt: skip
        if distributed:
            dist.barrier()
    finally:  # however the run ends: the tracker flushed, the process group left, the folder freed
        if tracker is not None:
            tracker.close()
        if distributed:
            dist.destroy_process_group()
        if lock is not None:
            lock.close()


def prompt_encoder(backbone, prompts):
    """picks -> the conditioning of prompts[i] for each i in picks: a prompt set whose encoding
    fits in ENCODED_BYTES is encoded once, here; a larger one batch by batch."""
    few = prompts[:2]  # what a prompt's encoding costs in memory
    size = sum(v.nelement() * v.element_size() for v in backbone.encode_prompts(few).values())
    if size / len(few) * len(prompts) > ENCODED_BYTES:
        return lambda picks: backbone.encode_prompts([prompts[i] for i in picks])
    encoded = backbone.encode_prompts(prompts)
    return lambda picks: {key: v[torch.tensor(picks).to(v.device)] for key, v in encoded.items()}


ENCODED_BYTES = 64 * 2**20


def get_lr(config, iteration):
    """Cosine from config.lr to 0 over the run (or constant): a function of the iteration alone,
    so a resumed run gets the same rates."""
    if config.lr_decay == "constant":
        return config.lr
    return config.lr * 0.5 * (1 + math.cos(math.pi * iteration / config.iterations))


def make_optimizer(config, parameters):
    """AdamW with beta1 0.9; foreach: one kernel per operation over all the policy's tensors."""
    betas, eps, decay = (0.9, config.adam_beta2), config.adam_eps, config.weight_decay
    return torch.optim.AdamW(parameters, config.lr, betas, eps, decay, foreach=True)


def optimizer_step(config, policy, optimizer, lr, loss):
    """One AdamW step on loss at learning rate lr, the gradient norm clipped; returns the norm."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), config.grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return grad_norm


def reinforce_update(iteration, rollouts, policy, advantages, step):
    """REINFORCE: one step on -mean((r - b) log pi); log pi is recomputed with gradients through
    `policy`, which under DDP averages them over the ranks. Returns (loss, grad norm, None)."""
    loss = -(advantages * rollouts.log_prob(policy)).mean()
    return loss, step(loss), None


def log_line(row):
    clipped = "" if row["clip_fraction"] is None else f" | clipped {row['clip_fraction']:.2f}"
    shrunk = "-" if row["shrinkage"] is None else f"{row['shrinkage']:.3f}"
    return (
        f"iter {row['iteration']:5d} | reward {row['reward']:+.5f} | shrinkage a {shrunk} | loss "
        f"{row['loss']:+.4f} | grad {row['grad_norm']:.3f} | concentration "
        f"{row['concentration']:.1f} | stop margin {row['stop_margin']:.4f}{clipped}"
    )


def check_finite(config, iteration, rewards, ckpt_path):
    """Every baseline pools rewards: one NaN would reach every gradient. Stops in one line saying
    what can cause it and where the last good state is."""
    if torch.isfinite(rewards).all():
        return
    last = "no checkpoint was written yet"
    if os.path.isfile(ckpt_path):
        last = f"{ckpt_path} holds the last good state"
    bad = int((~torch.isfinite(rewards)).sum())
    guidance = "" if config.guidance is None else f", --guidance {config.guidance:g}"
    models = f"the backbone ({config.dtype or 'default'} dtype{guidance}) or the reward model"
    cause = f"the policy diverged (learning rate too high? --lr {config.lr:g}) or {models}"
    if iteration == 0:  # no update yet: the schedules are the initial policy's
        cause = f"before any update, so {models}"
    fail(f"iteration {iteration + 1}: {bad} rewards are NaN or inf: {cause} overflowed; {last}")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C: KeyboardInterrupt again
    sys.stdout.reconfigure(errors="backslashreplace")  # the tables' "±" on any terminal
    CONFIG = parse_config()
    try:
        main(CONFIG)
    except KeyboardInterrupt:  # Ctrl-C: one line, what the run folder keeps; 130, as a shell exits
        print(checkpoint.interrupted(CONFIG.out_dir, CONFIG.iterations), file=sys.stderr)
        sys.exit(130)
