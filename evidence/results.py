"""
docs/RESULTS.md, the project's evidence: every table in it is written there by the command that
measured it, under that command and the commit it ran at, so no table is copied by hand and a
rerun replaces its own section only.

    from evidence.results import commit, one_line_errors, record

    with one_line_errors():  # a user's mistake ends in one line, not a traceback
        started = commit()  # the code that runs, should files change before the command ends
        table_lines = measure()
        record("guidance", "python -m evidence.miniatures --guidance-sweep", table_lines, started)

The evidence scripts train with `run_training(out_dir, arguments)`: train.py in a worker process
(which imports torch and the models once for all its runs), read back when finished, continued
when killed (with "--snapshots", the policy at the start and at each checkpoint is kept in
<out_dir>-snapshots/); `heldout_mean(report)` reads a row of its eval.json and
`interval(values, digits)` writes a mean over seeds with its 95% interval. A study's folder passes
`this_commit_only(out_dir)` first: a user's folder is refused, never removed.
"""

import contextlib
import glob
import json
import multiprocessing
import os
import shutil
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from evaluate import mean_ci, one_line_errors  # noqa: F401  (the studies' handler)

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPOSITORY, "docs", "RESULTS.md")
HEADER = [
    "# Results",
    "",
    "Every section below is written by the command above it, at the commit it names; rerun the "
    "command to regenerate it. Nothing here is edited by hand.",
]


UNKNOWN = "unknown"  # commit() without git
# the key of this process's runs where commit() is unknown: no other process's run is trusted
THIS_PROCESS_ONLY = f"{UNKNOWN}, process {os.getpid()} started {time.time():.6f}"


def commit(repository=REPOSITORY):
    """The code that runs: the last commit that changed a file outside docs/ that is not markdown
    (12 hex digits), marked " with uncommitted changes" where the working tree's code differs from
    it; 'unknown' without git (a copy without .git, or no git installed). The caches of runs are
    keyed by it (cache_key), so that committing evidence (a section of docs/RESULTS.md, a figure,
    README's summary) keeps the runs the next study reads. A section of docs/RESULTS.md names it as
    the commit it ran at: it is the code that computed every number in the section, runs read from
    the cache included, and checking it out reproduces them; HEAD may be a later commit of docs
    alone that computed none of them."""

    def git(*args):
        try:
            done = subprocess.run(["git", *args], cwd=repository, capture_output=True, text=True)
        except OSError:  # no git installed
            return ""
        return done.stdout.strip()

    if not os.path.exists(os.path.join(repository, ".git")):  # a copy: not the git around it
        return UNKNOWN
    # the evidence the commands write (docs/) and the prose about it (markdown) are not the code
    code_files = ("--", ".", ":!docs", ":!*.md")
    code = git("log", "-1", "--format=%H", *code_files)[:12]
    dirty = git("status", "--porcelain", "--untracked-files=no", *code_files)
    return (code + (" with uncommitted changes" if dirty else "")) if code else UNKNOWN


def cache_key():
    """What the stamps of a study's folder and runs hold: commit(), or where that is unknown a key
    of this process alone (what ran here is read again here; a cache keyed 'unknown' is never
    trusted by another run of a command)."""
    version = commit()
    return THIS_PROCESS_ONLY if version == UNKNOWN else version


def sections(text):
    """The sections of docs/RESULTS.md in order: name -> its lines between the markers."""
    found, name = {}, None
    for line in text.splitlines():
        if line.startswith("<!-- section: "):
            name = line[len("<!-- section: ") : -len(" -->")]
            found[name] = []
        elif line.startswith("<!-- end: "):
            name = None
        elif name is not None:
            found[name].append(line)
    return found


def record(name, command, lines, at=None, path=RESULTS):
    """Write the section `name` of docs/RESULTS.md, in place of its last version or else at the
    end: its command, the commit it ran at (`at`, taken when the command started; default: now),
    `lines` and how it ran. `python -m evidence.stale --write` then sets a new section under its
    heading and writes the claims table from the sections."""
    at = at or commit()
    start, end = f"<!-- section: {name} -->", f"<!-- end: {name} -->"
    body = ["", f"`{command}`", "", f"at commit {at}", "", *lines, "", runs_line(at), ""]
    block = "\n".join([start, *body, end])
    text = open(path).read() if os.path.exists(path) else "\n".join(HEADER) + "\n"
    if start in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_lines_atomic(path, [text])


def write_lines_atomic(path, lines):
    """Written whole or not at all: a kill never leaves a torn cache for the next run to read."""
    with open(path + ".tmp", "w") as file:
        file.writelines(lines)
    os.replace(path + ".tmp", path)


def write_json_atomic(path, data):
    write_lines_atomic(path, [json.dumps(data)])


def train_here(out_dir, arguments):
    """`python train.py --out-dir out_dir *arguments` in this process (a worker of run_training's
    pool), its output in <out_dir>.log; "--snapshots" keeps the policy at each checkpoint,
    "--without-realism" leaves a miniature's realism measure out of eval.json."""
    import train

    def snapshot(policy, iteration):  # what evaluate.load_policy reads
        state = dict(policy=policy.state_dict(), policy_config=policy.config, config=vars(config))
        os.makedirs(out_dir + "-snapshots", exist_ok=True)
        torch.save(dict(state, iteration=iteration), f"{out_dir}-snapshots/policy-{iteration}.pt")

    keep, realism = "--snapshots" in arguments, "--without-realism" not in arguments
    arguments = [a for a in arguments if a not in ("--snapshots", "--without-realism")]
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    with open(out_dir + ".log", "a") as log:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                config = train.parse_config(["--out-dir", out_dir, *arguments])
                train.main(config, snapshot if keep else None, loaded(config), realism)
            except SystemExit as stop:  # train.py's one-line refusal: of the values it was given
                refusal = str(stop).removeprefix("error: ")
                raise ValueError(f"train.py {' '.join(arguments)}: {refusal}") from None


LOADED = {}  # this worker's backbones and rewards, built once for all its runs


def loaded(config):
    """(backbone, reward) of a training configuration, built at this worker's first run that asks
    for them; one per prompt set, as a backbone keeps its set's encodings (keep_encoded)."""
    import backbones
    import rewards

    names = ("backbone", "model_path", "resolution", "guidance", "dtype", "reward", "device")
    names += ("reward_checkpoint", "prompts", "eval_prompts")
    key = tuple(getattr(config, name) for name in names)
    if key not in LOADED:
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        backbone = backbones.trained_backbone(vars(config), device)
        reward = rewards.load_reward(config.reward, backbone, device, config.reward_checkpoint)
        LOADED[key] = backbone, reward
    return LOADED[key]


STARTED = time.time()  # the command's start: this module is imported before any study's work
WORKERS = None  # run_training's processes, started once: each imports torch and the models once
RUNS = dict(trained=0, read=0)  # this process's runs: trained here, or read from this code's


def runs_line(started):
    """What a section says of how it ran: its time since the command started, the cores and the
    training runs it ran or read."""
    minutes, runs = (time.time() - STARTED) / 60, RUNS["trained"] + RUNS["read"]
    return (f"Ran at {started} in {minutes:.0f} min on {os.cpu_count()} cores: "
            f"{RUNS['trained']} of its {runs} trainings run here, "
            f"{RUNS['read']} read from runs this code finished before.")  # fmt: skip


def this_commit_only(out_dir):
    """The door of a study's folder: it starts absent or empty, or stamped by a study
    (<out_dir>/commit.txt, or the <run>.commit of a run of run_training's below it). Any other
    folder holds a user's files: it is refused in one line, never removed. In a stamped folder what
    other code computed (by the key that stamp holds, cache_key) is removed before the study
    starts."""
    stamp, version = os.path.join(out_dir, "commit.txt"), cache_key()
    if os.path.isfile(stamp) and open(stamp).read() == version:
        return
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.isfile(stamp):
        # a run's stamp lies at most two folders down: <out_dir>/<backbone>/<row>/<run>.commit
        runs = (glob.glob(os.path.join(out_dir, *["*"] * depth, "*.commit")) for depth in range(3))
        if not any(runs):
            refusal = f"--out-dir {out_dir} holds files the study did not write; pass another"
            raise SystemExit(f"error: {refusal}")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    with open(stamp, "w") as file:
        file.write(version)


def run_training(out_dir, arguments):
    """`python train.py --out-dir out_dir *arguments` in a worker process of its own (one CPU
    thread; its output in <out_dir>.log). <out_dir>.commit names the code that started it
    (cache_key): of the same code a killed run continues from its checkpoint and a finished one
    (eval.json) is read, not rerun; a run of other code starts afresh. Callers run several at once
    from threads. Returns its eval.json and the rows of its metrics.jsonl."""
    global WORKERS
    stamp, version = out_dir + ".commit", cache_key()
    if not os.path.isfile(stamp) or open(stamp).read() != version:  # none, or of other code
        for folder in (out_dir, out_dir + "-snapshots"):
            shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        with open(stamp, "w") as file:
            file.write(version)
    if os.path.isfile(os.path.join(out_dir, "eval.json")):
        RUNS["read"] += 1
    else:
        if WORKERS is None:  # spawned, not forked: nothing of this process's state is copied
            context = multiprocessing.get_context("spawn")
            WORKERS = ProcessPoolExecutor(os.cpu_count(), mp_context=context)
        WORKERS.submit(train_here, out_dir, arguments).result()
        RUNS["trained"] += 1
    with open(os.path.join(out_dir, "eval.json")) as file:
        report = json.load(file)
    with open(os.path.join(out_dir, "metrics.jsonl")) as file:
        rows = [json.loads(line) for line in file]
    return report, rows


def heldout_mean(report, method="learned (mean)"):
    """The mean held-out reward of one row (method) of a run's eval.json."""
    return {row["method"]: row for row in report["rows"]}[method]["mean"]


def interval(values, digits=3):
    """'mean ± half-width' of the values (a list, one per seed, or a 1-D tensor), the 95% Student-t
    interval."""
    mean, half = mean_ci(torch.as_tensor(values, dtype=torch.float64))
    return f"{mean:.{digits}f} ± {half:.{digits}f}"
