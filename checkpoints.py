"""
A training run on disk, and loading what it trained.

train.py writes into its --out-dir: ckpt.pt (everything to resume: policy, optimizer, iteration,
configuration, RNG state, the metrics rows; atomic), metrics.jsonl, eval.json, the figure, and
policy/: the trained policy in the Hugging Face Hub format (config.json + model.safetensors, no
pickle; the backbone, L and the training configuration in config.json), to share with
`policy.push_to_hub(repo_id)` and load with load_policy. evaluate.py, sample.py and pipeline.py take
either ckpt.pt or such a folder / hub id and rebuild the policy and its frozen backbone from it
alone. Every way a file can be missing, truncated or of another run ends in one line that says what
to do (check_backbone_files checks a model folder before it loads); a write that fails (a full disk,
read-only storage) keeps the last good file and says so in one line.
"""

import contextlib
import errno
import io
import json
import os
import shutil

import torch

import backbones
from hub import hub_file


class WriteFailed(ValueError):
    """A write to a run folder failed (write_failed says why, in one line)."""


def write_failed(path, error, needed=None):
    """The one line that ends a run whose write failed: which folder, why, and (disk full) how much
    free space the write needs."""
    folder = os.path.dirname(os.path.abspath(path))
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(folder).free
        size = f"{needed / 2**20:.1f} MiB free" if needed else "more free space"
        return WriteFailed(
            f"could not write {path}: the disk is full ({free / 2**20:.1f} MiB free in {folder}, "
            f"the write needs {size}); free some space and run the same command again: it "
            "continues from the last checkpoint"
        )
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return WriteFailed(
            f"could not write {path}: {folder} is not writable ({error.strerror}); make it "
            "writable, or pass another --out-dir"
        )
    return WriteFailed(f"could not write {path}: {error.strerror or error}")


def write_bytes_atomic(path, data):
    """Written to a temporary file, then renamed: a kill never leaves a corrupt file. A write that
    fails (disk full, read-only storage) removes its temporary file, leaves the earlier file as it
    was and raises ValueError in one line (write_failed)."""
    try:
        with open(path + ".tmp", "wb") as file:
            file.write(data)
        os.replace(path + ".tmp", path)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise write_failed(path, error, len(data)) from None


def save_checkpoint(path, state):
    """Serialised in memory first (its size is known before the disk is touched), then written
    atomically (write_bytes_atomic)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_bytes_atomic(path, buffer.getvalue())


def write_lines_atomic(path, lines):
    write_bytes_atomic(path, "".join(lines).encode())


def write_json_atomic(path, data):
    write_lines_atomic(path, [json.dumps(data)])


def read_checkpoint(path):
    """The state train.py saved, loaded without unpickling code (weights_only). ValueError in one
    line if the file is missing, empty, truncated or not a checkpoint of train.py."""
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path} (train one with `python train.py`)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    # EOFError, UnpicklingError, RuntimeError of the zip reader, OSError: all mean "unreadable"
    except Exception as error:
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
    policy.save_pretrained(folder, config=arguments)
    umask = os.umask(0)  # safetensors writes 0600: readable as any other file of the run
    os.umask(umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def load_checkpoint(source, backbone=None, steps=None):
    """A trained policy (CPU, eval mode) and what it came from, {"config": training configuration,
    "iteration": ...}, from a train.py checkpoint file or a policy folder / hub id (save_policy).
    backbone / steps, when given, must match what it was trained for: ValueError with one clear line
    otherwise, before anything heavy."""
    if os.path.isfile(source):
        checkpoint = read_checkpoint(source)
        training = dict(checkpoint["config"], iteration=checkpoint["iteration"])
        arguments = dict(backbone=training["backbone"], training_config=training)
        try:  # a policy saved by another version of its class is refused in one line
            policy = backbones.build_policy(dict(checkpoint["policy_config"], **arguments))
            policy.load_state_dict(checkpoint["policy"])
        except (TypeError, RuntimeError, ValueError) as error:
            kind = checkpoint["policy_config"].get("kind", "instance")
            raise ValueError(
                f"{source} holds a {kind} policy this version cannot load "
                f"({str(error).splitlines()[0][:120]}); train it again"
            ) from None
    # a folder, or a hub id user/name
    elif os.path.isdir(source) or (source.count("/") == 1 and not source.endswith(".pt")):
        names = ("config.json", "model.safetensors")
        missing = f"{source} holds no policy saved by train.py (config.json and model.safetensors)"
        in_folder = os.path.isdir(source)
        if in_folder and not all(os.path.isfile(os.path.join(source, name)) for name in names):
            raise ValueError(missing)
        if in_folder:
            files = {name: os.path.join(source, name) for name in names}
        else:
            files = {name: hub_file(source, name, missing) for name in names}
        again = "train again, or pass the policy/ folder of another run"
        saved = read_json(files["config.json"], again)
        check_safetensors(files["model.safetensors"], again)
        if not isinstance(saved, dict) or "steps" not in saved:
            raise ValueError(missing)
        # whatever save_pretrained / push_to_hub wrote: the training configuration when there is
        # one, else what the folder itself says (backbone, L)
        training = saved.get("training_config")
        if training is None:
            training = dict(backbone=saved.get("backbone"), steps=saved["steps"])
        training = dict(training, iteration=training.get("iteration", saved.get("iteration")))
        checkpoint = dict(config=training, iteration=training["iteration"])
        kind = saved.get("kind") or ("instance" if "latent_channels" in saved else "global")
        folder = os.path.dirname(files["config.json"])
        # the mixin prints "Loading weights from local directory"
        with contextlib.redirect_stdout(io.StringIO()):
            policy = backbones.POLICIES[kind].from_pretrained(
                folder, backbone=training["backbone"], training_config=training
            )
    else:
        raise ValueError(f"no checkpoint at {source} (train one with `python train.py`)")
    config = checkpoint["config"]
    if backbone is not None and config["backbone"] is not None and backbone != config["backbone"]:
        trained_on = config["backbone"]
        raise ValueError(f"{source} was trained on backbone {trained_on!r}, not {backbone!r}")
    if steps is not None and steps != config["steps"]:
        raise ValueError(f"{source} was trained for L={config['steps']} steps, not L={steps}")
    return checkpoint, policy.eval()


def load_policy(source, backbone=None, steps=None):
    """Just the policy of load_checkpoint: from ckpt.pt, a policy folder or a hub id."""
    return load_checkpoint(source, backbone, steps)[1]


def read_json(path, advice):
    """A JSON file's content; ValueError in one line naming the file if it is not JSON."""
    try:
        with open(path) as handle:
            return json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path} is damaged (not JSON: {type(error).__name__}); {advice}"
        ) from None


def check_safetensors(path, advice):
    """ValueError in one line unless `path` is a whole safetensors file: its header parses and its
    tensors' data ends where the file ends (a truncated or random file fails). Reads the header
    only, so it is cheap for a model of any size."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if size < 8 or length > size - 8:
                raise ValueError
            header = json.loads(handle.read(length))
        ends = [item["data_offsets"][1] for key, item in header.items() if key != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, UnicodeDecodeError):
        raise ValueError(f"{path} is damaged (not a safetensors file); {advice}") from None
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        raise ValueError(f"{path} is truncated ({size:,} of {expected:,} bytes); {advice}")


# the files a tokenizer reads its vocabulary from (fast tokenizers, CLIP's BPE, T5's SentencePiece)
VOCABULARIES = ("tokenizer.json", "vocab.json", "spiece.model", "vocab.txt")


def check_backbone_files(name, path=None):
    """Where backbone `name` loads from (backbones.locate_weights: ValueError in one line when
    missing), checked before anything loads: the folder holds the pipeline class of the backbone's
    family, and every component it lists has its configuration and whole weight files. ValueError
    in one line naming the file, what is wrong and what to do."""
    spec = backbones.BACKBONES[name]
    if spec["family"] == "mixture":
        return None
    location = backbones.locate_weights(name, path)
    folder = location
    if not os.path.isdir(location):  # a hub id, found in the local cache (or just downloaded)
        from huggingface_hub import try_to_load_from_cache

        index = try_to_load_from_cache(location, "model_index.json")
        if not isinstance(index, str):
            return location  # from_pretrained downloads it
        folder = os.path.dirname(index)
    if path is None and spec.get("folder"):
        advice = (
            f"restore it with `git checkout {spec['folder']}`, or retrain it with "
            f"`{backbones.retrain_command(name)}`"
        )
    elif path is not None:
        advice = "download the model again, or pass another --model-path"
    else:
        advice = f"delete {location} from the hub cache and run again to download it afresh"
    index = read_json(os.path.join(folder, "model_index.json"), advice)
    wanted = backbones.PIPELINES[spec["family"]]
    if not isinstance(index, dict) or index.get("_class_name") != wanted:
        held = index.get("_class_name") if isinstance(index, dict) else None
        raise ValueError(
            f"{folder} holds a {held}, not the {wanted} that {name} runs; pass the folder of "
            f"a {spec['family']} model"
        )
    for component, entry in index.items():
        if component.startswith("_") or not isinstance(entry, list) or None in entry:
            continue
        subfolder = os.path.join(folder, component)
        files = os.listdir(subfolder) if os.path.isdir(subfolder) else []
        configs = [file for file in files if file.endswith("config.json")]
        if not configs:
            raise ValueError(f"{subfolder} has no configuration (config.json); {advice}")
        # without its vocabulary a tokenizer can load as nothing at all, and its encoder goes unused
        if "Tokenizer" in entry[1] and not any(file in VOCABULARIES for file in files):
            raise ValueError(f"{subfolder} has no vocabulary ({entry[1]}); {advice}")
        for file in configs:
            read_json(os.path.join(subfolder, file), advice)
        for file in files:
            if file.endswith(".safetensors"):
                check_safetensors(os.path.join(subfolder, file), advice)
    return location


def check_reward_model(kind, folder=None):
    """A digit reward model's folder (rewards.model_folder: "classifier" or "preference") whole:
    ValueError in one line naming a damaged file."""
    import rewards

    folder = rewards.model_folder(kind, folder)
    advice = (
        f"restore it with `git checkout miniatures/{kind}`, or retrain it with "
        f"`python miniature.py --family {kind}`"
    )
    read_json(os.path.join(folder, "config.json"), advice)
    check_safetensors(os.path.join(folder, "model.safetensors"), advice)


def check_reward_files(name, checkpoint=None):
    """rewards.check_reward (the reward's packages and weights are here), and the digit rewards'
    models whole (the preference reward also reads the classifier, for its accuracy column)."""
    import rewards

    rewards.check_reward(name, checkpoint)
    if name == "digit":
        check_reward_model("classifier", checkpoint)
    if name == "preference":
        check_reward_model("preference", checkpoint)
        check_reward_model("classifier")


def open_backbone(name, path=None, **options):
    """backbones.load_backbone after check_backbone_files. Weights that the model classes refuse
    although every file is whole (shapes other than the configuration says) end in one line naming
    the folder, not in the library's advice alone."""
    location = check_backbone_files(name, path)
    try:
        return backbones.load_backbone(name, path=path, **options)
    except ValueError as error:
        if str(error).startswith(f"{name}:"):  # backbones' own one-line message
            raise
        reason = str(error).splitlines()[0]
        raise ValueError(
            f"{name}: {location} does not load ({reason}); pass the folder of a {name} model"
        ) from None


def trained_backbone(config, device):
    """The frozen backbone a checkpoint was trained with, rebuilt from its configuration alone
    (its files checked first: open_backbone)."""
    return open_backbone(
        config["backbone"],
        path=config["model_path"],
        device=device,
        dtype=getattr(torch, config["dtype"]) if config["dtype"] else None,
        resolution=config["resolution"],
        guidance=config["guidance"],
    )


# What a run folder is continued with. The rest of the configuration defines the experiment:
# changing it would mix two runs in one metrics.jsonl and one eval.json.
CONTINUABLE = (
    "out_dir",
    "resume",
    "ckpt_interval",
    "log_interval",
    "snapshots",
    "iterations",
    "device",
    "threads",
    "model_path",
)


def existing_run(config):
    """The checkpoint out_dir holds (None for a new run). ValueError in one line if it holds another
    run (any key outside CONTINUABLE differs), is damaged, or lost its metrics.jsonl."""
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
            raise ValueError(
                f"{config['out_dir']} holds a run with {key}={saved!r}, not {value!r}; pass "
                f"another --out-dir for this run (or {flag} {saved} to continue that one)"
            )
    if not os.path.isfile(os.path.join(config["out_dir"], "metrics.jsonl")):
        raise ValueError(
            f"{path} has no metrics.jsonl beside it; restore that file, or start afresh in another "
            "--out-dir"
        )
    return checkpoint


def score_store(path, rows):
    """evaluate.py's resumable scores (scores.json: rows, contexts, scores, times), empty when
    absent. ValueError in one line if the file is damaged or defines one of `rows` otherwise."""
    store = dict(rows={}, contexts={}, scores={}, times={})
    advice = "move it away to score afresh, or use another --out-dir"
    if os.path.isfile(path):
        store = read_json(path, advice)
        parts = ("rows", "contexts", "scores", "times")
        if not isinstance(store, dict) or not all(isinstance(store.get(k), dict) for k in parts):
            raise ValueError(f"{path} is not a scores.json of evaluate.py; {advice}")
    for name, value in rows.items():
        if store["rows"].setdefault(name, value) != value:
            raise ValueError(
                f"{path} holds '{name}' scores of {store['rows'][name]}, not {value}: use "
                "another --out-dir"
            )
    return store


def check_device(name):
    """The torch.device of a --device flag (None: cuda when available, else cpu). ValueError in one
    line for a name that is not a device here."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r} is not a device: pass cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}, but this machine has no CUDA device; pass --device cpu")
    return device


def check_writable(folder, flag="--out-dir"):
    """ValueError in one line unless `folder` is, or can be made, a folder this user writes to;
    creates nothing (the nearest existing ancestor is what is checked)."""
    if not folder:
        raise ValueError(f"{flag} is empty; pass a folder, or drop {flag} for the default")
    parent = os.path.abspath(folder)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        itself = parent == os.path.abspath(folder)
        if not os.path.isdir(parent):
            what = "a file, not a folder" if itself else f"not writable here ({parent} is a file)"
        elif itself:
            what = "a folder this user cannot write (read-only storage or permissions)"
        else:
            what = f"not writable here ({parent} is read-only for this user)"
        raise ValueError(f"{flag} {folder} is {what}; pass a folder this user can write")


def lock_run(out_dir):
    """One writer per run folder: an exclusive flock on out_dir/run.lock, held while this process
    lives and released by the operating system when it ends, however it ends (a killed run never
    blocks the next). ValueError in one line, naming the holder's PID, if another process holds it.
    Returns the open lock file: keep it referenced."""
    import fcntl

    os.makedirs(out_dir, exist_ok=True)
    handle = open(os.path.join(out_dir, "run.lock"), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise ValueError(
            f"{out_dir} is in use by another run (PID {holder}); wait for it to end, or pass "
            "another --out-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def metric_rows(path):
    """The rows of metrics.jsonl and how many lines were torn (a kill during an append leaves at
    most the last one unfinished; damage, any): those are skipped, not fatal, as every checkpoint
    carries the rows up to its iteration."""
    rows, torn = [], 0
    with open(path, errors="replace") as file:
        for line in file:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict) and isinstance(row.get("iteration"), int):
                rows.append(row)
            else:
                torn += 1
    return rows, torn


def restore(checkpoint, policy, optimizer, metrics_path=None):
    """Continue where the checkpoint stopped: weights, optimizer and RNG state, and metrics.jsonl
    (on the rank that writes it) cut back to its iteration, whose later rows will be logged again;
    a torn line is dropped with a note. Returns that iteration."""
    policy.load_state_dict(checkpoint["policy"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    torch.set_rng_state(checkpoint["rng"]["torch"])
    if metrics_path is None:
        return checkpoint["iteration"]
    rows, torn = metric_rows(metrics_path)
    if torn:
        print(
            f"note: dropped {torn} torn line(s) of {metrics_path} (an append cut short by a kill)"
        )
    iteration = checkpoint["iteration"]
    kept = {row["iteration"]: row for row in rows if row["iteration"] <= iteration}
    # the checkpoint carries the rows up to its iteration: a row lost to a torn line comes back
    carried = [row for row in checkpoint.get("metrics", []) if row["iteration"] <= iteration]
    kept = {**{row["iteration"]: row for row in carried}, **kept}
    lines = [json.dumps(kept[done]) + "\n" for done in sorted(kept)]
    write_lines_atomic(metrics_path, lines)
    return iteration


def claim_run(out_dir, fresh):
    """Take out_dir for this run (lock_run; ValueError in one line if another run holds it). A
    fresh run (no checkpoint) finding a metrics.jsonl finds what a run that failed before its first
    checkpoint left: it is kept as metrics.jsonl.failed (replacing an older one), with a note, so
    that the two runs' rows are never mixed. Returns the lock: keep it referenced."""
    lock = lock_run(out_dir)
    for name in os.listdir(out_dir):  # what a write cut short left (write_bytes_atomic)
        if name.endswith(".tmp"):
            os.remove(os.path.join(out_dir, name))
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if fresh and os.path.isfile(metrics_path):
        rows, _ = metric_rows(metrics_path)
        os.replace(metrics_path, metrics_path + ".failed")
        print(
            f"note: {metrics_path} held {len(rows)} row(s) of a run that stopped before its first "
            f"checkpoint; moved to {metrics_path}.failed, this run starts afresh"
        )
    return lock
