"""
Train an instance-level sampling schedule with REINFORCE and a James-Stein baseline.

CPU, the embedded digits backbone (no download; minutes on a laptop):
    python train.py
CPU, a trained miniature SD3 / Flux / SD-XL pipeline shipped in miniatures/ (about 2 minutes):
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
The comparator TPDM (Ye et al., CVPR 2025; stepwise.py) trains in the same loop: `--policy
stepwise` picks each next time inside the sampling loop from the sampler's state, `--optimizer ppo`
takes clipped PPO steps instead of the one REINFORCE step, with the settings of TPDM's own code
(OPTIMIZERS below). A run folder is never overwritten: running the same
command again continues a killed run from its last checkpoint, or reports a finished one.
"""

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import types
from dataclasses import dataclass, field

# -----------------------------------------------------------------------------
# configuration: one field per line; None = the backbone's default in TRAINING below


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
    optimizer: str = arg("reinforce", "reinforce (one step per batch) | ppo (TPDM's, stepwise.py)")
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
# live with the backbones in backbones.py). The paper states K = 2 and a "batch size" of 32 (SD-XL,
# SD3.5-M) or 16 (SD3.5-L, Flux-Dev), not whether it counts contexts or samples; B = 32 / 16
# contexts is this project's reading, and the rest are this project's choices. steps: L;
# contexts: B; rollouts: K; rollout_batch: samples per backbone call, for GPU memory.
HUB = dict(steps=4, rollouts=2, iterations=1000, lr=1e-4, reward="hpsv2")
EMBEDDED = dict(
    steps=4,
    contexts=32,
    iterations=300,
    lr=3e-3,
    reward="teacher",
    rollout_batch=None,
    policy_inputs="sampler",  # an exact mixture, not a network: it has no hidden states
)
MINIATURE = dict(
    steps=3,
    contexts=16,
    rollouts=4,
    iterations=200,
    lr=3e-3,
    reward="preference",
    rollout_batch=None,
)
TRAINING = {
    "sd35m": dict(HUB, contexts=32, rollout_batch=16),
    "sd35l": dict(HUB, contexts=16, rollout_batch=8),
    "sdxl": dict(HUB, contexts=32, rollout_batch=16),
    "flux-dev": dict(HUB, contexts=16, rollout_batch=8),
    "flux-schnell": dict(HUB, contexts=16, rollout_batch=8),
    "digits": dict(EMBEDDED, rollouts=2),
    "digits-prompt": dict(EMBEDDED, rollouts=8),
    "digits-noise": dict(EMBEDDED, rollouts=8, iterations=600),  # the noise's signal is weaker
    "digits-xor": dict(EMBEDDED, rollouts=8, iterations=2000),  # the interaction: see README
    "mini-sd3": MINIATURE,
    "mini-flux": MINIATURE,
    "mini-sdxl": MINIATURE,
    # the distilled miniature's own step count, as flux-schnell's: a schedule for a few-step model
    # is asked at the budget it was distilled for
    "mini-flux-schnell": dict(MINIATURE, steps=4),
}
# The defaults that follow --optimizer. reinforce: this project's choices (the paper states no
# optimiser). ppo: TPDM's own code (github.com/maple-research-lab/TPDM; README names each file):
# RLOO advantages over the K rollouts, not normalised (src/train/rloo_trainer.py); Adam(0.9, 0.99),
# eps 1e-5, no weight decay, a constant rate (scripts/launch_sd3_train.sh; AdamW with weight decay
# 0 is Adam); head bias (2.5, 1.0), the hidden states as inputs and the Beta's mode at inference
# (src/models/stable_diffusion_3/modeling_sd3_pnt.py). init, policy_inputs and inference are the
# step-wise policy's (the others take init "default").
OPTIMIZERS = {
    "reinforce": dict(
        baseline="js",
        init="default",
        policy_inputs="sampler",
        inference="mean",
        weight_decay=1e-4,
        lr_decay="cosine",
        adam_beta2=0.999,
        adam_eps=1e-8,
    ),
    "ppo": dict(
        baseline="rloo",
        init="tpdm",
        policy_inputs="hidden",
        inference="mode",
        weight_decay=0.0,
        lr_decay="constant",
        adam_beta2=0.99,
        adam_eps=1e-5,
    ),
}
GLOBAL_LR_FACTOR = 60  # --policy global is bare logits: at the instance policy's lr it barely moves
# --optimizer ppo takes ppo_epochs x ppo_minibatches Adam steps per batch. TPDM's lr (1e-6 for
# SD3's 2-conv head) does not transfer to this network and budget; this factor is not tuned for
# TPDM's settings: tune --lr on training contexts (README, "The comparator")
PPO_LR_FACTOR = 1 / 30
CHOICES = dict(
    backbone=list(TRAINING),
    policy=["instance", "global", "stepwise"],
    init=["default", "uniform", "tpdm"],
    policy_inputs=["sampler", "hidden"],
    inference=["mean", "mode"],
    reward=["teacher", "hpsv2", "clip", "ocr", "geneval", "digit", "preference"],
    baseline=["js", "js-unbiased", "rloo", "xctx"],
    lr_decay=["cosine", "constant"],
    optimizer=["reinforce", "ppo"],
    dtype=["bfloat16", "float16", "float32"],
    device=["cpu", "cuda"],
)


def advantages_of(rewards, baseline):
    """Rewards (B, K) -> advantages r - b (B, K) with the baseline named `baseline`, not
    normalised (TPDM's rloo_trainer.py does not normalise either)."""
    return rewards - BASELINES[baseline](rewards)


def get_lr(config, iteration):
    """Cosine from config.lr to 0 over the run (or constant): a function of the iteration alone,
    so a resumed run gets the same rates."""
    if config.lr_decay == "constant":
        return config.lr
    return config.lr * 0.5 * (1 + math.cos(math.pi * iteration / config.iterations))


def descend(config, run, loss, lr):
    """One AdamW step on loss at learning rate lr, the gradient norm clipped; returns the norm.
    (TPDM's trainer also skips a step whose loss or gradient is not finite; here a NaN reward
    stops the run, launch.check_finite.)"""
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_policy.parameters(), config.grad_clip)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.step()
    return grad_norm


def parse_config(argv=None):
    """argparse from the dataclass (--field-name value, booleans as flags), then TRAINING's
    defaults for the fields left None."""
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
    config = Config(**vars(parser.parse_args(argv)))
    for key, default in TRAINING[config.backbone].items():
        if getattr(config, key) is None:
            setattr(config, key, default)
            if key == "lr" and config.policy == "global":
                config.lr *= GLOBAL_LR_FACTOR
            if key == "lr" and config.optimizer == "ppo":
                config.lr *= PPO_LR_FACTOR
    for key, default in OPTIMIZERS[config.optimizer].items():
        if getattr(config, key) is None:  # TPDM's start, inputs, inference: the step-wise policy's
            stepwise_only = key in ("init", "policy_inputs", "inference")
            plain = config.policy != "stepwise" and stepwise_only
            setattr(config, key, OPTIMIZERS["reinforce"][key] if plain else default)
    if config.out_dir is None:  # one folder per run: the same command finds its own run again
        ppo = "-ppo" if config.optimizer == "ppo" else ""
        name = f"{config.backbone}-L{config.steps}-{config.policy}{ppo}-s{config.seed}"
        config.out_dir = os.path.join("out", name)
    return config


if __name__ == "__main__":
    CONFIG = parse_config()  # before torch and the models load, so that --help answers at once

import time  # noqa: E402

import torch  # noqa: E402

import launch  # noqa: E402
import stepwise  # noqa: E402
from baselines import BASELINES, MIN_CONTEXTS, shrinkage  # noqa: E402
from policy import log_prob, mean_increments, sample_increments, times_from_increments  # noqa: E402
from prompts import context_seed  # noqa: E402

# -----------------------------------------------------------------------------
# the training loop


def main(config):
    run = launch.setup(config)  # checks, devices, backbone, reward, policy, resume: launch.py
    if run is None:  # the run is finished
        return
    backbone, reward, prompts = run.backbone, run.reward, run.prompts
    contexts_per_rank = config.contexts // run.world_size
    first = run.rank * contexts_per_rank  # this rank's contexts in the global batch
    per_step = config.policy == "stepwise"  # TPDM's policy: stepwise.py
    K = config.rollouts
    progress = launch.progress_bar(config, run)
    for iteration in progress:  # from run.start: 0, or where a resumed run stopped
        t0 = time.time()
        # ---------------- contexts: a prompt and an initial noise x_T each, seeded ----------------
        generators = [
            torch.Generator().manual_seed(context_seed(config.seed, iteration, first + c))
            for c in range(contexts_per_rank)
        ]
        batch_prompts = [
            prompts[torch.randint(len(prompts), (1,), generator=g).item()] for g in generators
        ]
        # ---------------- rollout: K schedules per context, sampled without gradients -------------
        with torch.no_grad():
            noise = torch.cat([backbone.sample_noise(1, g) for g in generators])
            cond = backbone.encode_prompts(batch_prompts)
            if per_step:  # the policy picks each next time inside the loop; K draw streams each
                seeds = torch.cat([torch.randint(2**62, (K,), generator=g) for g in generators])
                draws = [torch.Generator().manual_seed(seed) for seed in seeds.tolist()]
                times = stepwise.start_times(len(draws), config.steps)  # t_0 = 1, the rest chosen
            else:  # single pass: the whole schedule from x_T and the prompt, before the loop
                inputs = backbone.policy_inputs(noise, cond)
                alpha = run.raw_policy(**inputs)  # (B/world, L+1) Dirichlet concentrations
                tau = [sample_increments(alpha[c : c + 1], K, g) for c, g in enumerate(generators)]
                tau = torch.cat(tau)  # (B/world, K, L+1) increments
                times = times_from_increments(tau).flatten(0, 1)  # (B/world * K, L+1)
            noise_k = noise.repeat_interleave(K, 0)  # context-major, as times
            cond_k = {key: v.repeat_interleave(K, 0) for key, v in cond.items()}
            prompts_k = [prompt for prompt in batch_prompts for _ in range(K)]
            rewards, records = [], []
            for part in torch.arange(len(prompts_k)).split(config.rollout_batch or len(prompts_k)):
                cond_part = {key: value[part] for key, value in cond_k.items()}
                stepper = None  # single pass: the times are given
                if per_step:
                    part_draws = [draws[i] for i in part]
                    stepper = stepwise.Stepper(run.raw_policy, backbone, cond_part, part_draws)
                # L model calls
                with stepper or contextlib.nullcontext():  # the hidden-state hooks, if read
                    latents = backbone.sample(noise_k[part], cond_part, times[part], stepper)
                part_prompts = [prompts_k[i] for i in part]
                rewards.append(reward(latents, part_prompts, noise_k[part], cond_part))
                records.append(stepper.record() if per_step else None)
            rewards = torch.cat(rewards).float().view(contexts_per_rank, -1)  # (B/world, K)
            # logged: the mean concentration (the Dirichlet's, or each step's Beta) and stop margin
            if per_step:
                record = stepwise.join_records(records)
                logp_old = record["logp"]
                spread = record["parameters"].sum(-1).mean(), record["times"][:, -1].mean()
            else:
                logp_old = log_prob(alpha, tau.to(run.device)).flatten()
                spread = alpha.sum(-1).mean(), mean_increments(alpha)[:, -1].mean()
        t_rollout = time.time() - t0

        # ---------------- baselines: pooled over the global batch ----------------
        all_rewards = launch.gather(run, rewards)  # (B, K): every rank's, in rank order
        launch.check_finite(config, run, iteration, all_rewards)
        advantages = advantages_of(all_rewards, config.baseline)  # (B, K), r - b, detached
        advantages = advantages[first : first + contexts_per_rank].flatten().to(run.device)

        # ---------------- policy gradient ----------------
        # The policy runs a second time, now with gradients (through DDP, which averages them over
        # ranks): the rollout above only needed its output, and keeping that graph alive through
        # the L model calls would hold memory for nothing.
        def log_probs(index):  # log pi of the samples `index` (context-major), (len,)
            if per_step:  # the sum of the L Beta log-densities, from the recorded states
                return stepwise.trajectory_log_prob(run.policy, record, index)
            alpha = run.policy(**inputs)  # (B/world, L+1)
            return log_prob(alpha, tau.to(run.device)).flatten()[index]  # the Dirichlet density

        lr, clip_fraction = get_lr(config, iteration), math.nan
        if config.optimizer == "ppo":  # TPDM's: several epochs of clipped steps on this batch
            shuffle = torch.Generator().manual_seed(config.seed * 1_000_003 + iteration)
            step = functools.partial(descend, config, run, lr=lr)
            loss, grad_norm, clip_fraction = stepwise.ppo_update(
                config, log_probs, logp_old, advantages, step, shuffle
            )
        else:  # REINFORCE: one step on -mean((r - b) log pi)
            loss = -(advantages * log_probs(slice(None))).mean()
            grad_norm = descend(config, run, loss, lr)

        # ---------------- log and checkpoint (rank 0) ----------------
        done = iteration + 1
        checkpoint_now = done % config.ckpt_interval == 0 or done == config.iterations
        if not run.master:
            continue
        # shrinkage: the plug-in James-Stein weight of this batch, whichever baseline trains
        enough = config.contexts >= MIN_CONTEXTS["js"]
        js_weight = shrinkage(all_rewards).item() if enough else math.nan
        row = dict(
            iteration=done,
            reward=all_rewards.mean().item(),
            reward_std=all_rewards.std().item(),
            shrinkage=js_weight,
            loss=loss.item(),
            grad_norm=grad_norm.item(),
            clip_fraction=clip_fraction,
            concentration=spread[0].item(),
            stop_margin=spread[1].item(),
            rollout_s=t_rollout,
            step_s=time.time() - t0,
        )
        if checkpoint_now:  # the held-out gain on the first 32 held-out contexts
            row["heldout_gain"] = run.curve(run.raw_policy)
        launch.log(config, run, row, progress)
        if checkpoint_now:  # policy, optimizer, iteration, configuration: launch.checkpoint
            launch.checkpoint(config, run, done)

    # ---------------- held-out evaluation, figure, policy in the Hub format ----------------
    launch.finish(config, run)


if __name__ == "__main__":
    main(CONFIG)
