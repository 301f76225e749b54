"""
Paired evaluation of learned sampling schedules on held-out contexts.

Every method (the default schedule, the learned schedule at its Dirichlet mean, optionally a
learned global schedule, the teacher and, for Flux-Dev and mini-flux, their distilled Schnell
models) samples from the *same* initial noise for each context (prompt + seed), so differences are
paired (scoring/paired.py).

CPU, the embedded digits backbone (after `python train.py`):
    python evaluate.py [--global-ckpt out/digits-L4-global-s0/ckpt.pt]
One GPU, HPSv2 and CLIP on the 3,200 HPDv2 test prompts (once: `hf download zhwang/HPDv2
--repo-type dataset --include "benchmark/*.json" --local-dir data/HPDv2`):
    python evaluate.py --ckpt out/sd35m-L10-instance-s0/ckpt.pt --hpdv2 data/HPDv2/benchmark
    python evaluate.py --ckpt out/flux-dev-L5-instance-s0/ckpt.pt --hpdv2 data/HPDv2/benchmark \
        --schnell --limit 400

Writes under --out-dir (default: eval/ next to the checkpoint): results.md (mean and 95% CI per
method, paired difference to the default with its CI, per style for HPDv2), scores.json (every
score, per method, reward and context) and, with --figure, results.png. A rerun scores only what
scores.json lacks (written every SAVE_EVERY seconds, at the end and at a Ctrl-C), so an interrupted
run resumes and --limit can be raised later.
"""

import argparse
import hashlib
import json
import os
import sys
import time

if __name__ == "__main__":  # Ctrl-C while torch and diffusers import: one line, not a traceback
    from store.files import interrupt_quietly

    interrupt_quietly("evaluate.py")

import torch

import backbones
import rewards as reward_lib
from policy import GlobalPolicy
from prompts import (
    HELDOUT_SEED,
    heldout_contexts,
    load_hpdv2,
    load_prompt_file,
    noise_seed,
    prompt_groups,
)
from scoring.figures import plot_results
from scoring.paired import default_schedule, format_table, policy_schedule, score_batches, summarize
from store.checkpoint import MAIN_RUN, check_fits, load_checkpoint
from store.files import (
    check_writable,
    claim_folder,
    read_json,
    release,
    run_quietly,
    write_lines_atomic,
)

parser = argparse.ArgumentParser(description="Paired evaluation of learned sampling schedules.")
parser.error = lambda message: parser.exit(2, f"evaluate.py: error: {message}\n")  # no usage
add = parser.add_argument
# I/O
add("--ckpt", default=MAIN_RUN, help="instance-level checkpoint written by train.py")
add("--global-ckpt", help="optional checkpoint of a global schedule (same backbone and L)")
add("--out-dir", help="output folder; default: eval/ next to --ckpt")
add("--figure", action="store_true", help="also draw results.png (differences, learned times)")
# contexts
add("--prompts", help="prompt file (.txt, .json, .jsonl)")
add("--hpdv2", nargs="?", const="hub", help="HPDv2 test prompts: folder of <style>.json, else hub")
add("--count", type=int, help="contexts of train.py's held-out prompts (default: its own count)")
add("--seed", type=noise_seed, default=HELDOUT_SEED, help="context i uses noise seed SEED + i")
add("--limit", type=int, help="evaluate only the first N contexts (HPDv2: styles interleaved)")
# methods and rewards (--reward-checkpoint repeats; default: the training reward's, else the hub)
add(
    "--rewards",
    nargs="+",
    choices=list(reward_lib.REWARDS),
    metavar="NAME",
    help="default: the training reward (+ clip with hpsv2)",
)
add("--reward-checkpoint", action="append", default=[], metavar="NAME=PATH", help="local weights")
add("--reference", action="store_true", help="also score the teacher solution (backbone.reference)")
add(
    "--schnell",
    action="store_true",
    help="flux-dev, mini-flux: add the distilled (mini-)flux-schnell at 4 steps and at L",
)
add("--schnell-path", help="local Flux-Schnell folder; default: the hub cache or the miniature")
# consistency checks against the checkpoint
add("--backbone", help="expected backbone; an error if the checkpoint was trained on another")
add("--steps", type=int, help="expected L; an error if the checkpoint was trained for another")
# system
add("--batch-size", type=int, help="contexts per batch; default 8 at 512 px and up, else 256")
add("--device", help="default: cuda when available, else cpu")


AGAIN = "run the same command again: it scores only what scores.json lacks"
SAVE_EVERY = 30.0  # seconds between writes of scores.json (and at the end, and at a Ctrl-C)
PARTS = ("rows", "rewards", "contexts", "scores", "times")  # what scores.json holds
OUTPUTS = ("scores.json", "results.md", "results.png")  # what evaluate.py writes in --out-dir


def score_store(path, rows, rewards=None):
    """evaluate.py's resumable scores.json (rows, rewards, contexts, scores, times), empty when
    absent; ValueError in one line if it is damaged, or scored one of `rows` (name -> what its
    scores depend on) or of `rewards` (name -> its weights) with other settings."""
    advice = "move it away to score afresh, or use another --out-dir"
    store = read_json(path, advice) if os.path.isfile(path) else {part: {} for part in PARTS}
    if not isinstance(store, dict) or not all(isinstance(store.get(k), dict) for k in PARTS):
        raise ValueError(f"{path} is not a scores.json of evaluate.py; {advice}")
    for part, entries in (("rows", rows), ("rewards", rewards or {})):
        for name, value in entries.items():
            if store[part].setdefault(name, value) != value:
                raise ValueError(
                    f"{path} holds '{name}' scores of {store[part][name]}, not {value}: use "
                    "another --out-dir"
                )
    return store


def weights_digest(policy):
    """What a policy's scores depend on, whatever file it was read from: its configuration and
    weights, hashed."""
    digest = hashlib.sha256(json.dumps(policy.config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(policy.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def weights_identity(path):
    """What scores of local weights depend on, short of reading them: the path, with the size and
    time of change of a file (one replaced in place is another), or the path alone (a hub id, or
    None for the default weights)."""
    if not path or not os.path.isfile(path):
        return path
    stat = os.stat(path)
    return f"{os.path.abspath(path)} ({stat.st_size} bytes, changed at {stat.st_mtime:.0f})"


def check_args(args):
    """evaluate.py's command line against its checkpoints, before anything heavy loads (ValueError
    in one line): returns the run's config, name -> (path, policy) of the policies to evaluate, the
    reward names, reward -> local weights and the output folder."""
    checkpoint, learned = load_checkpoint(args.ckpt, args.backbone, args.steps)
    config = checkpoint["config"]
    backbones.check_trained_on(config, args.ckpt)
    trained_on, trained_reward = config["backbone"], config.get("reward")
    if trained_reward is None and not args.rewards:
        raise ValueError(f"{args.ckpt} names no training reward; pass --rewards NAME")
    policies = {"learned": (args.ckpt, learned)}
    if args.global_ckpt:  # the same backbone and L
        global_run, policy = load_checkpoint(args.global_ckpt, trained_on, config["steps"])
        if not isinstance(policy, GlobalPolicy):
            kind = global_run["config"].get("policy", "instance")
            raise ValueError(
                f"--global-ckpt {args.global_ckpt} is a run of --policy {kind}; pass a run of "
                "train.py --policy global"
            )
        policies["global"] = (args.global_ckpt, policy)
    beside = ["clip"] if trained_reward == "hpsv2" else []
    for item in args.reward_checkpoint:
        if "=" not in item or not item.split("=", 1)[0]:
            example = "e.g. hpsv2=/path/HPS_v2.1_compressed.pt"
            raise ValueError(f"--reward-checkpoint takes NAME=PATH ({example}), got {item!r}")
    local = {trained_reward: config.get("reward_checkpoint")}  # reward -> its local weights
    local.update(item.split("=", 1) for item in args.reward_checkpoint)
    for name in args.rewards or []:  # as train.py refuses it
        reward_lib.check_digits(name, trained_on, backbones.BACKBONES[trained_on])
    if args.schnell and trained_on not in backbones.DISTILLED:
        raise ValueError(
            f"--schnell is the reference for {' and '.join(backbones.DISTILLED)}, not for "
            f"{trained_on!r}"
        )
    sizes = {"--count": args.count, "--limit": args.limit, "--batch-size": args.batch_size}
    for flag, value in sizes.items():
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1 (got {value})")
    out_dir = args.out_dir or os.path.join(os.path.dirname(os.path.abspath(args.ckpt)), "eval")
    check_writable(out_dir)
    return config, policies, args.rewards or [trained_reward, *beside], local, out_dir


def default_batch_size(backbone):
    """Contexts per batch: 8 at 512 px and above (a GPU's memory), 256 for the small backbones."""
    return 8 if backbone.resolution >= 512 else 256


def main(argv=None):
    args = parser.parse_args(argv)
    claim = None  # the output folder, once taken
    try:  # every refusal in one line before the first score, the folder left as it was
        config, policies, reward_names, local, out_dir = check_args(args)
        steps, trained_on = config["steps"], config["backbone"]
        prompt_list, styles = None, None  # styles group the tables: HPDv2's, a .jsonl's style/tag
        if args.hpdv2:
            prompt_list, styles = load_hpdv2(None if args.hpdv2 == "hub" else args.hpdv2)
        elif prompt_file := args.prompts or config["eval_prompts"]:
            prompt_list, styles = load_prompt_file(prompt_file), prompt_groups(prompt_file)
        device = backbones.check_device(args.device)
        store_path = os.path.join(out_dir, "scores.json")
        # one writer, and a folder of ours or free of our outputs, before its scores are read
        claim = claim_folder(out_dir, "evaluate.py", OUTPUTS)
        score_store(store_path, {})  # a damaged one fails before anything loads
        torch.set_num_threads(config.get("threads") or torch.get_num_threads())  # the run's
        backbone = backbones.trained_backbone(config, device)
        for path, policy in policies.values():
            check_fits(policy, backbone, path)
        backbone.check_prompts(prompt_list or [], config.get("reward"))
        own = not (args.hpdv2 or args.prompts)  # train.py's held-out prompts: its count by default
        count = args.count or (config["eval_contexts"] if own else None)
        prompts, seeds = heldout_contexts(prompt_list or backbone.prompts, count, args.seed)
        styles = (styles or [None] * len(prompts))[: args.limit]
        prompts, seeds = prompts[: args.limit], seeds[: args.limit]

        rewards = {}
        for name in reward_names:
            try:
                options = dict(device=device, checkpoint=local.get(name))
                if name in reward_lib.DIGIT_REWARDS:  # a damaged model is named, not skipped
                    reward_lib.check_reward(name, local.get(name))
                rewards[name] = reward_lib.load_reward(name, backbone, **options)
            except (ImportError, ValueError, OSError) as error:
                print(f"skipping reward {name!r}: {error}")
        if not rewards:
            raise ValueError(f"none of the rewards {reward_names} could be loaded")

        # every row with what its scores depend on (the backbone's settings, the policy's
        # weights), and every reward with its weights: stored scores of anything else are stale
        settings = {key: config.get(key) for key in ("backbone", "resolution", "guidance")}
        settings.update(model=weights_identity(config.get("model_path")), dtype=str(backbone.dtype))
        settings.update(device=backbone.device.type)
        methods = {"default": default_schedule(backbone, steps)}
        identity = {"default": dict(settings, steps=steps)}
        for name, (_, policy) in policies.items():
            methods[name] = policy_schedule(policy.to(backbone.device), backbone)
            identity[name] = dict(settings, steps=steps, weights=weights_digest(policy))
        runs = [(backbone, methods, "reference" if args.reference else None)]
        if args.reference:
            identity["reference"] = settings
        if args.schnell:  # the same seeds give Flux-Schnell the same noise: its rows are paired too
            try:
                options = dict(device=device, dtype=backbone.dtype, resolution=config["resolution"])
                distilled = backbones.DISTILLED[trained_on]  # flux-schnell, or mini-flux-schnell
                schnell = backbones.load_backbone(distilled, path=args.schnell_path, **options)
                counts = sorted({4, steps})  # its distilled step count, and L
                schnell_methods = {f"schnell-{n}": default_schedule(schnell, n) for n in counts}
                runs.append((schnell, schnell_methods, None))
                for n in counts:
                    identity[f"schnell-{n}"] = dict(backbone=distilled, steps=n)
            except ValueError as error:
                print(f"skipping Flux-Schnell (not available: {error})")
        print(
            f"backbone {trained_on}, L={steps}, {len(prompts)} contexts, rows {list(identity)}, "
            f"rewards {list(rewards)}, output {out_dir}"
        )
        weights = {name: weights_identity(local.get(name)) for name in rewards}
        store = score_store(store_path, identity, weights)
    except BaseException as error:  # a refused or failed start leaves the folder as it was
        if claim is not None:
            release(claim)
        if not isinstance(error, ValueError):
            raise
        sys.exit(f"evaluate.py: error: {error}")

    keys = [f"{seed}|{prompt}" for prompt, seed in zip(prompts, seeds)]
    for key, prompt, seed, style in zip(keys, prompts, seeds, styles):
        store["contexts"][key] = dict(prompt=prompt, seed=seed, style=style)

    def pending(row, index):
        stored = store["scores"].get(row, {})
        return any(keys[index] not in stored.get(reward_name, {}) for reward_name in rewards)

    def write(name, text):  # a full disk or read-only storage: one line, the last good file kept
        try:
            write_lines_atomic(os.path.join(out_dir, name), [text], then=AGAIN)
        except ValueError as error:
            sys.exit(f"evaluate.py: error: {error}")

    batch_size = args.batch_size or default_batch_size(backbone)
    scored, saved = 0, time.monotonic()
    try:
        for model, rows, reference in runs:  # the trained backbone's rows, then Flux-Schnell's
            batches = score_batches(
                model, rewards, prompts, seeds, rows, reference, batch_size, pending, progress=True
            )
            for scores, times in batches:
                for name, per_reward in scores.items():
                    for reward_name, values in per_reward.items():
                        column = store["scores"].setdefault(name, {}).setdefault(reward_name, {})
                        column.update({keys[i]: v for i, v in values.items()})
                        scored += len(values)
                    row_times = {keys[i]: t for i, t in times.get(name, {}).items()}
                    store["times"].setdefault(name, {}).update(row_times)
                if time.monotonic() - saved > SAVE_EVERY:  # scores.json, now and then
                    write("scores.json", json.dumps(store))
                    saved = time.monotonic()
    except KeyboardInterrupt:  # Ctrl-C: what is scored is kept; one line, exit 130 as a shell
        if not scored:  # the folder as it was, and run_quietly's one line
            release(claim)
            raise
        write("scores.json", json.dumps(store))
        claim[0].close()
        kept = f"{store_path} keeps every score made so far; the same command scores the rest"
        print(f"evaluate.py: interrupted: {kept}", file=sys.stderr)
        sys.exit(130)
    if scored or not os.path.isfile(store_path):
        write("scores.json", json.dumps(store))

    lines = [
        f"# Evaluation of {os.path.relpath(args.ckpt, out_dir)}\n\nbackbone {trained_on}, L = "
        f"{steps} steps, {len(prompts)} contexts (prompt + noise seed), every method on the same "
        "noise. Mean ± half-width of the 95% Student-t interval; diff = paired difference to the "
        "default schedule on the same contexts. Higher is better.",
        "",
    ]

    def in_order(values):  # {key: value} -> Tensor, in context order
        return torch.tensor([values[key] for key in keys])

    tables = {}  # column -> row -> Tensor (N,)
    for reward_name in rewards:
        for column in reward_lib.COLUMNS.get(reward_name, (reward_name,)):
            tables[column] = {row: in_order(store["scores"][row][column]) for row in identity}
    groups = sorted(set(styles) - {None})
    masks = {g: torch.tensor([g is None or s == g for s in styles]) for g in [None, *groups]}
    for column, scores in tables.items():
        for group in [None, *groups]:
            masked = {row: values[masks[group]] for row, values in scores.items()}
            lines += [f"## {column}" + (f", {group}" if group else ""), ""]
            lines += [format_table(summarize(masked)), ""]
        if groups:  # GenEval's overall score is this mean over its tasks
            overall = ", ".join(
                f"{row} {sum(values[masks[group]].mean() for group in groups) / len(groups):.4g}"
                for row, values in scores.items()
            )
            lines += [f"mean over the {len(groups)} groups: {overall}", ""]
        print(f"\n{column}\n{format_table(summarize(scores))}")
    write("results.md", "\n".join(lines))
    written = f"{os.path.join(out_dir, 'results.md')} and scores.json"
    if args.figure:
        learned_times = {name: in_order(store["times"][name]) for name in policies}
        default_times = backbone.default_times(steps).cpu()
        plot_results(os.path.join(out_dir, "results.png"), tables, learned_times, default_times)
        written += " and results.png"
    claim[0].close()
    print(f"\nwrote {written}")


if __name__ == "__main__":  # Ctrl-C while scoring ends in main(), which keeps what it scored
    run_quietly("evaluate.py", main, "nothing was scored or written; the same command starts again")
