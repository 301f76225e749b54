"""
Train an instance-level sampling schedule with REINFORCE and a James-Stein baseline.

CPU, the embedded digits backbone (no download, about a minute on 2 cores):
    python train.py
One GPU, a frozen Stable Diffusion 3.5 Medium with the HPSv2 reward:
    python train.py --backbone sd35m --steps 10 --prompts prompts.txt
Several GPUs (the global batch is the same; each rank takes its share of contexts):
    torchrun --standalone --nproc_per_node=8 train.py --backbone flux-dev --steps 5 --prompts prompts.txt
Continue a killed run from its last checkpoint:
    python train.py --out-dir out --resume
"""

import argparse
import dataclasses
import json
import os
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from baselines import BASELINES, MIN_CONTEXTS, shrinkage
from evaluate import default_schedule, evaluate, format_table, policy_schedule, summarize, write_json_atomic
from policy import POLICIES, log_prob, make_policy, mean_increments, sample_increments, times_from_increments
from prompts import context_seed, heldout_contexts, load_prompt_file
from rewards import REWARDS, check_reward, load_reward
from rollout import BACKBONES, load_backbone
from sample import plot_training

# -----------------------------------------------------------------------------
# configuration: one field per line; None means "the backbone's default" (rollout.BACKBONES)


@dataclass
class Config:
    # I/O
    out_dir: str = "out"  # checkpoint, metrics.jsonl, eval.json and the figure go here
    resume: bool = False  # continue from out_dir/ckpt.pt
    ckpt_interval: int = 50  # iterations between checkpoints (a kill loses at most this many)
    log_interval: int = 10  # iterations between log lines
    # backbone
    backbone: str = "digits"  # a name in rollout.BACKBONES
    model_path: str | None = None  # local diffusers folder replacing the hub id
    resolution: int | None = None  # image side in pixels
    guidance: float | None = None  # CFG scale (distilled guidance for flux-dev)
    prompts: str | None = None  # training prompt file (.txt, .json, .jsonl); digits: its ten prompts
    # policy
    policy: str = "instance"  # instance (conditioned on noise and prompt) | global (one schedule for all)
    steps: int = 4  # L, model calls per sample; one policy per L
    init: str = "default"  # default (start at the backbone's schedule) | uniform
    # reward
    reward: str | None = None  # a name in rewards.REWARDS
    reward_checkpoint: str | None = None  # local reward-model weights (offline machines)
    # baseline
    baseline: str = "js"  # js | js-unbiased | rloo | xctx
    contexts: int | None = None  # B, contexts (prompt + noise) per update, over all ranks
    rollouts: int = 2  # K, schedules drawn per context
    rollout_batch: int | None = None  # samples per backbone call (memory); None = all at once
    # optim
    iterations: int | None = None  # policy updates
    lr: float | None = None  # AdamW learning rate
    weight_decay: float = 1e-4  # AdamW weight decay (the paper)
    grad_clip: float = 1.0  # gradient-norm clip (the paper)
    # evaluation
    eval_contexts: int = 256  # held-out contexts for the final table
    eval_prompts: str | None = None  # held-out prompt file for real backbones (digits: its ten prompts, new noises)
    # system
    seed: int = 0  # seeds contexts, rollouts and the policy initialisation
    device: str | None = None  # cpu | cuda; None picks cuda when available
    dtype: str | None = None  # backbone dtype; None = bfloat16 on CUDA, float32 on CPU


CHOICES = dict(backbone=list(BACKBONES), policy=list(POLICIES), init=["default", "uniform"], reward=list(REWARDS),
               baseline=list(BASELINES), dtype=["bfloat16", "float16", "float32"])
# The global policy is one vector of logits with no network in front: at the instance policy's
# learning rate it barely moves in a digits run.
GLOBAL_LR_FACTOR = 30


def parse_config(argv=None):
    """argparse built from the dataclass fields: --field-name value, booleans as flags, names with choices."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: parser.exit(2, f"train.py: error: {message}\n")  # one line, without the usage
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        if field.type is bool:
            parser.add_argument(flag, action="store_true")
            continue
        kind = field.type
        if isinstance(kind, types.UnionType):  # "int | None" -> int
            kind = next(arg for arg in kind.__args__ if arg is not type(None))
        parser.add_argument(flag, type=kind, default=field.default, choices=CHOICES.get(field.name))
    config = Config(**vars(parser.parse_args(argv)))
    for key in ("contexts", "iterations", "lr", "reward", "rollout_batch"):
        if getattr(config, key) is None:
            default = BACKBONES[config.backbone][key]
            setattr(config, key, default * GLOBAL_LR_FACTOR if key == "lr" and config.policy == "global" else default)
    return config


def check_config(config, world_size):
    """What argparse cannot say fails here in one line, before anything heavy is loaded. Returns the
    training prompts of --prompts (None: the backbone's own)."""
    if config.steps < 1:
        raise SystemExit(f"error: --steps must be at least 1 (got {config.steps})")
    if config.rollouts < 2:
        raise SystemExit(f"error: --rollouts must be at least 2 for a leave-one-out baseline (got {config.rollouts})")
    if config.contexts < MIN_CONTEXTS[config.baseline]:
        raise SystemExit(f"error: --baseline {config.baseline} needs at least {MIN_CONTEXTS[config.baseline]} contexts "
                         f"per update (got --contexts {config.contexts}); raise --contexts")
    if config.contexts % world_size:
        raise SystemExit(f"error: --contexts {config.contexts} is not divisible by the {world_size} ranks; "
                         "choose a multiple of the number of processes")
    if BACKBONES[config.backbone]["family"] != "mixture" and config.prompts is None:
        raise SystemExit("error: real backbones train on a prompt list; pass --prompts FILE (.txt, .json, .jsonl)")
    try:
        prompts = load_prompt_file(config.prompts) if config.prompts else None
        if config.eval_prompts:
            load_prompt_file(config.eval_prompts)
    except ValueError as error:
        raise SystemExit(f"error: {error}")
    ckpt_path = os.path.join(config.out_dir, "ckpt.pt")
    if config.resume:
        if not os.path.isfile(ckpt_path):
            raise SystemExit(f"error: --resume but {ckpt_path} does not exist; drop --resume to start afresh")
        saved = torch.load(ckpt_path, map_location="cpu", weights_only=False)["config"]
        for key in ("backbone", "steps", "policy", "contexts", "rollouts"):
            if saved[key] != getattr(config, key):
                raise SystemExit(f"error: {ckpt_path} was trained with {key}={saved[key]!r}, not {getattr(config, key)!r}; "
                                 f"pass --{key} {saved[key]} or another --out-dir")
    elif os.path.isfile(ckpt_path):
        raise SystemExit(f"error: {ckpt_path} exists; pass --resume to continue it or choose another --out-dir")
    return prompts


def save_checkpoint(path, state):
    """Written to a temporary file, then renamed: a kill never leaves a corrupt checkpoint."""
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


# -----------------------------------------------------------------------------
# the training job


def main(config):
    distributed = "RANK" in os.environ
    if distributed:
        use_cuda = torch.cuda.is_available() and config.device != "cpu"
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")
        if use_cuda:
            torch.cuda.set_device(device)
    else:
        rank, world_size = 0, 1
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    master = rank == 0
    prompts = check_config(config, world_size)
    contexts_per_rank = config.contexts // world_size
    torch.manual_seed(config.seed)

    try:  # missing or gated weights, a missing reward package: one line, before the heavy loading
        check_reward(config.reward, config.reward_checkpoint)
        backbone = load_backbone(config.backbone, path=config.model_path, device=device, resolution=config.resolution,
                                 dtype=getattr(torch, config.dtype) if config.dtype else None, guidance=config.guidance)
    except ValueError as error:
        raise SystemExit(f"error: {error}")
    prompts = prompts or backbone.prompts
    reward = load_reward(config.reward, backbone, device=device, checkpoint=config.reward_checkpoint)
    default_times = backbone.default_times(config.steps)

    raw_policy = make_policy(config.policy, backbone.policy_dims, config.steps, preset=BACKBONES[config.backbone]["policy"],
                             init_times=default_times if config.init == "default" else None).to(device)
    optimizer = torch.optim.AdamW(raw_policy.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    start = 0
    ckpt_path = os.path.join(config.out_dir, "ckpt.pt")
    metrics_path = os.path.join(config.out_dir, "metrics.jsonl")
    if config.resume:
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        raw_policy.load_state_dict(checkpoint["policy"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        torch.set_rng_state(checkpoint["rng"]["torch"])
        start = checkpoint["iteration"]
        if master:  # rows logged after the checkpoint will be logged again
            with open(metrics_path) as file:
                rows = [line for line in file if json.loads(line)["iteration"] <= start]
            with open(metrics_path + ".tmp", "w") as file:
                file.writelines(rows)
            os.replace(metrics_path + ".tmp", metrics_path)
    policy = DistributedDataParallel(raw_policy) if distributed else raw_policy

    if master:
        os.makedirs(config.out_dir, exist_ok=True)
        print(f"backbone {config.backbone} | L = {config.steps} steps | {config.policy} policy, "
              f"{sum(p.numel() for p in raw_policy.parameters()):,} parameters\nB = {config.contexts} contexts x K = "
              f"{config.rollouts} rollouts = {config.contexts * config.rollouts} samples per update | {world_size} rank(s), "
              f"{contexts_per_rank} contexts each | baseline {config.baseline} | reward {config.reward}")

    progress = tqdm(range(start, config.iterations), initial=start, total=config.iterations, disable=not master)
    first = rank * contexts_per_rank  # this rank's contexts in the global batch
    for iteration in progress:
        t0 = time.time()
        # ---------------- rollout: this rank's contexts, K schedules each, no gradients ----------------
        generators = [torch.Generator().manual_seed(context_seed(config.seed, iteration, first + c)) for c in range(contexts_per_rank)]
        batch_prompts = [prompts[torch.randint(len(prompts), (1,), generator=g).item()] for g in generators]
        with torch.no_grad():
            noise = torch.cat([backbone.sample_noise(1, g) for g in generators])
            cond = backbone.encode_prompts(batch_prompts)
            inputs = backbone.policy_inputs(noise, cond)
            alpha = raw_policy(**inputs)  # (B/world, L+1)
            tau = torch.cat([sample_increments(alpha[c : c + 1], config.rollouts, g) for c, g in enumerate(generators)])  # (B/world, K, L+1)
            times = times_from_increments(tau).flatten(0, 1).to(device)  # (B/world * K, L+1), context-major
            noise_k = noise.repeat_interleave(config.rollouts, 0)
            cond_k = {key: value.repeat_interleave(config.rollouts, 0) for key, value in cond.items()}
            prompts_k = [prompt for prompt in batch_prompts for _ in range(config.rollouts)]
            rewards = []
            for part in torch.arange(len(prompts_k)).split(config.rollout_batch or len(prompts_k)):
                cond_part = {key: value[part] for key, value in cond_k.items()}
                latents = backbone.sample(noise_k[part], cond_part, times[part])
                rewards.append(reward(latents, [prompts_k[i] for i in part], noise_k[part], cond_part))
            rewards = torch.cat(rewards).float().view(contexts_per_rank, config.rollouts)  # (B/world, K)
        t_rollout = time.time() - t0

        # ---------------- baselines: pooled over the global batch ----------------
        if distributed:
            gathered = [torch.empty_like(rewards) for _ in range(world_size)]
            dist.all_gather(gathered, rewards)
            all_rewards = torch.cat(gathered)  # (B, K)
        else:
            all_rewards = rewards
        if not torch.isfinite(all_rewards).all():  # every baseline pools rewards: one NaN would reach every gradient
            raise SystemExit(f"error: iteration {iteration + 1}: {int((~torch.isfinite(all_rewards)).sum())} rewards are "
                             f"NaN or inf; the reward model or the backbone ({config.dtype or 'default'} dtype) broke")
        baseline = BASELINES[config.baseline](all_rewards)  # (B, K), detached
        advantages = (all_rewards - baseline)[first : first + contexts_per_rank].to(device)

        # ---------------- policy gradient: recompute log pi(tau) with grad ----------------
        alpha = policy(**inputs)  # (B/world, L+1), through DDP so gradients are averaged over ranks
        logp = log_prob(alpha, tau.to(device))  # (B/world, K): the joint Dirichlet log-density, a sum over L+1
        loss = -(advantages.detach() * logp).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_policy.parameters(), config.grad_clip)
        optimizer.step()

        # ---------------- checkpoint and log ----------------
        done = iteration + 1
        if master:
            row = dict(iteration=done, reward=all_rewards.mean().item(), reward_std=all_rewards.std().item(),
                       shrinkage=shrinkage(all_rewards).item() if config.contexts >= MIN_CONTEXTS["js"] else float("nan"),
                       loss=loss.item(), grad_norm=grad_norm.item(), concentration=alpha.detach().sum(-1).mean().item(),
                       stop_margin=mean_increments(alpha.detach())[:, -1].mean().item(),  # t_L of the mean schedule
                       rollout_s=t_rollout, step_s=time.time() - t0)
            with open(metrics_path, "a") as file:
                file.write(json.dumps(row) + "\n")
            if done % config.log_interval == 0 or done == config.iterations:
                progress.write(f"iter {done:5d} | reward {row['reward']:+.5f} | shrinkage a {row['shrinkage']:.3f} | "
                               f"loss {row['loss']:+.4f} | grad {row['grad_norm']:.3f} | concentration "
                               f"{row['concentration']:.1f} | stop margin {row['stop_margin']:.4f}")
            if done % config.ckpt_interval == 0 or done == config.iterations:
                save_checkpoint(ckpt_path, dict(policy=raw_policy.state_dict(), policy_config=raw_policy.config,
                                                optimizer=optimizer.state_dict(), iteration=done,
                                                config=dataclasses.asdict(config), rng={"torch": torch.get_rng_state()}))

    # ---------------- held-out evaluation (rank 0) ----------------
    if master:
        report(config, backbone, reward, raw_policy)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def report(config, backbone, reward, policy):
    """The final table: held-out contexts never seen in training, the same noises for every method."""
    if backbone.prompts is None and config.eval_prompts is None:
        print(f"no held-out prompts (--eval-prompts); evaluate with: python evaluate.py --ckpt {config.out_dir}/ckpt.pt --hpdv2 DIR")
        return
    prompts, seeds = heldout_contexts(load_prompt_file(config.eval_prompts) if config.eval_prompts else backbone.prompts,
                                      config.eval_contexts)
    methods = {"default": default_schedule(backbone, config.steps), "learned (mean)": policy_schedule(policy, backbone),
               "learned (sampled)": policy_schedule(policy, backbone, "sample", torch.Generator().manual_seed(config.seed))}
    teacher = "limit (teacher)" if config.reward == "teacher" else None  # the reward's own target: error 0
    scores = evaluate(backbone, reward, prompts, seeds, methods, reference=teacher)
    rows = summarize(scores)
    print(f"\nheld-out evaluation: {len(seeds)} contexts, reward {config.reward}, L = {config.steps}\n{format_table(rows)}")
    write_json_atomic(os.path.join(config.out_dir, "eval.json"),  # ablation.py takes an existing one as a finished run
                      dict(rows=rows, steps=config.steps, contexts=len(seeds), reward=config.reward))
    plot_training(config.out_dir, backbone, policy, config.steps, prompts[:8], seeds[:8], config.reward)


if __name__ == "__main__":
    main(parse_config())
