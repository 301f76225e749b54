"""
A policy built for a backbone, saved with what trained it, and loaded back: train.py writes ckpt.pt
(everything to resume, atomic) and policy/ (the Hugging Face Hub format, no pickle, shared with
`push_to_hub`); evaluate.py, sample.py and backbones/pipeline.py rebuild the policy from either.
"""

import contextlib
import errno
import io
import json
import os
import shutil

import torch

from comparator.tpdm import StepwisePolicy
from policy import GlobalPolicy, SchedulePolicy, json_times
from store.files import (
    check_safetensors,
    hub_file,
    metric_rows,
    read_json,
    write_bytes_atomic,
    write_failed,
    write_lines_atomic,
    write_or_exit,
)

# the checkpoint of `python train.py` (its default --out-dir): evaluate.py's and sample.py's default
MAIN_RUN = os.path.join("out", "digits-L4-instance-s0", "ckpt.pt")

# -----------------------------------------------------------------------------
# a policy for a backbone

# Network sizes, named in backbones.BACKBONES ("policy"). "real": about 20M parameters for the real
# models (the paper: "about 20M parameters, under 1% of the sampler"); "embedded": for the 8x8
# embedded backbones and the miniatures. `widths` are the conv stages, each halving the resolution,
# pooled to a `grid` x `grid` token grid of width `dim`.
PRESETS = {
    "real": dict(widths=[64, 128, 256, 512], dim=512, heads=8, depth=3, grid=8, head_hidden=1024),
    "embedded": dict(widths=[16, 32], dim=64, heads=4, depth=1, grid=2, head_hidden=128),
}

POLICIES = {"instance": SchedulePolicy, "global": GlobalPolicy, "stepwise": StepwisePolicy}


def make_policy(kind, backbone_dims, steps, init_times=None, preset="embedded", **options):
    """A policy for a backbone (`backbone_dims` = Backbone.policy_dims), sized by PRESETS[preset];
    it starts at the default schedule `init_times` (L+1,) when given, else at equal increments."""
    start = dict(init="uniform")
    if init_times is not None:
        start = dict(init="default", init_times=json_times(init_times))
    return POLICIES[kind].for_backbone(steps, backbone_dims, **(start | PRESETS[preset] | options))


def build_policy(config):
    """Rebuild a policy from its `.config` (then load_state_dict for its weights)."""
    config = dict(config)
    return POLICIES[config.pop("kind")](**config)


# -----------------------------------------------------------------------------
# saved and loaded


def save_checkpoint(path, state):
    """Serialised in memory first, then written atomically (write_bytes_atomic)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_bytes_atomic(path, buffer.getvalue())


def read_checkpoint(path):
    """The state train.py saved (weights_only: no code unpickled); ValueError if the file is empty,
    truncated or not a checkpoint of train.py."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # EOFError, UnpicklingError, the zip reader's RuntimeError, ...
        raise ValueError(
            f"{path} is not a readable checkpoint ({type(error).__name__}: the file is empty, "
            "truncated or of another program); train again or point to another file"
        ) from None
    required = {"policy", "policy_config", "config", "iteration"}
    if not isinstance(state, dict) or not required <= set(state):
        held = f"a {type(state).__name__}"
        if isinstance(state, dict):
            held = f"its keys: {sorted(map(str, state))[:6]}"
        raise ValueError(
            f"{path} is not a checkpoint written by train.py ({held}); pass the ckpt.pt or "
            "policy/ folder of a train.py run"
        )
    return state


def save_policy(folder, policy, config, iteration):
    """The policy in the Hub format: config.json holds its constructor arguments, among them the
    backbone and the training configuration (with the iteration); model.safetensors its weights."""
    training = dict(config, iteration=iteration)
    arguments = dict(policy.config, backbone=config["backbone"], training_config=training)
    staging = f"{folder}.tmp"  # written whole beside the last one, then put in its place
    shutil.rmtree(staging, ignore_errors=True)
    try:
        policy.save_pretrained(staging, config=arguments)
    except Exception as error:  # safetensors reports a full disk as SafetensorError (os error 28)
        shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(error, OSError):
            code = errno.ENOSPC if "os error 28" in str(error) else errno.EIO
            error = OSError(code, os.strerror(code))
        raise write_failed(folder, error) from None
    umask = os.umask(0)  # safetensors writes 0600: readable as any other file of the run
    os.umask(umask)
    for name in os.listdir(staging):
        os.chmod(os.path.join(staging, name), 0o666 & ~umask)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(staging, folder)


def load_checkpoint(source, backbone=None, steps=None):
    """A trained policy (CPU, eval mode) and {"config": its training configuration, "iteration"}
    (of ckpt.pt: all it holds), from ckpt.pt, a policy folder or a hub id; ValueError in one line if
    it does not load, or if `backbone` / `steps` differ from its own."""
    from_file = os.path.isfile(source)
    if from_file:
        checkpoint = read_checkpoint(source)
        training = dict(checkpoint["config"], iteration=checkpoint["iteration"])
        kind = checkpoint["policy_config"].get("kind", "instance")
        refusal = f"{source} holds a {kind} policy this version cannot load"
        advice = "train it again"
    elif os.path.isdir(source) or (source.count("/") == 1 and not source.endswith(".pt")):
        config_path, training, kind = read_policy_folder(source)  # a folder, or a hub id user/name
        checkpoint = dict(config=training, iteration=training["iteration"])
        refusal = f"{config_path} does not describe the weights beside it"
        advice = f"restore it, or {AGAIN}"
    else:
        raise ValueError(f"no checkpoint at {source} (train one with `python train.py`)")
    trained_with = dict(backbone=training["backbone"], training_config=training)
    try:  # a class changed since it was saved, or config.json edited out of step with the weights
        if from_file:
            policy = build_policy(dict(checkpoint["policy_config"], **trained_with))
            policy.load_state_dict(checkpoint["policy"])
        else:  # strict: the mixin's default loads a partial file into a random network
            folder = os.path.dirname(config_path)
            with contextlib.redirect_stdout(io.StringIO()):  # the mixin prints "Loading weights"
                policy = POLICIES[kind].from_pretrained(folder, strict=True, **trained_with)
    except (TypeError, RuntimeError, ValueError) as error:
        raise ValueError(f"{refusal} ({' '.join(str(error).split())[:200]}); {advice}") from None
    config = checkpoint["config"]
    if backbone is not None and config["backbone"] is not None and backbone != config["backbone"]:
        trained_on = config["backbone"]
        raise ValueError(f"{source} was trained on backbone {trained_on!r}, not {backbone!r}")
    if steps is not None and steps != config["steps"]:
        raise ValueError(f"{source} was trained for L={config['steps']} steps, not L={steps}")
    return checkpoint, policy.eval()


AGAIN = "train again, or pass the policy/ folder of another run"
RESTORE = "restore the file from the run folder it came from, or train again"


def read_policy_folder(source):
    """A policy folder's (or hub id's) config.json, both files checked whole: its path, the
    training configuration and the policy's kind. ValueError names a field of config.json that
    contradicts the rest (edited by hand): a kind no policy has, a backbone or L other than its
    training configuration's."""
    names = ("config.json", "model.safetensors")
    missing = f"{source} holds no policy saved by train.py (config.json and model.safetensors)"
    if os.path.isdir(source):
        if not all(os.path.isfile(os.path.join(source, name)) for name in names):
            inside = [name for name in ("policy", "ckpt.pt") if os.path.exists(f"{source}/{name}")]
            if inside:  # a run folder of train.py, given instead of what it holds
                ways = " or ".join(os.path.join(source, name) for name in inside)
                raise ValueError(f"{source} is a run folder of train.py: pass {ways}")
            raise ValueError(missing)
        path, weights = (os.path.join(source, name) for name in names)
    else:  # a hub id, or a local path with a typo
        missing = (
            f"{source}: no such folder here ({os.path.abspath(source)}), nor a policy on the hub"
        )
        if os.path.isdir(source.split("/")[0]):  # more likely a typo than a hub id
            raise ValueError(f"{source}: no such folder ({os.path.abspath(source)})")
        path, weights = (hub_file(source, name, missing) for name in names)
    saved = read_json(path, AGAIN)
    check_safetensors(weights, AGAIN)
    if not isinstance(saved, dict) or "steps" not in saved:
        raise ValueError(missing)
    training = saved.get("training_config")  # save_policy's; else what the folder says
    if training is None:
        training = dict(backbone=saved.get("backbone"), steps=saved["steps"])
    kind = saved.get("kind") or ("instance" if "latent_channels" in saved else "global")
    if not isinstance(training, dict):
        raise ValueError(f'{path}: "training_config" is not a mapping; {RESTORE}')
    training = {"backbone": saved.get("backbone"), "steps": saved["steps"], **training}
    if kind not in POLICIES:
        known = ", ".join(POLICIES)
        raise ValueError(f'{path}: "kind" is {kind!r}, not a policy kind ({known}); {RESTORE}')
    for field in ("backbone", "steps"):
        trained = training.get(field)
        if saved.get(field) is not None and trained is not None and saved[field] != trained:
            raise ValueError(
                f'{path}: "{field}" is {saved[field]!r} but its "training_config" says '
                f"{trained!r}; {RESTORE}"
            )
    return path, dict(training, iteration=training.get("iteration", saved.get("iteration"))), kind


def check_fits(policy, backbone, source):
    """ValueError when the policy reads inputs of other sizes than the backbone gives."""
    keys = ("latent_channels", "text_dim", "pooled_dim")
    built = {key: policy.config[key] for key in keys if key in policy.config}
    given = {key: backbone.policy_dims.get(key) for key in built}
    if built != given:
        raise ValueError(
            f"{source} was built for inputs {built}, {backbone.name} gives {given}: its "
            f"config.json names another backbone's sizes; {RESTORE}"
        )


def load_policy(source, backbone=None, steps=None):
    """Just the policy of load_checkpoint: from ckpt.pt, a policy folder or a hub id."""
    return load_checkpoint(source, backbone, steps)[1]


# -----------------------------------------------------------------------------
# a run folder continued

# What a run folder is continued with. The rest of the configuration defines the experiment:
# changing it would mix two runs in one metrics.jsonl and one eval.json.
CONTINUABLE = set(
    "out_dir resume ckpt_interval log_interval snapshots figure track iterations device threads "
    "model_path rollout_batch".split()
)


def existing_run(config):
    """The checkpoint out_dir holds (None for a new run); ValueError if it holds another run (a key
    outside CONTINUABLE differs), is damaged, or lost its metrics.jsonl."""
    path = os.path.join(config["out_dir"], "ckpt.pt")
    if not os.path.isfile(path):
        if config["resume"]:
            raise ValueError(f"--resume but {path} does not exist; drop --resume to start afresh")
        return None
    checkpoint = read_checkpoint(path)
    for key, value in config.items():
        saved = checkpoint["config"].get(key)
        if key not in CONTINUABLE and saved != value:
            flag = "--" + key.replace("_", "-")
            same = f"{flag} {saved}"
            if saved is None or isinstance(saved, bool):  # a flag left out, or switched on
                same = f"pass {flag}" if saved else f"drop {flag}"
            raise ValueError(
                f"{config['out_dir']} holds a run with {key}={saved!r}, not {value!r}; pass "
                f"another --out-dir for this run (or {same} to continue that one)"
            )
    if not os.path.isfile(os.path.join(config["out_dir"], "metrics.jsonl")):
        raise ValueError(
            f"{path} has no metrics.jsonl beside it; restore that file, or start afresh in another "
            "--out-dir"
        )
    return checkpoint


def restore(checkpoint, policy, optimizer, metrics_path=None):
    """Continue where the checkpoint stopped: weights, optimizer and RNG state, and metrics.jsonl
    (on the rank that writes it) rewritten from the checkpoint's rows. Returns its iteration."""
    policy.load_state_dict(checkpoint["policy"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    torch.set_rng_state(checkpoint["rng"]["torch"])
    iteration = checkpoint["iteration"]
    if metrics_path:
        torn = metric_rows(metrics_path)[1]
        if torn:
            note = f"note: dropped {torn} torn line(s) of {metrics_path}"
            print(f"{note} (an append cut short by a kill)")
        rows = [row for row in checkpoint["metrics"] if row["iteration"] <= iteration]
        write_lines_atomic(metrics_path, [json.dumps(row) + "\n" for row in rows])
    return iteration


def snapshot(out_dir, policy, done, config, keep):
    """With --snapshots (keep), the policy after `done` iterations in snapshots/policy-<done>.pt,
    for evidence/baseline_study.py (no optimizer or RNG state)."""
    if keep:
        path = os.path.join(out_dir, "snapshots", f"policy-{done}.pt")
        state = dict(policy=policy.state_dict(), policy_config=policy.config, iteration=done)
        with write_or_exit(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_checkpoint(path, dict(state, config=config))


def interrupted(out_dir, iterations):
    """The one line a Ctrl-C ends train.py with: what the run folder keeps, and how to go on."""
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        return (
            f"interrupted before the first checkpoint: nothing of this run is kept in "
            f"{out_dir}; the same command starts it afresh"
        )
    iteration = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["iteration"]
    return (
        f"interrupted: {path} holds iteration {iteration} of {iterations}; the same command "
        "continues from there"
    )
