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
from evaluate import (
    context_noise, default_schedule, draw_schedules, evaluate, format_table, heldout_contexts, load_prompt_file,
    policy_schedule, summarize, write_json_atomic,
)
from policy import log_prob, make_policy, mean_increments, sample_increments, times_from_increments
from rewards import REWARDS, check_finite, check_reward, load_reward
from rollout import BACKBONES, load_backbone

# -----------------------------------------------------------------------------
# configuration: one field per line; None means "the backbone's default" (BACKBONE_DEFAULTS)


@dataclass
class Config:
    # I/O
    out_dir: str = "out"  # checkpoint, metrics.jsonl, eval.json and the figure go here
    resume: bool = False  # continue from out_dir/ckpt.pt
    ckpt_interval: int = 50  # iterations between checkpoints (a kill loses at most this many)
    log_interval: int = 10  # iterations between log lines
    # backbone
    backbone: str = "digits"  # one of rollout.BACKBONES
    model_path: str | None = None  # local folder replacing the hub id
    resolution: int | None = None  # image side in pixels
    guidance: float | None = None  # CFG scale (distilled guidance for flux-dev)
    prompts: str | None = None  # training prompts: a .txt (one per line) or a .json list
    # policy
    policy: str = "instance"  # instance (conditioned on noise and prompt) | global (one schedule)
    steps: int = 4  # L, model calls per sample; one policy per L
    init: str = "default"  # default (start at the backbone's schedule) | uniform
    # reward
    reward: str | None = None  # one of rewards.REWARDS
    reward_checkpoint: str | None = None  # local reward-model checkpoint (offline machines)
    # baseline
    baseline: str = "js"  # js | js-unbiased | rloo | xctx
    contexts: int | None = None  # B, contexts (prompt + noise) per update, over all ranks
    rollouts: int = 2  # K, schedules drawn per context
    rollout_batch: int | None = None  # samples per backbone call (memory), None = all at once
    # optim
    iterations: int | None = None  # policy updates
    lr: float | None = None  # AdamW learning rate
    weight_decay: float = 1e-4  # AdamW weight decay (paper)
    grad_clip: float = 1.0  # gradient-norm clip (paper)
    # evaluation
    eval_contexts: int = 256  # held-out contexts for the final table
    eval_prompts: str | None = None  # held-out prompt file for real backbones (digits: its 10 classes, new noises)
    # system
    seed: int = 0  # seeds contexts, rollouts and the policy initialisation
    device: str | None = None  # cpu | cuda; None picks cuda when available
    dtype: str | None = None  # backbone dtype (bfloat16 | float32); None = bf16 on CUDA


# The paper's batch sizes (K = 2; B = 32 for SD-XL and SD3.5-M, 16 for SD3.5-L and Flux-Dev).
# It does not state learning rate or iteration count; these are this project's choices.
BACKBONE_DEFAULTS = {
    "digits": dict(contexts=32, iterations=300, lr=3e-3, reward="teacher", rollout_batch=None),
    "sd35m": dict(contexts=32, iterations=1000, lr=1e-4, reward="hpsv2", rollout_batch=16),
    "sd35l": dict(contexts=16, iterations=1000, lr=1e-4, reward="hpsv2", rollout_batch=8),
    "sdxl": dict(contexts=32, iterations=1000, lr=1e-4, reward="hpsv2", rollout_batch=16),
    "flux-dev": dict(contexts=16, iterations=1000, lr=1e-4, reward="hpsv2", rollout_batch=8),
    "flux-schnell": dict(contexts=16, iterations=1000, lr=1e-4, reward="hpsv2", rollout_batch=8),
}
# The global policy is one vector of logits: at the instance policy's learning rate it barely moves
# in 300 digits iterations (5% better than default, against 30% at 30x the rate).
GLOBAL_LR_FACTOR = 30


def parse_config(argv=None):
    """argparse built from the dataclass fields: --field-name value, booleans as flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        if field.type is bool:
            parser.add_argument(flag, action="store_true")
            continue
        kind = field.type
        if isinstance(kind, types.UnionType):  # "int | None" -> int
            kind = next(arg for arg in kind.__args__ if arg is not type(None))
        parser.add_argument(flag, type=kind, default=field.default)
    config = Config(**vars(parser.parse_args(argv)))
    defaults = dict(BACKBONE_DEFAULTS.get(config.backbone, {}))
    if config.policy == "global" and "lr" in defaults:  # bare logits, no network in front: larger steps
        defaults["lr"] *= GLOBAL_LR_FACTOR
    for key, value in defaults.items():
        if getattr(config, key) is None:
            setattr(config, key, value)
    return config


def check_config(config, world_size):
    """Every bad input fails here, in one line, before anything heavy is loaded. Returns the training
    prompts of --prompts (None: the backbone's own, digits)."""
    if config.backbone not in BACKBONES:
        raise SystemExit(f"error: unknown backbone {config.backbone!r}; choose one of {', '.join(BACKBONES)}")
    if config.reward not in REWARDS:
        raise SystemExit(f"error: unknown reward {config.reward!r}; choose one of {', '.join(REWARDS)}")
    if config.baseline not in BASELINES:
        raise SystemExit(f"error: unknown baseline {config.baseline!r}; choose one of {', '.join(BASELINES)}")
    if config.policy not in ("instance", "global"):
        raise SystemExit(f"error: --policy must be instance or global, not {config.policy!r}")
    if config.init not in ("default", "uniform"):
        raise SystemExit(f"error: --init must be default or uniform, not {config.init!r}")
    if config.dtype not in (None, "bfloat16", "float16", "float32"):
        raise SystemExit(f"error: --dtype must be bfloat16, float16 or float32, not {config.dtype!r}")
    if config.steps < 1:
        raise SystemExit(f"error: --steps must be at least 1 (got {config.steps})")
    if config.rollouts < 2:
        raise SystemExit(f"error: --rollouts must be at least 2 for a leave-one-out baseline (got {config.rollouts})")
    if config.contexts < MIN_CONTEXTS[config.baseline]:
        raise SystemExit(
            f"error: --baseline {config.baseline} needs at least {MIN_CONTEXTS[config.baseline]} contexts "
            f"per update (got --contexts {config.contexts}); raise --contexts"
        )
    if config.contexts % world_size:
        raise SystemExit(
            f"error: --contexts {config.contexts} is not divisible by the {world_size} ranks; "
            "choose a multiple of the number of processes"
        )
    if config.backbone != "digits" and config.prompts is None:
        raise SystemExit("error: real backbones train on a prompt list; pass --prompts FILE (.txt, one per line, or .json)")
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
                raise SystemExit(
                    f"error: {ckpt_path} was trained with {key}={saved[key]!r}, not {getattr(config, key)!r}; "
                    f"pass --{key} {saved[key]} or another --out-dir"
                )
    elif os.path.isfile(ckpt_path):
        raise SystemExit(f"error: {ckpt_path} exists; pass --resume to continue it or choose another --out-dir")
    return prompts


def context_seed(seed, iteration, context):
    """Every context of every iteration has its own generator seed, so the batch a rank sees
    depends on neither the number of ranks nor on a resume. Offset by 2**32 to stay clear of
    the held-out seeds of evaluate.heldout_contexts."""
    return 2**32 + (seed * 1_000_003 + iteration) * 65_536 + context


def save_checkpoint(path, state):
    """Written to a temporary file, then renamed: a kill never leaves a corrupt checkpoint."""
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


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
    assert contexts_per_rank * world_size == config.contexts
    torch.manual_seed(config.seed)

    dtype = getattr(torch, config.dtype) if config.dtype else None
    reward_options = {"checkpoint": config.reward_checkpoint} if config.reward_checkpoint else {}
    try:  # missing or gated weights, a missing reward package: one line, before the heavy loading
        check_reward(config.reward, config.reward_checkpoint)
        backbone = load_backbone(
            config.backbone, path=config.model_path, device=device, dtype=dtype,
            resolution=config.resolution, guidance=config.guidance,
        )
    except ValueError as error:
        raise SystemExit(f"error: {error}")
    prompts = prompts or backbone.prompts
    reward = load_reward(config.reward, backbone, device=device, **reward_options)
    default_times = backbone.default_times(config.steps)

    raw_policy = make_policy(
        config.policy, backbone.policy_dims, config.steps, preset=config.backbone,
        init_times=default_times if config.init == "default" else None,
    ).to(device)
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
        parameters = sum(p.numel() for p in raw_policy.parameters())
        print(f"backbone {config.backbone} | L = {config.steps} steps | {config.policy} policy, {parameters:,} parameters")
        print(
            f"B = {config.contexts} contexts x K = {config.rollouts} rollouts = "
            f"{config.contexts * config.rollouts} samples per update | {world_size} rank(s), "
            f"{contexts_per_rank} contexts each | baseline {config.baseline} | reward {config.reward}"
        )

    progress = tqdm(range(start, config.iterations), initial=start, total=config.iterations, disable=not master)
    K, B = config.rollouts, config.contexts
    for iteration in progress:
        t0 = time.time()
        # ---------------- rollout: B/world contexts, K schedules each, no gradients ----------------
        first = rank * contexts_per_rank
        generators = [torch.Generator().manual_seed(context_seed(config.seed, iteration, first + c)) for c in range(contexts_per_rank)]
        batch_prompts = [prompts[torch.randint(len(prompts), (1,), generator=g).item()] for g in generators]
        with torch.no_grad():
            noise = torch.cat([backbone.sample_noise(1, g) for g in generators])
            cond = backbone.encode_prompts(batch_prompts)
            inputs = backbone.policy_inputs(noise, cond)
            alpha = raw_policy(**inputs)  # (B/world, L+1)
            tau = torch.cat([sample_increments(alpha[c : c + 1], K, g) for c, g in enumerate(generators)])  # (B/world, K, L+1)
            times = times_from_increments(tau).flatten(0, 1).to(device)  # (B/world * K, L+1)
            noise_k = noise.repeat_interleave(K, 0)
            cond_k = {key: value.repeat_interleave(K, 0) for key, value in cond.items()}
            prompts_k = [prompt for prompt in batch_prompts for _ in range(K)]
            chunk = config.rollout_batch or len(prompts_k)
            rewards = []
            for i in range(0, len(prompts_k), chunk):
                part = slice(i, i + chunk)
                cond_part = {key: value[part] for key, value in cond_k.items()}
                latents = backbone.sample(noise_k[part], cond_part, times[part])
                rewards.append(reward(latents, prompts_k[part], noise_k[part], cond_part))
            rewards = torch.cat(rewards).float().view(contexts_per_rank, K)  # (B/world, K)
        t_rollout = time.time() - t0

        # ---------------- baselines: pooled over the global batch ----------------
        if distributed:
            gathered = [torch.empty_like(rewards) for _ in range(world_size)]
            dist.all_gather(gathered, rewards)
            all_rewards = torch.cat(gathered)  # (B, K)
        else:
            all_rewards = rewards
        check_finite(all_rewards)
        baseline = BASELINES[config.baseline](all_rewards)  # (B, K), detached
        advantages = (all_rewards - baseline)[first : first + contexts_per_rank].to(device)

        # ---------------- policy gradient: recompute log pi(tau) with grad ----------------
        alpha = policy(**inputs)  # (B/world, L+1), through DDP so gradients are averaged over ranks
        logp = log_prob(alpha, tau.to(device))  # (B/world, K): joint Dirichlet log-density
        loss = -(advantages.detach() * logp).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_policy.parameters(), config.grad_clip)
        optimizer.step()

        # ---------------- checkpoint and log ----------------
        done = iteration + 1
        if master:
            row = {
                "iteration": done,
                "reward": all_rewards.mean().item(),
                "reward_std": all_rewards.std().item(),
                "shrinkage": shrinkage(all_rewards).item() if B >= 3 else float("nan"),
                "loss": loss.item(),
                "grad_norm": grad_norm.item(),
                "concentration": alpha.detach().sum(-1).mean().item(),
                "stop_margin": mean_increments(alpha.detach())[:, -1].mean().item(),  # t_L of the mean schedule
                "rollout_s": t_rollout,
                "step_s": time.time() - t0,
            }
            with open(metrics_path, "a") as file:
                file.write(json.dumps(row) + "\n")
            if done % config.log_interval == 0 or done == config.iterations:
                progress.write(
                    f"iter {done:5d} | reward {row['reward']:+.5f} | shrinkage a {row['shrinkage']:.3f} | "
                    f"loss {row['loss']:+.4f} | grad {row['grad_norm']:.3f} | "
                    f"concentration {row['concentration']:.1f} | stop margin {row['stop_margin']:.4f}"
                )
            if done % config.ckpt_interval == 0 or done == config.iterations:
                save_checkpoint(ckpt_path, {
                    "policy": raw_policy.state_dict(),
                    "policy_config": raw_policy.config,
                    "optimizer": optimizer.state_dict(),
                    "iteration": done,
                    "config": dataclasses.asdict(config),
                    "rng": {"torch": torch.get_rng_state()},
                })

    # ---------------- held-out evaluation (rank 0) ----------------
    if master:
        report(config, backbone, reward, raw_policy, default_times)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def report(config, backbone, reward, policy, default_times):
    """Held-out contexts never seen in training, the same noises for every method."""
    if backbone.prompts is None and config.eval_prompts is None:
        print(f"no held-out prompts (--eval-prompts); evaluate with: python evaluate.py --ckpt {config.out_dir}/ckpt.pt --hpdv2 DIR")
        return
    policy.eval()
    eval_prompts = load_prompt_file(config.eval_prompts) if config.eval_prompts else None
    heldout_prompts, seeds = heldout_contexts(backbone, config.eval_contexts, prompts=eval_prompts)
    generator = torch.Generator().manual_seed(config.seed)
    methods = {
        "default": default_schedule(backbone, config.steps),
        "learned (mean)": policy_schedule(policy, backbone, mode="mean"),
        "learned (sampled)": policy_schedule(policy, backbone, mode="sample", generator=generator),
    }
    if config.reward == "teacher":
        methods["limit (teacher)"] = "reference"
    scores = evaluate(backbone, reward, heldout_prompts, seeds, methods)
    rows = summarize(scores, baseline="default")
    print(f"\nheld-out evaluation: {len(seeds)} contexts, reward {config.reward}, L = {config.steps}")
    print(format_table(rows))
    # atomic: ablation.py takes an existing eval.json as a finished run
    write_json_atomic(os.path.join(config.out_dir, "eval.json"),
                      {"rows": rows, "steps": config.steps, "contexts": len(seeds), "reward": config.reward})
    plot(config, backbone, policy, default_times, heldout_prompts, seeds)


def plot(config, backbone, policy, default_times, heldout_prompts, seeds):
    """Reward curve, and learned schedules of a few held-out contexts against the default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(config.out_dir, "metrics.jsonl")) as file:
        rows = [json.loads(line) for line in file]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    iterations, batch_means = [row["iteration"] for row in rows], [row["reward"] for row in rows]
    smoothed = [batch_means[0]]
    for value in batch_means[1:]:  # exponential moving average over about 20 iterations
        smoothed.append(0.95 * smoothed[-1] + 0.05 * value)
    left.plot(iterations, batch_means, lw=0.5, alpha=0.4, label="batch mean")
    left.plot(iterations, smoothed, lw=1.5, label="moving average")
    left.legend()
    left.set(xlabel="iteration", ylabel=f"mean reward ({config.reward})", title="training reward")
    shown = min(8, len(seeds))
    with torch.no_grad():
        noise = context_noise(backbone, seeds[:shown])
        times = policy_schedule(policy, backbone, mode="mean")(noise, backbone.encode_prompts(heldout_prompts[:shown]))
    draw_schedules(right, times.cpu(), default_times.cpu(), label="learned (mean)")
    right.set_title("schedules (held-out contexts)")
    figure.tight_layout()
    figure.savefig(os.path.join(config.out_dir, "train.png"), dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main(parse_config())
