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
A run folder is never overwritten: running the same command again continues a killed run from its
last checkpoint, or reports a finished one.
"""

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from baselines import BASELINES, MIN_CONTEXTS, shrinkage
from checkpoints import (check_writable, claim_run, existing_run, restore, save_checkpoint,
                         save_policy)
from evaluate import format_table, heldout_curve, heldout_report
from policy import POLICIES, log_prob, make_policy, mean_increments, sample_increments, times_from_increments
from prompts import DEFAULT, SHIPPED, context_seed, heldout_contexts, load_prompt_file
from rewards import IMAGE_CONTENT, REWARDS, check_prompts, check_reward, load_reward
from rollout import BACKBONES, load_backbone, locate_weights, update_cost
from sample import plot_training

# -----------------------------------------------------------------------------
# configuration: one field per line; None means "the backbone's default" (rollout.BACKBONES)


@dataclass
class Config:
    # I/O
    out_dir: str = "out"  # checkpoint, metrics.jsonl, eval.json, the figure and policy/ go here
    resume: bool = False  # insist on continuing out_dir/ckpt.pt (an existing run is always continued, never overwritten)
    ckpt_interval: int = 50  # iterations between checkpoints (a kill loses at most this many)
    log_interval: int = 10  # iterations between log lines
    # backbone
    backbone: str = "digits"  # a name in rollout.BACKBONES (mini-*: the trained miniatures)
    model_path: str | None = None  # local diffusers folder replacing the hub id
    resolution: int | None = None  # image side in pixels
    guidance: float | None = None  # CFG scale (distilled guidance for flux-dev)
    prompts: str | None = None  # training prompts: a file (.txt, .json, .jsonl) or hpdv2; None = the shipped ones (prompts/)
    # policy
    policy: str = "instance"  # instance (conditioned on noise and prompt) | global (one schedule for all)
    steps: int | None = None  # L, model calls per sample; one policy per L
    init: str = "default"  # default (start at the backbone's schedule) | uniform
    # reward
    reward: str | None = None  # a name in rewards.REWARDS
    reward_checkpoint: str | None = None  # local reward-model weights (offline machines)
    # baseline
    baseline: str = "js"  # js | js-unbiased | rloo | xctx
    contexts: int | None = None  # B, contexts (prompt + noise) per update, over all ranks
    rollouts: int | None = None  # K, schedules drawn per context
    rollout_batch: int | None = None  # samples per backbone call (memory); None = all at once
    # optim
    iterations: int | None = None  # policy updates
    lr: float | None = None  # AdamW learning rate
    lr_decay: str = "cosine"  # cosine (to 0 at the last iteration) | constant
    weight_decay: float = 1e-4  # AdamW weight decay (the paper)
    grad_clip: float = 1.0  # gradient-norm clip (the paper)
    # evaluation
    eval_contexts: int = 256  # held-out contexts for the final table
    eval_prompts: str | None = None  # held-out prompt file; None = the shipped ones (embedded: their own prompts)
    # system
    seed: int = 0  # seeds contexts, rollouts and the policy initialisation
    device: str | None = None  # cpu | cuda; None = cuda if available (a real backbone needs --device cpu to run on a CPU)
    dtype: str | None = None  # backbone dtype; None = bfloat16 on CUDA, float32 on CPU
    threads: int | None = None  # CPU threads; None = 1 for the embedded backbones (tiny tensors), torch's default otherwise


CHOICES = dict(backbone=list(BACKBONES), policy=list(POLICIES), init=["default", "uniform"], reward=list(REWARDS),
               baseline=list(BASELINES), lr_decay=["cosine", "constant"], dtype=["bfloat16", "float16", "float32"],
               device=["cpu", "cuda"])
HELP = dict(re.findall(r"^    (\w+): .+?  # (.+)$", inspect.getsource(Config), re.M))  # the comments above
GLOBAL_LR_FACTOR = 60  # the global policy is bare logits: at the instance policy's rate it barely moves


def parse_config(argv=None):
    """argparse built from the dataclass fields: --field-name value, booleans as flags, names with choices."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: parser.exit(2, f"train.py: error: {message}\n")  # one line, without the usage
    for field in dataclasses.fields(Config):
        flag, help = "--" + field.name.replace("_", "-"), f"{HELP[field.name]} (default: {field.default})"
        if field.type is bool:
            parser.add_argument(flag, action="store_true", help=help)
            continue
        kind = field.type
        if isinstance(kind, types.UnionType):  # "int | None" -> int
            kind = next(arg for arg in kind.__args__ if arg is not type(None))
        parser.add_argument(flag, type=kind, default=field.default, choices=CHOICES.get(field.name), help=help)
    config = Config(**vars(parser.parse_args(argv)))
    per_backbone = ("steps", "contexts", "rollouts", "iterations", "lr", "reward", "rollout_batch",
                    "threads")
    for key in per_backbone:
        if getattr(config, key) is None:
            default = BACKBONES[config.backbone][key]
            setattr(config, key, default * GLOBAL_LR_FACTOR if key == "lr" and config.policy == "global" else default)
    spec = BACKBONES[config.backbone]
    own = (None, None) if spec["family"] == "mixture" else SHIPPED.get(config.reward, DEFAULT)
    shipped = spec.get("prompts") or own
    config.prompts, config.eval_prompts = config.prompts or shipped[0], config.eval_prompts or shipped[1]
    return config


def check_config(config, world_size):
    """What argparse cannot say fails here in one line, before anything heavy is loaded. Returns the
    training prompts (None: the backbone's own) and the run out_dir already holds (or None)."""
    least = dict(steps=1, rollouts=2, contexts=MIN_CONTEXTS[config.baseline], iterations=1, ckpt_interval=1,
                 log_interval=1, eval_contexts=1, rollout_batch=1, resolution=8, threads=1)
    for key, minimum in least.items():
        if getattr(config, key) is not None and getattr(config, key) < minimum:
            why = {"rollouts": " for a leave-one-out baseline", "contexts": f" for --baseline {config.baseline}"}.get(key, "")
            raise SystemExit(f"error: --{key.replace('_', '-')} must be at least {minimum}{why} (got {getattr(config, key)})")
    for key, positive in (("lr", True), ("grad_clip", True), ("weight_decay", False), ("guidance", False)):
        value = getattr(config, key)
        if value is not None and not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            raise SystemExit(f"error: --{key.replace('_', '-')} must be a finite number {'> 0' if positive else '>= 0'} (got {value})")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device cuda, but this machine has no CUDA device (torch "
                         f"{torch.__version__}); drop --device to run on the CPU")
    if config.threads and config.threads > (os.cpu_count() or 1):
        print(f"note: --threads {config.threads} is more than the {os.cpu_count()} CPU cores; "
              f"using {os.cpu_count()}")
        config.threads = os.cpu_count()
    if config.contexts % world_size:
        raise SystemExit(f"error: --contexts {config.contexts} is not divisible by the {world_size} ranks; "
                         "choose a multiple of the number of processes")
    hub_model = BACKBONES[config.backbone]["hub_id"] is not None
    if hub_model and config.device is None and not torch.cuda.is_available():
        raise SystemExit(f"error: {config.backbone} on a CPU takes hours per update; run on a CUDA machine, or pass "
                         "--device cpu to insist (or try --backbone digits)")
    if config.reward == "digit" and "folder" not in BACKBONES[config.backbone]:
        raise SystemExit("error: the digit reward reads the 16x16 handwritten digits that only "
                         f"the mini-* backbones draw, not {config.backbone}'s images; use "
                         "--reward teacher, or a mini-* backbone")
    if BACKBONES[config.backbone]["family"] == "mixture" and config.reward in IMAGE_CONTENT:
        raise SystemExit(f"error: the {config.reward} reward reads text or objects, which the 8x8 {config.backbone} images do "
                         "not have; use a real backbone, or --reward teacher")
    try:
        check_writable(config.out_dir)
        prompts = load_prompt_file(config.prompts) if config.prompts else None
        check_prompts(config.reward, (prompts or []) + (load_prompt_file(config.eval_prompts) if config.eval_prompts else []))
        return prompts, existing_run(dataclasses.asdict(config))
    except ValueError as error:
        raise SystemExit(f"error: {error}")


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
    prompts, checkpoint = check_config(config, world_size)
    ckpt_path, metrics_path, eval_path = (os.path.join(config.out_dir, name) for name in ("ckpt.pt", "metrics.jsonl", "eval.json"))
    if checkpoint and checkpoint["iteration"] >= config.iterations and os.path.isfile(eval_path):
        if master:  # the same command again: say what is there instead of failing or overwriting
            with open(eval_path) as file:
                table = format_table(json.load(file)["rows"])
            print(f"{config.out_dir} holds this run, finished at iteration {checkpoint['iteration']}; its held-out table:\n"
                  f"{table}\nto train again, pass another --out-dir (or --iterations N > {checkpoint['iteration']} to continue)")
        return
    if config.threads:
        torch.set_num_threads(config.threads)
    contexts_per_rank = config.contexts // world_size
    torch.manual_seed(config.seed)
    if master:  # what one update costs, before anything loads
        print(update_cost(config.backbone, config.contexts, config.rollouts, config.steps, config.guidance)
              + (f" (the teacher solves {config.contexts} contexts)" if config.reward == "teacher" else ""))

    missing = []  # every missing piece in one message, before either model loads
    for check in (lambda: check_reward(config.reward, config.reward_checkpoint), lambda: locate_weights(config.backbone, config.model_path)):
        try:
            check()
        except ValueError as error:
            missing.append(str(error))
    if missing:
        raise SystemExit("error: " + "; ".join(missing))
    try:  # one writer per run folder until this process ends (held by keeping the file open)
        lock = claim_run(config.out_dir, fresh=not checkpoint) if master else None  # noqa: F841
    except ValueError as error:
        raise SystemExit(f"error: {error}")
    backbone = load_backbone(config.backbone, path=config.model_path, device=device, resolution=config.resolution,
                             dtype=getattr(torch, config.dtype) if config.dtype else None, guidance=config.guidance)
    prompts = prompts or backbone.prompts
    heldout = heldout_contexts(load_prompt_file(config.eval_prompts) if config.eval_prompts else backbone.prompts, config.eval_contexts)
    try:  # a prompt the backbone cannot take fails here, not at an iteration
        backbone.check_prompts(prompts + heldout[0])
    except ValueError as error:
        raise SystemExit(f"error: {error}")
    reward = load_reward(config.reward, backbone, device=device, checkpoint=config.reward_checkpoint)
    curve = heldout_curve(backbone, reward, heldout[0][:32], heldout[1][:32], config.steps) if master else None

    raw_policy = make_policy(config.policy, backbone.policy_dims, config.steps, preset=BACKBONES[config.backbone]["policy"],
                             init_times=backbone.default_times(config.steps) if config.init == "default" else None).to(device)
    optimizer = torch.optim.AdamW(raw_policy.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    start = restore(checkpoint, raw_policy, optimizer, metrics_path if master else None) if checkpoint else 0
    if checkpoint and master:
        print(f"continuing {ckpt_path} from iteration {start}")
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
            last = (f"{ckpt_path} holds the last good state" if os.path.isfile(ckpt_path) else
                    "no checkpoint was written yet")
            bad = int((~torch.isfinite(all_rewards)).sum())
            dtype = config.dtype or "default"
            raise SystemExit(f"error: iteration {iteration + 1}: {bad} rewards are NaN or inf: "
                             f"the policy diverged (learning rate too high? --lr {config.lr:g}) "
                             f"or the backbone ({dtype} dtype) or the reward model overflowed; "
                             f"{last}")
        baseline = BASELINES[config.baseline](all_rewards)  # (B, K), detached
        advantages = (all_rewards - baseline)[first : first + contexts_per_rank].to(device)

        # ---------------- policy gradient: recompute log pi(tau) with grad ----------------
        alpha = policy(**inputs)  # (B/world, L+1), through DDP so gradients are averaged over ranks
        logp = log_prob(alpha, tau.to(device))  # (B/world, K): the joint Dirichlet log-density, a sum over L+1
        loss = -(advantages.detach() * logp).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_policy.parameters(), config.grad_clip)
        for group in optimizer.param_groups:  # a function of the iteration alone, so a resumed run gets the same
            group["lr"] = config.lr * (0.5 + 0.5 * math.cos(math.pi * iteration / config.iterations) if config.lr_decay == "cosine" else 1.0)
        optimizer.step()

        # ---------------- checkpoint and log ----------------
        done = iteration + 1
        if master:
            row = dict(iteration=done, reward=all_rewards.mean().item(), reward_std=all_rewards.std().item(),
                       shrinkage=shrinkage(all_rewards).item() if config.contexts >= MIN_CONTEXTS["js"] else float("nan"),
                       loss=loss.item(), grad_norm=grad_norm.item(), concentration=alpha.detach().sum(-1).mean().item(),
                       stop_margin=mean_increments(alpha.detach())[:, -1].mean().item(),  # t_L of the mean schedule
                       rollout_s=t_rollout, step_s=time.time() - t0)
            if done % config.ckpt_interval == 0 or done == config.iterations:  # on the first 32 held-out contexts
                row["heldout_gain"] = curve(raw_policy)
            with open(metrics_path, "a") as file:
                file.write(json.dumps(row) + "\n")
            if done % config.log_interval == 0 or done == config.iterations:
                progress.write(f"iter {done:5d} | reward {row['reward']:+.5f} | shrinkage a {row['shrinkage']:.3f} | loss {row['loss']:+.4f} | "
                               f"grad {row['grad_norm']:.3f} | concentration {row['concentration']:.1f} | stop margin {row['stop_margin']:.4f}")
            if done % config.ckpt_interval == 0 or done == config.iterations:
                save_checkpoint(ckpt_path, dict(policy=raw_policy.state_dict(), policy_config=raw_policy.config,
                                                optimizer=optimizer.state_dict(), iteration=done,
                                                config=dataclasses.asdict(config), rng={"torch": torch.get_rng_state()}))

    # ---------------- held-out evaluation (rank 0) ----------------
    if master:
        heldout_report(config.out_dir, backbone, reward, raw_policy, *heldout, config.reward, config.seed)
        plot_training(config.out_dir, backbone, raw_policy, *heldout, config.reward)
        save_policy(os.path.join(config.out_dir, "policy"), raw_policy, dataclasses.asdict(config), config.iterations)
        print(f"wrote {ckpt_path}, {metrics_path}, {eval_path}, the figure train.png and policy/ (Hub format) in {config.out_dir}")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_config())
