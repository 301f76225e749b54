"""
Files on disk and on the Hugging Face Hub: this checkout's root (where the shipped miniatures,
reward models and prompt sets are found), a Hub file from the local cache or downloaded, a JSON or
safetensors file checked whole before anything loads it, and a run folder's files written
atomically (a kill never leaves a torn file; a full disk or read-only storage ends in one line that
keeps the last good file), held by one writer at a time, and its metrics.jsonl read back whatever a
kill left of it.
"""

import contextlib
import errno
import json
import os
import shutil

# this checkout's root: the shipped miniatures, reward models and prompt sets are found from it
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hub_file(repo, filename, missing, repo_type=None):
    """A file of a hub repository from the local cache, else downloaded. When it is neither cached
    nor reachable: ValueError(`missing` + why) at once. The metadata request is made without
    retries (huggingface_hub's fast fallback), not after hf_hub_download's five."""
    from huggingface_hub import (
        get_hf_file_metadata,
        hf_hub_download,
        hf_hub_url,
        try_to_load_from_cache,
    )

    try:
        cached = try_to_load_from_cache(repo, filename, repo_type=repo_type)
    except ValueError:  # not a repository id at all: a local path that does not exist, say
        raise ValueError(f"{missing} (no such folder, and not a hub repository id)") from None
    if isinstance(cached, str):
        return cached
    try:
        get_hf_file_metadata(hf_hub_url(repo, filename, repo_type=repo_type))
        return hf_hub_download(repo, filename, repo_type=repo_type)
    except Exception as error:  # offline, unreachable, gated, missing: all mean "not available"
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{missing} (not in the local cache: {reason})") from None


def read_json(path, advice):
    """A JSON file's content; ValueError in one line naming the file if it is not JSON."""
    try:
        with open(path, encoding="utf-8-sig") as handle:
            return json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path} is damaged (not JSON: {type(error).__name__}); {advice}"
        ) from None


def check_safetensors(path, advice):
    """ValueError in one line unless `path` is a whole safetensors file, as safetensors itself
    opens it: the header parses and the tensors' data fills the file (a truncated or random file
    fails). Reads the header only, so it is cheap for a model of any size."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt"):
            pass
    except (SafetensorError, OSError) as error:
        reason = str(error).splitlines()[0]
        raise ValueError(f"{path} is damaged or truncated ({reason}); {advice}") from None


class WriteFailed(ValueError):
    """A write to a run folder failed (write_failed says why, in one line)."""


def write_failed(path, error, needed=None, then=None):
    """The one line that ends a run whose write failed: which folder, why, and (disk full) how much
    free space the write needs."""
    folder = os.path.dirname(os.path.abspath(path))
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(folder).free
        size = f"{needed / 2**20:.1f} MiB free" if needed else "more free space"
        return WriteFailed(
            f"could not write {path}: the disk is full ({free / 2**20:.1f} MiB free in {folder}, "
            f"the write needs {size}); free some space and "
            + (then or "run the same command again: it continues from the last checkpoint")
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


def write_lines_atomic(path, lines):
    write_bytes_atomic(path, "".join(lines).encode())


def write_json_atomic(path, data):
    write_lines_atomic(path, [json.dumps(data)])


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


# The marker of an output folder: the program that took it. A folder is a program's only if it
# carries this file with its name; the program writes, replaces or deletes only the files it writes.
MARKER = "written-by.json"
# what train.py writes into a run folder
RUN_FILES = (
    "ckpt.pt",
    "metrics.jsonl",
    "eval.json",
    "train.png",
    "policy",
    "snapshots",
    "tensorboard",
    "wandb",
)


def claim_folder(out_dir, program, outputs, flag="--out-dir"):
    """Take out_dir for `program` (train.py, sample.py, evaluate.py) before anything reads its
    state: the lock first (lock_run: one writer at a time), then the marker. A folder with our
    marker is ours; one without it is taken (and marked) only if it holds none of `outputs`, the
    names we write, so that a user's files are never overwritten. ValueError in one line otherwise,
    and the folder is left as it was. Returns the claim for `release`: (lock, out_dir, what this
    call added: the folder, or the lock and marker files)."""
    top = os.path.abspath(out_dir)  # the outermost folder this call will make, if any
    while not os.path.exists(os.path.dirname(top)):
        top = os.path.dirname(top)
    added = [top] if not os.path.exists(top) else []
    lock_path, marker = os.path.join(out_dir, "run.lock"), os.path.join(out_dir, MARKER)
    added += [] if added or os.path.exists(lock_path) else [lock_path]
    lock = lock_run(out_dir)
    claim = (lock, out_dir, added)
    try:
        if os.path.isfile(marker):
            owner = read_json(marker, f"move it away, or pass another {flag}")
            if not isinstance(owner, dict) or owner.get("program") != program:
                held = owner.get("program") if isinstance(owner, dict) else None
                raise ValueError(
                    f"{flag} {out_dir} holds the outputs of {held}, not of {program} ({MARKER}); "
                    f"pass another {flag}"
                )
            return claim
        clash = [name for name in outputs if os.path.lexists(os.path.join(out_dir, name))]
        if clash:  # a user's files where we would write our own: never overwritten
            raise ValueError(
                f"{flag} {out_dir} holds {', '.join(clash)}, which no run of {program} wrote "
                f"(there is no {MARKER}); pass another {flag}, or move them away"
            )
        write_json_atomic(marker, dict(program=program))
        added += [] if added[:1] == [top] else [marker]
        return claim
    except (ValueError, OSError):
        release(claim)
        raise


def release(claim):
    """Let go of a folder whose start was refused: the lock closed, and what the claim added
    removed (the folder it made, or the lock and marker files it wrote into a user's folder)."""
    lock, out_dir, added = claim
    lock.close()
    for path in added:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.isfile(path):
            os.remove(path)


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


def start_run(out_dir, fresh):
    """A run folder taken (claim_folder) is readied for its run: what a write of ours cut short
    (write_bytes_atomic's <name>.tmp) is removed, and a fresh run (no checkpoint) finding a
    metrics.jsonl finds what a run that failed before its first checkpoint left: it is kept as
    metrics.jsonl.failed (replacing an older one), with a note, so that two runs' rows never mix."""
    for name in RUN_FILES:
        if os.path.isfile(os.path.join(out_dir, name + ".tmp")):
            os.remove(os.path.join(out_dir, name + ".tmp"))
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if fresh and os.path.isfile(metrics_path):
        rows, _ = metric_rows(metrics_path)
        os.replace(metrics_path, metrics_path + ".failed")
        print(
            f"note: {metrics_path} held {len(rows)} row(s) of a run that stopped before its first "
            f"checkpoint; moved to {metrics_path}.failed, this run starts afresh"
        )


@contextlib.contextmanager
def write_or_exit(path=None):
    """Writes to a run folder: one that fails (disk full, read-only storage) ends in one line
    (SystemExit "error: ...", write_failed) naming the folder; the last good file stays."""
    try:
        yield
    except WriteFailed as error:
        raise SystemExit(f"error: {error}") from None
    except OSError as error:
        raise SystemExit(f"error: {write_failed(error.filename or path, error)}") from None
