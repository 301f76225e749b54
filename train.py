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
If out_dir holds a ckpt.pt, the same command continues that run where it stopped.
"""

import argparse
import dataclasses
import hashlib
import json
import math
import os
import pickle
import shutil
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import backbones
import rewards as reward_lib
from baselines import BASELINES, MIN_CONTEXTS, shrinkage
from comparator import tpdm
from evaluate import POLICIES, check_writable, heldout_gain, heldout_report, one_line_errors
from policy import make_policy, save_policy
from prompts import SHIPPED, context_seed, heldout_contexts, load_prompt_file

# -----------------------------------------------------------------------------
# configuration: Config's defaults are the digits backbone's; --backbone X takes PRESETS[X]; a flag
# given on the command line overrides either


def arg(default, help):
    return field(default=default, metadata=dict(help=help))


@dataclass
class Config:
    # I/O
    out_dir: str | None = arg(None, "run folder; default: out/<backbone>-L<steps>-<policy>-s<seed>")
    ckpt_interval: int = arg(50, "iterations between checkpoints (a kill loses at most this)")
    log_interval: int = arg(10, "iterations between log lines")
    # backbone
    backbone: str = arg("digits", "a name in PRESETS (mini-*: the trained miniatures)")
    model_path: str | None = arg(None, "local diffusers folder replacing the hub id")
    resolution: int | None = arg(None, "image side in pixels; default: the backbone's own")
    guidance: float | None = arg(None, "CFG (flux-dev: distilled); default: the backbone's")
    dtype: str | None = arg(None, "backbone dtype; default: bfloat16 on CUDA, float32 on CPU")
    prompts: str | None = arg(None, "training prompts: a file (.txt, .json, .jsonl) or hpdv2")
    eval_prompts: str | None = arg(None, "held-out prompt file")
    # policy
    policy: str = arg("instance", "instance | global | stepwise (the comparator)")
    steps: int = arg(4, "L, model calls per sample; one policy per L")
    init: str = arg("default", "the backbone's schedule | uniform | tpdm (the comparator's)")
    concentration: float = arg(100.0, "initial sum(alpha) (--init uniform: L+1 is flat)")
    # reward
    reward: str = arg("teacher", "a name in rewards.REWARDS")
    reward_checkpoint: str | None = arg(None, "local reward-model weights (offline machines)")
    # baseline
    baseline: str = arg("js", "js | js-unbiased | rloo | xctx (baselines.py)")
    contexts: int = arg(32, "B, contexts (prompt + noise) per update, over all ranks")
    rollouts: int = arg(2, "K, schedules drawn per context")
    rollout_batch: int | None = arg(None, "samples per backbone call (memory); default: all")
    # optim
    optimizer: str = arg("reinforce", "reinforce (one step per batch) | ppo (the comparator's)")
    iterations: int = arg(300, "policy updates")
    lr: float = arg(3e-3, "AdamW peak learning rate")
    lr_decay: str = arg("cosine", "cosine (to 0 at the end) | constant")
    weight_decay: float = arg(1e-4, "AdamW weight decay")
    adam_beta2: float = arg(0.999, "AdamW's beta2 (beta1 is 0.9)")
    adam_eps: float = arg(1e-8, "AdamW's epsilon")
    grad_clip: float = arg(1.0, "gradient-norm clip")
    # the comparator TPDM (comparator/tpdm.py): its policy's inputs and its PPO update
    policy_inputs: str = arg("sampler", "stepwise: sampler | hidden (the denoiser's, hooks)")
    inference: str = arg("mean", "stepwise: the Beta's mean | mode at evaluation")
    ppo_epochs: int = arg(4, "ppo: passes over each batch")
    ppo_minibatches: int = arg(1, "ppo: gradient steps per pass")
    ppo_clip: float = arg(0.2, "ppo: the ratio's clip range epsilon")
    # evaluation
    eval_contexts: int = arg(256, "held-out contexts for the final table")
    # system
    seed: int = arg(0, "seeds contexts, rollouts and the policy initialisation")
    device: str | None = arg(None, "cpu | cuda; default: cuda if available")
    threads: int = arg(1, "CPU threads (1 suits the small backbones); 0: torch's")
    compile: bool = arg(False, "torch.compile the frozen model (minutes, then faster on a GPU)")
    attention: str | None = arg(None, "frozen model's attention: flash, _native_cudnn, sage, ...")


# Each backbone's training configuration (the rest is Config's). The paper states K = 2 and a
# "batch size" of 32 (SD-XL, SD3.5-M) or 16 (SD3.5-L, Flux-Dev); reading it as B contexts, and the
# rest, are this project's choices. threads 0: torch's own count (real models use every core).
REAL = dict(steps=4, rollouts=2, iterations=1000, lr=1e-4, reward="hpsv2", threads=0)
REAL.update(prompts="prompts/train.jsonl", eval_prompts="prompts/heldout.jsonl")
# the embedded exact mixtures draw their own prompts ("a handwritten 0" .. "9")
EMBEDDED = dict(steps=4, contexts=32, iterations=300, lr=3e-3, reward="teacher", threads=1)
MINIATURE = dict(steps=3, contexts=16, rollouts=4, iterations=200, lr=3e-3, reward="preference")
MINIATURE.update(threads=1, prompts="prompts/digit_train.txt")
MINIATURE.update(eval_prompts="prompts/digit_heldout.txt")
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
    "mini-mix": dict(
        MINIATURE, prompts="prompts/mix_train.txt", eval_prompts="prompts/mix_heldout.txt"
    ),
    # a few-step distilled model is asked at the budget it was distilled for
    "mini-flux-schnell": dict(MINIATURE, steps=4),
}
CHOICES = dict(backbone=list(PRESETS), reward=list(reward_lib.REWARDS), baseline=list(BASELINES))
CHOICES.update(policy=["instance", "global", "stepwise"], init=["default", "uniform", "tpdm"])
CHOICES.update(optimizer=["reinforce", "ppo"], lr_decay=["cosine", "constant"])
CHOICES.update(policy_inputs=["sampler", "hidden"], inference=["mean", "mode"])
CHOICES.update(device=["cpu", "cuda"], dtype=["bfloat16", "float16", "float32"])
# what a continued run may change: how it runs, not what it trains
CONTINUABLE = {"out_dir", "ckpt_interval", "log_interval", "iterations", "rollout_batch"}
CONTINUABLE |= {"eval_contexts", "device", "threads", "model_path", "compile", "attention"}
CONTINUABLE |= {"prompts", "eval_prompts"}  # a file by another name: compared by its contents


def parse_config(argv=None):
    """The command line over the backbone's preset (PRESETS) over Config's defaults."""
    presets = [
        f"  {name}: " + " ".join(f"{k}={v}" for k, v in row.items())
        for name, row in PRESETS.items()
    ]
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="each --backbone's preset, over the defaults above:\n" + "\n".join(presets),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # what the command line gave, and nothing else
    )
    for item in dataclasses.fields(Config):
        kind = next(t for t in getattr(item.type, "__args__", [item.type]) if t is not type(None))
        flag, default = "--" + item.name.replace("_", "-"), f" (default: {item.default})"
        help = item.metadata["help"] + ("" if item.default is None else default)
        if kind is bool:  # a switch
            parser.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=help)
        else:
            parser.add_argument(flag, type=kind, choices=CHOICES.get(item.name), help=help)
    given = vars(parser.parse_args(argv))
    backbone = given.get("backbone", Config.backbone)
    values = dict(PRESETS[backbone])
    if given.get("reward") in SHIPPED and "prompts" not in given:  # its own prompt set
        values["prompts"], values["eval_prompts"] = SHIPPED[given["reward"]]
    if given.get("optimizer") == "ppo":  # the comparator's settings, over the backbone's
        values.update(tpdm.preset(given, values, backbones.BACKBONES[backbone]))
    config = Config(**(values | given))
    if config.out_dir is None:  # one folder per run: the same command finds its own run again
        kind = config.policy + ("-ppo" if config.optimizer == "ppo" else "")
        config.out_dir = f"out/{config.backbone}-L{config.steps}-{kind}-s{config.seed}"
    return config


# -----------------------------------------------------------------------------
# the door: what argparse cannot say, in one line each, before anything heavy loads


def fail(message):
    """Stop in one line: under torchrun every rank checks, and rank 0 says why."""
    raise SystemExit(f"error: {message}" if int(os.environ.get("RANK", "0")) == 0 else 1)


def check(config, world_size):
    """Returns the training and held-out prompts (None: the backbone's own), their digest and the
    checkpoint that out_dir holds (None: a fresh run)."""
    spec, name, out = backbones.BACKBONES[config.backbone], config.backbone, config.out_dir
    cuda, mixture = torch.cuda.is_available(), spec["family"] == "mixture"
    counts = "steps iterations ckpt_interval log_interval eval_contexts rollout_batch ppo_epochs"
    least = dict.fromkeys([*counts.split(), "ppo_minibatches"], 1)
    least.update(seed=0, threads=0, rollouts=2, contexts=MIN_CONTEXTS[config.baseline])
    why = dict(rollouts=" (leave-one-out)", contexts=f" for --baseline {config.baseline}")
    for key, bound in least.items():
        if getattr(config, key) is not None and getattr(config, key) < bound:
            fail(f"--{key.replace('_', '-')} must be at least {bound}{why.get(key, '')}")
    for key, value in vars(config).items():  # nan and inf pass argparse's float
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{key.replace('_', '-')} must be a finite number")
    positive = [config.lr, config.concentration, config.grad_clip, config.adam_eps]
    hidden = config.policy_inputs == "hidden"  # like --init tpdm, --inference mode: stepwise's
    stepwise_only = hidden or config.init == "tpdm" or config.inference == "mode"
    refusals = [  # (refused, why)
        (not all(v > 0 for v in positive), "--lr, --concentration, --grad-clip, --adam-eps: > 0"),
        (not 0 <= config.adam_beta2 < 1, "--adam-beta2 must be in [0, 1)"),
        (not config.weight_decay >= 0, "--weight-decay must be >= 0"),
        (config.seed >= 2**27, "--seed must be below 2^27 (the contexts' seeds stay below 2^63)"),
        (config.contexts % world_size, f"--contexts is not divisible by the {world_size} ranks"),
        (config.device == "cuda" and not cuda, "--device cuda, but this machine has no CUDA"),
        (spec["hub_id"] and config.device is None and not cuda,
         f"{name} on a CPU takes hours per update; pass --device cpu to insist"),
        (config.guidance is not None and spec["guidance"] is None, f"{name} runs no --guidance"),
        (spec["hub_id"] is None and config.resolution, f"{name} draws one size: drop --resolution"),
        (mixture and config.reward in reward_lib.IMAGE_CONTENT, f"{name}: no text in 8x8 digits"),
        (mixture and hidden, f"{name} has no --policy-inputs hidden"),
        (mixture and (config.compile or config.attention), f"{name}: no --compile, --attention"),
        (config.dtype == "float16" and spec["family"] in ("sd3", "flux"),
         f"{name}: SD3.5 and Flux overflow in --dtype float16; pass bfloat16 or float32"),
        (config.attention and spec["family"] in ("sd3", "sdxl"), f"{name}: --attention reaches "
         "Flux's attention only (SD3's and SD-XL's processors call torch's SDPA themselves)"),
        (config.attention and config.attention not in backbones.families.attention_backends(),
         f"--attention: one of {', '.join(backbones.families.attention_backends())}"),
        (config.policy != "stepwise" and stepwise_only, "--init tpdm, --inference mode and "
         "--policy-inputs hidden need --policy stepwise"),
        (not out, "--out-dir '': a folder"),
    ]  # fmt: skip
    for refused, why in refusals:
        if refused:
            fail(why)
    try:
        check_writable(out)
        reward_lib.check_digits(config.reward, config.backbone, spec)
        prompts = load_prompt_file(config.prompts) if config.prompts else None
        heldout = load_prompt_file(config.eval_prompts) if config.eval_prompts else None
        reward_lib.check_prompts(config.reward, (prompts or []) + (heldout or []), config.backbone)
    except (ValueError, OSError) as error:
        fail(error)
    digest = hashlib.sha256(json.dumps([prompts, heldout]).encode()).hexdigest()
    ckpt_path = os.path.join(out, "ckpt.pt")
    if not os.path.exists(ckpt_path):  # a fresh run: in an absent or empty folder only
        if os.path.isdir(out) and set(os.listdir(out)) - {"ckpt.pt.tmp"}:
            fail(f"--out-dir {out} holds files but no ckpt.pt to continue; pass another")
        return prompts, heldout, digest, None
    try:  # every started run has one (written before its first iteration)
        found = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        changed = [key for key, value in found["config"].items()
                   if key not in CONTINUABLE and getattr(config, key, None) != value]  # fmt: skip
        changed += ["prompt file contents"] if found["prompts_sha256"] != digest else []
    except (OSError, RuntimeError, EOFError, KeyError, TypeError, pickle.UnpicklingError) as error:
        fail(f"{ckpt_path} is not a checkpoint of train.py ({type(error).__name__}); pass another")
    if changed:
        fail(f"{ckpt_path} is a run with other {', '.join(changed)}; pass another --out-dir")
    if found["iteration"] > config.iterations:
        fail(f"{ckpt_path} is at iteration {found['iteration']}, past --iterations")
    return prompts, heldout, digest, found


# -----------------------------------------------------------------------------
# the run


def main(config, on_checkpoint=None, loaded=None, realism=True):
    """Train; returns the policy. For the studies in evidence/ and the benchmark: on_checkpoint
    (policy, iteration) sees the policy at the start and at each checkpoint; loaded is the
    (backbone, reward) this configuration names, already built (loaded once for many runs);
    realism=False leaves a miniature's realism measure out of the report."""
    # ---------------- ranks and device ----------------
    distributed = "RANK" in os.environ
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    master = rank == 0
    if master:
        print("configuration: " + " ".join(f"{k}={v}" for k, v in vars(config).items()))
    train_prompts, eval_prompts, digest, found = check(config, world_size)
    use_cuda = torch.cuda.is_available() and config.device != "cpu"
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if distributed:  # torchrun: nccl on GPUs (bound to this rank's), gloo on CPUs; the timeout
        backend, bound = ("nccl", device) if use_cuda else ("gloo", None)  # waits out a slow load
        dist.init_process_group(backend, device_id=bound, timeout=timedelta(hours=1))
    if config.threads:
        torch.set_num_threads(config.threads)

    # ---------------- backbone, prompts, reward ----------------
    saved = dataclasses.asdict(config)
    try:  # a model that is missing, gated or damaged: the library's own message, in one line
        backbone, reward = loaded or (backbones.trained_backbone(saved, device), None)
        local = config.reward_checkpoint  # the reward model's weights on this machine
        reward = reward or reward_lib.load_reward(config.reward, backbone, device, local)
    except (OSError, ImportError, ValueError) as error:
        way_out = "; accept its licence on the Hub and `hf auth login`, or --model-path a copy"
        hub = backbones.BACKBONES[config.backbone]["hub_id"] and not config.model_path
        fail(f"{type(error).__name__}: {' '.join(str(error).split())}" + (way_out if hub else ""))
    prompts = train_prompts or backbone.prompts
    contexts = heldout_contexts(eval_prompts or backbone.prompts, config.eval_contexts)
    backbone.check_prompts(prompts + contexts[0], config.reward)  # here, not at an iteration
    if config.attention:  # this model's attention alone; a ValueError where it cannot run here
        backbone.set_attention(config.attention)
    if config.compile:  # in place, its hooks first: a compiled model runs no hook added later
        if config.policy_inputs == "hidden":
            tpdm.hidden_states(backbone)
        backbone.model.compile()
    backbone.keep_encoded(prompts + contexts[0])  # once, on the CPU: no encoder runs in the loop

    # ---------------- policy and optimiser: the method's, or the comparator's ----------------
    init_times = backbone.default_times(config.steps) if config.init == "default" else None
    options = tpdm.policy_options(config, backbone) if config.policy == "stepwise" else {}
    options.update(concentration=config.concentration)
    torch.manual_seed(config.seed)  # the policy's initialisation; the loop's draws seed their own
    network, dims = backbones.BACKBONES[config.backbone]["policy"], backbone.policy_dims
    policy_class = POLICIES[config.policy]
    raw_policy = make_policy(policy_class, dims, config.steps, init_times, network, **options)
    raw_policy = raw_policy.to(device)
    policy = DistributedDataParallel(raw_policy) if distributed else raw_policy
    betas, parameters = (0.9, config.adam_beta2), raw_policy.parameters()
    optimizer = torch.optim.AdamW(  # foreach: one kernel per operation over all the tensors
        parameters, config.lr, betas, config.adam_eps, config.weight_decay, foreach=True
    )
    if master:
        size = sum(p.numel() for p in raw_policy.parameters())
        print(f"policy: {config.policy}, {size:,} parameters | {world_size} rank(s), "
              f"{config.contexts // world_size} contexts each")  # fmt: skip
    chunk = config.rollout_batch or 64  # held-out contexts per model call: as the loop's
    gain = heldout_gain(backbone, reward, contexts, config.steps, chunk)  # each rank scores a share

    # ---------------- resume: nanoGPT's, exact (every draw of the loop is seeded) ----------------
    ckpt_path = os.path.join(config.out_dir, "ckpt.pt")
    metrics_path = os.path.join(config.out_dir, "metrics.jsonl")

    def save_checkpoint(iteration):  # what a resume needs to continue exactly, written atomically
        state = dict(policy=raw_policy.state_dict(), policy_config=raw_policy.config)
        state.update(optimizer=optimizer.state_dict(), iteration=iteration, config=saved)
        state.update(rng=torch.get_rng_state(), metrics=rows, prompts_sha256=digest)
        torch.save(state, ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)

    start, rows = 0, []
    if found:  # weights, optimiser, RNG and the metrics rows up to its iteration
        raw_policy.load_state_dict(found["policy"])
        optimizer.load_state_dict(found["optimizer"])
        torch.set_rng_state(found["rng"])
        start, rows = found["iteration"], found["metrics"]
    if master:
        print(f"continuing {ckpt_path} from iteration {start}" if found else "a fresh run")
        os.makedirs(config.out_dir, exist_ok=True)
        if not found:  # from here on the same command continues this run, whatever stops it
            save_checkpoint(0)
        with open(metrics_path, "w") as file:  # a kill may have left rows past the checkpoint
            file.writelines(json.dumps(row) + "\n" for row in rows)
        if on_checkpoint and start == 0:
            on_checkpoint(raw_policy, 0)

    # ---------------- the loop ----------------
    contexts_per_rank = config.contexts // world_size
    first = rank * contexts_per_rank  # this rank's contexts in the global batch
    K = config.rollouts
    bar = None if master else True  # None: a bar on a terminal only, not in a redirected log
    progress = tqdm(range(start, config.iterations), initial=start, total=config.iterations,
                    disable=bar)  # fmt: skip
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
        cond = backbone.encode_prompts(batch_prompts)
        rollouts = raw_policy.rollouts(policy, backbone, noise, cond, generators, K)
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
            rewards = torch.cat(rewards).float().view(contexts_per_rank, K)  # (B/world, K)
        t_rollout = time.time() - t0

        # ---------------- baselines: pooled over the global batch ----------------
        all_rewards = rewards  # (B, K): every rank's, in rank order
        if distributed:
            gathered = [torch.empty_like(rewards) for _ in range(world_size)]
            dist.all_gather(gathered, rewards)
            all_rewards = torch.cat(gathered)
        if not torch.isfinite(all_rewards).all():  # one NaN would reach every gradient
            fail(f"iteration {iteration + 1}: a reward is NaN or inf; last checkpoint {ckpt_path}")
        advantages = all_rewards - BASELINES[config.baseline](all_rewards)  # (B, K), r - b
        advantages = advantages[first : first + contexts_per_rank].flatten().to(device)

        # ---------------- policy gradient ----------------
        for group in optimizer.param_groups:
            group["lr"] = get_lr(config, iteration)
        if config.optimizer == "ppo":  # the comparator's update: clipped steps on this batch
            update = tpdm.ppo_update(config, iteration, rollouts, policy, advantages, optimizer)
            loss, grad_norm, clip_fraction = update
        else:  # REINFORCE; log pi is the joint Dirichlet log-density, recomputed with gradients
            loss = -(advantages * rollouts.log_prob(policy)).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_policy.parameters(), config.grad_clip)
            optimizer.step()
            clip_fraction = None

        # ---------------- log and checkpoint (rank 0) ----------------
        done = iteration + 1
        checkpoint_now = done % config.ckpt_interval == 0 or done == config.iterations
        # the mean schedule's gain over the default on held-out contexts, scored by every rank
        heldout = dict(heldout_gain=gain(raw_policy)) if checkpoint_now else {}
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
            **heldout,
        )
        rows.append(row)
        with open(metrics_path, "a") as file:
            file.write(json.dumps(row) + "\n")
        if done % config.log_interval == 0 or done == config.iterations:  # the row's numbers
            shown = [f"{key} {value:.4g}" for key, value in row.items() if isinstance(value, float)]
            progress.write(f"iter {done:5d} | " + " | ".join(shown))
        if checkpoint_now:
            save_checkpoint(done)
            if on_checkpoint:
                on_checkpoint(raw_policy, done)

    # ---------------- the policy in the Hub format, the held-out report (eval.json last) -------
    if master:  # written whole or not at all, as the checkpoint
        folder = os.path.join(config.out_dir, "policy")
        save_policy(folder + ".tmp", raw_policy, dict(saved, iteration=config.iterations))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(folder + ".tmp", folder)
    heldout_report(config.out_dir, backbone, reward, raw_policy, contexts, config.reward,
                   config.iterations, chunk, realism)  # fmt: skip
    if master:
        print(f"wrote {ckpt_path}, {metrics_path}, eval.json and policy/ in {config.out_dir}")
    if distributed:
        dist.destroy_process_group()
    return raw_policy


def get_lr(config, iteration):
    """Cosine from config.lr to 0 over the run (or constant): a function of the iteration alone,
    so a resumed run gets the same rates."""
    if config.lr_decay == "constant":
        return config.lr
    return config.lr * 0.5 * (1 + math.cos(math.pi * iteration / config.iterations))


if __name__ == "__main__":  # a user's mistake or Ctrl-C ends in one line, no traceback
    with one_line_errors("interrupted; the same command continues from the last checkpoint"):
        main(parse_config())
