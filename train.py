"""
Train an instance-level sampling schedule with REINFORCE and a James-Stein baseline.

CPU, the embedded digits backbone (no download; about a minute):
    python train.py
CPU, a trained miniature SD3 / Flux / SD-XL pipeline shipped in miniatures/ (a few minutes):
    python train.py --backbone mini-sd3 --steps 3
One GPU, a frozen Stable Diffusion 3.5 Medium with the HPSv2 reward, on the shipped prompts:
    python train.py --backbone sd35m --steps 10
Several GPUs (the global batch is the same; each rank takes its share of contexts):
    torchrun --standalone --nproc_per_node=8 train.py --backbone flux-dev --steps 5

The loop is the paper's Algorithm 1. Each iteration draws B contexts c = (prompt, initial noise
x_T); the policy maps each to the concentration alpha of a Dirichlet over the L+1 increments of a
schedule; K schedules tau ~ Dir(alpha) are drawn per context and each is sampled with the frozen
backbone (L model calls) and scored; then one REINFORCE step with a baseline b:
    loss = -mean_{c,i} (r[c,i] - b[c,i]) * log pi(tau[c,i] | x_T, c)
The comparator TPDM (Ye et al., CVPR 2025; comparator/) trains in the same loop: `--policy
stepwise` picks each next time inside the sampling loop from the sampler's state, `--optimizer ppo`
takes clipped PPO steps instead of the one REINFORCE step, with the settings of TPDM's own code
(comparator/tpdm.py). A run folder is never overwritten: running the same command again continues a
killed run from its last checkpoint, or reports a finished one.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import textwrap
import time
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from backbones import BACKBONES
from baselines import BASELINES, MIN_CONTEXTS, shrinkage
from comparator import tpdm
from comparator.tpdm import StepwiseRollouts
from policy import DirichletRollouts
from prompts import DEFAULT, SHIPPED, context_seed
from rewards import REWARDS
from runs import launch
from store.checkpoint import POLICIES, save_checkpoint
from store.track import TRACKERS

# -----------------------------------------------------------------------------
# configuration: one field per line; None = resolved by resolve() below


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # I/O
    out_dir: str | None = arg(None, "run folder; None: out/<backbone>-L<steps>-<policy>-s<seed>")
    resume: bool = arg(False, "insist on continuing out_dir/ckpt.pt (a run is never overwritten)")
    ckpt_interval: int = arg(50, "iterations between checkpoints (a kill loses at most this many)")
    log_interval: int = arg(10, "iterations between log lines")
    snapshots: bool = arg(False, "keep the policy at the start and each checkpoint (snapshots/)")
    figure: bool = arg(False, "also draw train.png: the held-out gain, the learned schedules")
    track: str | None = arg(None, "mirror each log row to tensorboard | wandb (optional packages)")
    # backbone
    backbone: str = arg("digits", "a name in TRAINING (mini-*: the trained miniatures)")
    model_path: str | None = arg(None, "local diffusers folder replacing the hub id")
    resolution: int | None = arg(None, "image side in pixels")
    guidance: float | None = arg(None, "CFG scale (the distilled guidance for flux-dev)")
    prompts: str | None = arg(None, "training prompts: a file (.txt, .json, .jsonl) or hpdv2")
    # policy
    policy: str = arg("instance", "instance (noise and prompt) | global | stepwise (TPDM)")
    steps: int | None = arg(None, "L, model calls per sample; one policy per L")
    init: str | None = arg(None, "default (the backbone's) | uniform | tpdm; None: ppo tpdm")
    concentration: float | None = arg(None, "initial sum(alpha); None: 100 (uniform, L+1: flat)")
    policy_inputs: str | None = arg(None, "stepwise: sampler | hidden (hooks); None: ppo hidden")
    inference: str | None = arg(None, "stepwise: the Beta's mean | mode at evaluation; ppo mode")
    # reward
    reward: str | None = arg(None, "a name in rewards.REWARDS")
    reward_checkpoint: str | None = arg(None, "local reward-model weights (offline machines)")
    # baseline
    baseline: str | None = arg(None, "js | js-unbiased | rloo | xctx (baselines.py); ppo rloo")
    contexts: int | None = arg(None, "B, contexts (prompt + noise) per update, over all ranks")
    rollouts: int | None = arg(None, "K, schedules drawn per context")
    rollout_batch: int | None = arg(None, "samples per backbone call (memory); None = all at once")
    # optim
    iterations: int | None = arg(None, "policy updates")
    lr: float | None = arg(None, "AdamW peak learning rate")
    lr_decay: str | None = arg(None, "cosine (to 0 at the end) | constant; None: ppo constant")
    optimizer: str = arg("reinforce", "reinforce (one step per batch) | ppo (TPDM's, comparator/)")
    ppo_epochs: int = arg(4, "ppo: passes over each batch of rollouts")
    ppo_minibatches: int = arg(1, "ppo: gradient steps per pass")
    ppo_clip: float = arg(0.2, "ppo: the ratio's clip range epsilon")
    weight_decay: float | None = arg(None, "AdamW weight decay; None: 1e-4, ppo 0")
    adam_beta2: float | None = arg(None, "AdamW's beta2 (beta1 is 0.9); None: 0.999, ppo 0.99")
    adam_eps: float | None = arg(None, "AdamW's epsilon; None: 1e-8, ppo 1e-5")
    grad_clip: float = arg(1.0, "gradient-norm clip")
    # evaluation
    eval_contexts: int = arg(256, "held-out contexts for the final table")
    eval_prompts: str | None = arg(None, "held-out prompt file; None = the shipped ones")
    # system
    seed: int = arg(0, "seeds contexts, rollouts and the policy initialisation")
    device: str | None = arg(None, "cpu | cuda; None = cuda if available")
    dtype: str | None = arg(None, "backbone dtype; None = bfloat16 on CUDA, float32 on CPU")
    threads: int | None = arg(None, "CPU threads; None = 1 for the small backbones, else torch's")


# The training defaults of each backbone (model facts such as the hub id, resolution and guidance
# live with the backbones in backbones/__init__.py). The paper states K = 2 and a "batch size" of
# 32 (SD-XL, SD3.5-M) or 16 (SD3.5-L, Flux-Dev), not whether it counts contexts or samples; B = 32
# / 16 contexts is this project's reading, and the rest are this project's choices. steps: L;
# contexts: B; rollouts: K; rollout_batch: samples per backbone call, for GPU memory.
REAL_TRAINING = dict(steps=4, rollouts=2, iterations=1000, lr=1e-4, reward="hpsv2")
EMBEDDED_TRAINING = dict(
    steps=4,
    contexts=32,
    iterations=300,
    lr=3e-3,
    reward="teacher",
    rollout_batch=None,
    policy_inputs="sampler",  # an exact mixture, not a network: it has no hidden states
)
MINIATURE_TRAINING = dict(
    steps=3,
    contexts=16,
    rollouts=4,
    iterations=200,
    lr=3e-3,
    reward="preference",
    rollout_batch=None,
)
TRAINING = {
    "sd35m": dict(REAL_TRAINING, contexts=32, rollout_batch=16),
    "sd35l": dict(REAL_TRAINING, contexts=16, rollout_batch=8),
    "sdxl": dict(REAL_TRAINING, contexts=32, rollout_batch=16),
    "flux-dev": dict(REAL_TRAINING, contexts=16, rollout_batch=8),
    "flux-schnell": dict(REAL_TRAINING, contexts=16, rollout_batch=8),
    "digits": dict(EMBEDDED_TRAINING, rollouts=2),
    "digits-prompt": dict(EMBEDDED_TRAINING, rollouts=8),
    # the noise's signal is weaker than the prompt's; digits-xor's interaction: docs/DESIGN.md
    "digits-noise": dict(EMBEDDED_TRAINING, rollouts=8, iterations=600),
    "digits-xor": dict(EMBEDDED_TRAINING, rollouts=8, iterations=2000),
    "mini-sd3": MINIATURE_TRAINING,
    "mini-flux": MINIATURE_TRAINING,
    "mini-sdxl": MINIATURE_TRAINING,
    # the distilled miniature's own step count, as flux-schnell's: a schedule for a few-step model
    # is asked at the budget it was distilled for
    "mini-flux-schnell": dict(MINIATURE_TRAINING, steps=4),
}
# The update's defaults with --optimizer reinforce, this project's choices (the paper states no
# optimiser); --optimizer ppo takes TPDM's instead (comparator/tpdm.py, tpdm.TPDM).
REINFORCE = dict(
    baseline="js",
    init="default",
    policy_inputs="sampler",
    inference="mean",
    weight_decay=1e-4,
    lr_decay="cosine",
    adam_beta2=0.999,
    adam_eps=1e-8,
)
CHOICES = dict(
    backbone=list(TRAINING),
    policy=list(POLICIES),
    init=["default", "uniform", "tpdm"],
    policy_inputs=["sampler", "hidden"],
    inference=["mean", "mode"],
    reward=list(REWARDS),
    baseline=list(BASELINES),
    lr_decay=["cosine", "constant"],
    optimizer=["reinforce", "ppo"],
    dtype=["bfloat16", "float16", "float32"],
    device=["cpu", "cuda"],
    track=list(TRACKERS),
)


def resolve(config):
    """Every default the command line left open, in one place: the backbone's row of TRAINING
    (its learning rate times tpdm.LR_FACTOR under PPO), the update's
    defaults (REINFORCE, or TPDM's for the step-wise policy under PPO), the shipped prompt files,
    the CPU threads, the run folder. The configuration it returns is printed once (rank 0)."""
    for key, default in TRAINING[config.backbone].items():
        if getattr(config, key) is None:
            setattr(config, key, default)
            if key == "lr" and config.optimizer == "ppo":
                config.lr *= tpdm.LR_FACTOR
    update = tpdm.TPDM if config.optimizer == "ppo" else REINFORCE
    for key, default in update.items():
        if getattr(config, key) is None:  # TPDM's start, inputs, inference: the step-wise policy's
            plain = config.policy != "stepwise" and key in tpdm.STEPWISE_ONLY
            setattr(config, key, REINFORCE[key] if plain else default)
    spec = BACKBONES[config.backbone]
    if spec["family"] != "mixture":  # the miniatures' paraphrases, else the reward's shipped set
        shipped = spec.get("prompts") or SHIPPED.get(config.reward, DEFAULT)
        config.prompts, config.eval_prompts = (
            config.prompts or shipped[0],
            config.eval_prompts or shipped[1],
        )
    if config.threads is None:
        config.threads = spec["threads"]
    if config.threads and config.threads > (os.cpu_count() or 1):
        print(f"note: --threads {config.threads} is more than the {os.cpu_count()} CPU cores")
        config.threads = os.cpu_count()
    if config.out_dir is None:  # one folder per run: the same command finds its own run again
        ppo_suffix = "-ppo" if config.optimizer == "ppo" else ""
        name = f"{config.backbone}-L{config.steps}-{config.policy}{ppo_suffix}-s{config.seed}"
        config.out_dir = os.path.join("out", name)
    if int(os.environ.get("RANK", "0")) == 0:
        settings = " ".join(f"{key}={value}" for key, value in dataclasses.asdict(config).items())
        print("configuration: " + textwrap.fill(settings, 100, subsequent_indent="  "))
    return config


def parse_config(argv=None):
    """argparse from the dataclass (--field-name value, booleans as flags), then resolve()."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.error = lambda message: parser.exit(2, f"train.py: error: {message}\n")  # one line
    for item in dataclasses.fields(Config):
        flag = "--" + item.name.replace("_", "-")
        help = f"{item.metadata['help']} (default: {item.default})"
        if item.type is bool:
            parser.add_argument(flag, action="store_true", help=help)
            continue
        kind = item.type
        if isinstance(kind, types.UnionType):  # "int | None" -> int
            kind = next(arg for arg in kind.__args__ if arg is not type(None))
        parser.add_argument(
            flag, type=kind, default=item.default, choices=CHOICES.get(item.name), help=help
        )
    return resolve(Config(**vars(parser.parse_args(argv))))


# -----------------------------------------------------------------------------
# the update


def get_lr(config, iteration):
    """Cosine from config.lr to 0 over the run (or constant): a function of the iteration alone,
    so a resumed run gets the same rates."""
    if config.lr_decay == "constant":
        return config.lr
    return config.lr * 0.5 * (1 + math.cos(math.pi * iteration / config.iterations))


def make_optimizer(config, parameters):
    """AdamW with beta1 0.9 and the configuration's beta2, epsilon and weight decay (with
    --optimizer ppo: TPDM's Adam(0.9, 0.99), eps 1e-5, no weight decay). foreach: one kernel per
    operation for all the policy's tensors, as on CUDA by default (on a CPU the same numbers as the
    per-tensor loop, faster)."""
    return torch.optim.AdamW(
        parameters,
        lr=config.lr,
        betas=(0.9, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        foreach=True,
    )


def descend(config, policy, optimizer, loss, lr):
    """One AdamW step on loss at learning rate lr, the gradient norm clipped; returns the norm.
    (TPDM's trainer also skips a step whose loss or gradient is not finite; here a NaN reward
    stops the run, launch.check_finite.)"""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), config.grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return grad_norm


# -----------------------------------------------------------------------------
# the training loop


def main(config):
    # ---------------- setup: ranks, inputs, backbone, reward, policy, optimiser, resume ----------
    run = launch.setup(config, functools.partial(make_optimizer, config))
    if run is None:  # out_dir holds this run, finished: reported
        return
    with run:  # the run folder (one writer), the trackers, the process group: until the run ends
        train(config, run)
        # ---------------- held-out evaluation, figure, policy in the Hub format ----------------
        launch.finish(config, run)


def train(config, run):
    """The loop: config.iterations - run.start policy updates, each logged, checkpointed on time."""
    raw_policy, backbone, reward = run.policy, run.backbone, run.reward
    policy = DistributedDataParallel(raw_policy) if run.distributed else raw_policy
    # the one place the policy's kind matters: single pass (policy.py) or step-wise (comparator/)
    Rollouts = StepwiseRollouts if config.policy == "stepwise" else DirichletRollouts
    contexts_per_rank = config.contexts // run.world_size
    first = run.rank * contexts_per_rank  # this rank's contexts in the global batch
    K = config.rollouts
    iterations = range(run.start, config.iterations)
    progress = tqdm(iterations, initial=run.start, total=config.iterations, disable=not run.master)
    for iteration in progress:
        t0 = time.time()
        # ---------------- contexts: a prompt and an initial noise x_T each, seeded ----------------
        generators = [
            torch.Generator().manual_seed(context_seed(config.seed, iteration, first + c))
            for c in range(contexts_per_rank)
        ]
        picks = [torch.randint(len(run.prompts), (1,), generator=g).item() for g in generators]
        batch_prompts = [run.prompts[i] for i in picks]
        # ---------------- rollout: K schedules per context, sampled without gradients -------------
        noise = torch.cat([backbone.sample_noise(1, g) for g in generators])
        cond = run.encode(picks)  # the prompts' token embeddings, mask, pooled embedding
        # the single-pass policy's forward, with gradients (the step-wise one's: inside the loop)
        rollouts = Rollouts(policy, backbone, noise, cond, generators, K)
        with torch.no_grad():
            noise_k = noise.repeat_interleave(K, 0)  # context-major, as the rollouts
            cond_k = {key: v.repeat_interleave(K, 0) for key, v in cond.items()}
            prompts_k = [prompt for prompt in batch_prompts for _ in range(K)]
            rewards = []
            for part in torch.arange(len(prompts_k)).split(config.rollout_batch or len(prompts_k)):
                cond_part = {key: value[part] for key, value in cond_k.items()}
                latents = rollouts.sample(part, noise_k[part], cond_part)  # L model calls
                part_prompts = [prompts_k[i] for i in part]
                rewards.append(reward(latents, part_prompts, noise_k[part], cond_part))
            rewards = torch.cat(rewards).float().view(contexts_per_rank, -1)  # (B/world, K)
        t_rollout = time.time() - t0

        # ---------------- baselines: pooled over the global batch ----------------
        all_rewards = rewards  # (B, K): every rank's, in rank order
        if run.distributed:
            gathered = [torch.empty_like(rewards) for _ in range(run.world_size)]
            dist.all_gather(gathered, rewards)
            all_rewards = torch.cat(gathered)
        launch.check_finite(config, run, iteration, all_rewards)
        advantages = all_rewards - BASELINES[config.baseline](all_rewards)  # (B, K), r - b
        advantages = advantages[first : first + contexts_per_rank].flatten().to(run.device)

        # ---------------- policy gradient ----------------
        # log pi is recomputed with gradients through `policy`, which under DDP averages them over
        # the ranks
        lr = get_lr(config, iteration)
        step = functools.partial(descend, config, raw_policy, run.optimizer, lr=lr)  # AdamW step
        if config.optimizer == "ppo":  # TPDM's: several epochs of clipped steps on this batch
            shuffle = torch.Generator().manual_seed(config.seed * 1_000_003 + iteration)
            log_probs = functools.partial(rollouts.log_prob, policy)
            loss, grad_norm, clip_fraction = tpdm.ppo_update(
                config, log_probs, rollouts.logp, advantages, step, shuffle
            )
        else:  # REINFORCE: one step on -mean((r - b) log pi)
            loss = -(advantages * rollouts.log_prob(policy)).mean()
            grad_norm, clip_fraction = step(loss), math.nan

        # ---------------- log and checkpoint (rank 0) ----------------
        done = iteration + 1
        checkpoint_now = done % config.ckpt_interval == 0 or done == config.iterations
        if not run.master:
            continue
        # shrinkage: the plug-in James-Stein weight of this batch, whichever baseline trains
        enough = config.contexts >= MIN_CONTEXTS["js"]
        row = dict(
            iteration=done,
            reward=all_rewards.mean().item(),
            reward_std=all_rewards.std().item(),
            shrinkage=shrinkage(all_rewards).item() if enough else math.nan,
            loss=loss.item(),
            grad_norm=grad_norm.item(),
            clip_fraction=clip_fraction,
            concentration=rollouts.concentration.item(),  # the Dirichlet's, or each step's Beta
            stop_margin=rollouts.stop_margin.item(),  # the mean t_L
            rollout_s=t_rollout,
            step_s=time.time() - t0,
        )
        if checkpoint_now:  # the mean schedule's gain over the default on held-out contexts
            row["heldout_gain"] = run.heldout_gain(raw_policy)
        run.rows.append(row)
        with launch.written(run.metrics_path), open(run.metrics_path, "a") as file:
            file.write(json.dumps(row) + "\n")
        if run.tracker:
            run.tracker.log(row)
        if done % config.log_interval == 0 or done == config.iterations:
            clipped = f" | clipped {clip_fraction:.2f}" if config.optimizer == "ppo" else ""
            progress.write(
                f"iter {done:5d} | reward {row['reward']:+.5f} | shrinkage a "
                f"{row['shrinkage']:.3f} | loss {row['loss']:+.4f} | grad {row['grad_norm']:.3f} "
                f"| concentration {row['concentration']:.1f} | stop margin "
                f"{row['stop_margin']:.4f}{clipped}"
            )
        if checkpoint_now:  # what a resume needs to continue exactly; every draw has its own seed
            state = dict(
                policy=raw_policy.state_dict(),
                policy_config=raw_policy.config,
                optimizer=run.optimizer.state_dict(),
                iteration=done,
                config=dataclasses.asdict(config),
                rng={"torch": torch.get_rng_state()},
                metrics=run.rows,  # a resume writes back a row that a torn line lost
            )
            with launch.written(run.ckpt_path):
                save_checkpoint(run.ckpt_path, state)
            launch.snapshot(config, raw_policy, done)


if __name__ == "__main__":
    CONFIG = parse_config()
    try:
        main(CONFIG)
    except KeyboardInterrupt:  # Ctrl-C: one line, what the run folder keeps; 130, as a shell exits
        print(launch.interrupted(CONFIG), file=sys.stderr)
        sys.exit(130)
