"""
Files on disk and on the Hugging Face Hub: this checkout's root, a Hub file from the local cache or
downloaded, JSON and safetensors files checked whole before anything loads them, and a run folder:
written atomically (a full disk or read-only storage ends in one line that keeps the last good
file), held by one writer at a time, and its metrics.jsonl read back whatever a kill left of it.
"""

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import sys

# this checkout's root: the shipped miniatures, reward models and prompt sets are found from it
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hub_file(repo, filename, missing, repo_type=None):
    """A file of a hub repository from the local cache, else downloaded; ValueError(`missing` +
    why) at once when neither works (one metadata request, not hf_hub_download's five retries)."""
    import huggingface_hub as hub

    try:
        cached = hub.try_to_load_from_cache(repo, filename, repo_type=repo_type)
    except ValueError:  # not a repository id at all: a local path that does not exist, say
        raise ValueError(f"{missing} (no such folder, and not a hub repository id)") from None
    if isinstance(cached, str):
        return cached
    try:
        hub.get_hf_file_metadata(hub.hf_hub_url(repo, filename, repo_type=repo_type))
        return hub.hf_hub_download(repo, filename, repo_type=repo_type)
    except Exception as error:  # offline, unreachable, gated, missing: all mean "not available"
        if os.path.isdir(repo.split("/")[0]):  # more likely a local path with a typo than a hub id
            raise ValueError(f"{missing} (no such folder: {os.path.abspath(repo)})") from None
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
    """ValueError in one line unless `path` is a whole safetensors file, as safetensors opens it
    (reads the header only: cheap for a model of any size)."""
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
    space the write needs."""
    folder = os.path.dirname(os.path.abspath(path))
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(folder).free
        size = "more free space"
        if needed:
            size = f"{needed / 2**20:.1f} MiB free" if needed >= 2**20 else f"{needed:,} bytes"
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


def write_bytes_atomic(path, data, then=None):
    """Written to <path>.tmp, then renamed: a kill never leaves a torn file. A failed write removes
    the temporary file, keeps the earlier file and raises WriteFailed (write_failed; `then`: what to
    do once space is freed)."""
    try:
        with open(path + ".tmp", "wb") as file:
            file.write(data)
        os.replace(path + ".tmp", path)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise write_failed(path, error, len(data), then) from None


def write_lines_atomic(path, lines, then=None):
    write_bytes_atomic(path, "".join(lines).encode(), then)


def write_json_atomic(path, data, then=None):
    write_lines_atomic(path, [json.dumps(data)], then)


@contextlib.contextmanager
def write_or_exit(path=None):
    """A write to a run folder that fails (write_failed) ends in one line: SystemExit "error: "."""
    try:
        yield
    except WriteFailed as error:
        raise SystemExit(f"error: {error}") from None
    except OSError as error:
        raise SystemExit(f"error: {write_failed(error.filename or path, error)}") from None


def check_writable(folder, flag="--out-dir"):
    """ValueError unless `folder` is, or can be made, a folder this user writes to (creates
    nothing: the nearest existing ancestor is checked)."""
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


# -----------------------------------------------------------------------------
def interrupt_quietly(program):
    """Ctrl-C while a program's libraries import (torch and diffusers take seconds): one line and
    exit 130 at once, not a traceback from an import cut halfway. Nothing is written yet. The
    program sets signal.default_int_handler back before its main() (run_quietly does)."""

    def interrupted(*_):
        os.write(2, f"{program}: interrupted while starting: nothing was written\n".encode())
        os._exit(130)

    signal.signal(signal.SIGINT, interrupted)


def run_quietly(program, main, kept):
    """main() with Ctrl-C a KeyboardInterrupt again; one that reaches here ends in one line,
    `<program>: interrupted: <kept>`, and exit 130, as a shell."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout.reconfigure(errors="backslashreplace")  # the tables' "±" on any terminal
    try:
        main()
    except KeyboardInterrupt:
        print(f"{program}: interrupted: {kept}", file=sys.stderr)
        sys.exit(130)


# a run folder: one writer, our marker, what a kill left

# The marker of an output folder: the program that took it. A program writes, replaces or deletes
# only the files it writes, and only in a folder whose marker names it.
MARKER = "written-by.json"
# what train.py writes into a run folder
RUN_FILES = "ckpt.pt metrics.jsonl eval.json train.png policy snapshots tensorboard wandb".split()


def lock_run(out_dir):
    """One writer per run folder: a flock on out_dir/run.lock, released however the process ends;
    ValueError naming the holder's PID if taken. Returns the open lock file: keep it referenced."""
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
    handle.truncate(0)
    print(os.getpid(), file=handle, flush=True)
    return handle


def claim_folder(out_dir, program, outputs, then="run the same command again"):
    """Take out_dir for `program` before anything reads its state: the lock, then the marker. A
    folder without our marker is taken only if it holds none of `outputs`, nor a <name>.tmp of one,
    nor a run.lock that no run wrote (a user's files are never overwritten); else ValueError, the
    folder left as it was. A failed write is a WriteFailed (`then`: what to do once it can
    succeed). Returns the claim for `release`."""
    top = os.path.abspath(out_dir)  # the outermost folder this call will make, if any
    while not os.path.exists(os.path.dirname(top)):
        top = os.path.dirname(top)
    lock_path, marker = os.path.join(out_dir, "run.lock"), os.path.join(out_dir, MARKER)
    ours = os.path.isfile(marker)
    if os.path.isdir(lock_path) or not (ours or lock_left_by_a_run(lock_path)):
        raise ValueError(
            f"--out-dir {out_dir} holds run.lock, which no run of {program} wrote (there is no "
            f"{MARKER}); pass another --out-dir, or move it away"
        )
    added = [path for path in (lock_path, marker) if not os.path.exists(path)]
    if not os.path.exists(top):
        added = [top]
    try:
        claim = (lock_run(out_dir), out_dir, added)
    except OSError as error:
        raise write_failed(lock_path, error, then=then) from None
    try:
        if ours:
            owner = read_json(marker, "move it away, or pass another --out-dir")
            held = owner.get("program") if isinstance(owner, dict) else None
            if held != program:
                raise ValueError(
                    f"--out-dir {out_dir} holds the outputs of {held}, not of {program} "
                    f"({MARKER}); pass another --out-dir"
                )
            return claim
        names = [*outputs, *(name + ".tmp" for name in outputs)]
        clash = [name for name in names if os.path.lexists(os.path.join(out_dir, name))]
        if clash:
            raise ValueError(
                f"--out-dir {out_dir} holds {', '.join(clash)}, which no run of {program} wrote "
                f"(there is no {MARKER}); pass another --out-dir, or move them away"
            )
        write_json_atomic(marker, dict(program=program), then=then)
        return claim
    except (ValueError, OSError):
        release(claim)
        raise


def lock_left_by_a_run(path):
    """Whether a run.lock is absent, empty or holds a PID alone (a run killed before its marker
    was written): anything else is a user's file of that name."""
    if not os.path.lexists(path):
        return True
    with open(path, errors="replace") as file:
        content = file.read(64).strip()
    return content == "" or content.isdigit()


def release(claim):
    """Let go of a folder whose start was refused: the lock closed, what the claim added removed."""
    lock, _, added = claim
    lock.close()
    for path in added:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.isfile(path):
            os.remove(path)


def metric_rows(path):
    """The rows of metrics.jsonl and how many lines were torn (a kill during an append, or damage):
    those are skipped, as every checkpoint carries the rows up to its iteration."""
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
    """Ready a claimed run folder: remove what a write of ours cut short (<name>.tmp); a fresh run
    finding a metrics.jsonl (of a run that failed before its first checkpoint) moves it to
    metrics.jsonl.failed, with a note, so that two runs' rows never mix."""
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
