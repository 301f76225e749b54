"""Bad input and faults as a new user meets them. Each case of CASES runs a script (or a few lines
of Python) in a fresh process (a child of conftest.SCRIPTS), after an optional fault: a damaged
file, a full disk, read-only storage. It must end in one line that says what is wrong and what to
do, and leave no folder empty. A new probe is one more line of CASES. Every case fails before a
model loads, except the prompt-window one (it loads the 16x16 mini-sd3 to count tokens)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ENV, ROOT, SCRIPTS, train_in_process

import sample
import train
from scoring import figures

# a finished digits run, small enough to build in seconds
RUN_ARGS = ["--iterations", "2", "--contexts", "8", "--eval-contexts", "4", "--ckpt-interval", "1"]

# -----------------------------------------------------------------------------
# faults: code run in the subprocess before the script
NONE = ""


def full_disk(name, after=0):
    """Writing a file called `name` fails with ENOSPC halfway, from its (after + 1)-th opening on
    (the earlier ones succeed): a disk that fills up during a run."""
    return f"""
import builtins, errno
_open, _opened = builtins.open, []
class _Full:
    def __init__(self, handle): self.handle = handle
    def write(self, data):
        self.handle.write(data[: len(data) // 2]); self.handle.flush()
        raise OSError(errno.ENOSPC, "No space left on device")
    def __enter__(self): return self
    def __exit__(self, *exc): self.handle.close()
    def __getattr__(self, name): return getattr(self.handle, name)
def _full(file, mode="r", *args, **kwargs):
    handle = _open(file, mode, *args, **kwargs)
    if os.path.basename(str(file)) == {name!r} and ("w" in mode or "a" in mode):
        _opened.append(file)
        if len(_opened) > {after}:
            return _Full(handle)
    return handle
builtins.open = _full
"""


def read_only(fragment):
    """Every path containing `fragment` is on read-only storage (the tests run as root, for whom
    permission bits do not hold): os.access says so, writes and mkdir fail with EROFS."""
    return f"""
import builtins, errno
_access, _open, _mkdir = os.access, builtins.open, os.mkdir
def _ro(path): return {fragment!r} in os.path.abspath(str(path))
def _refuse(path): raise OSError(errno.EROFS, "Read-only file system", str(path))
def _access_ro(path, mode, **kwargs):
    return False if _ro(path) and mode & os.W_OK else _access(path, mode, **kwargs)
def _open_ro(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, os.PathLike)) and _ro(file) and any(c in mode for c in "wax+"):
        _refuse(file)
    return _open(file, mode, *args, **kwargs)
os.access, builtins.open = _access_ro, _open_ro
os.mkdir = lambda path, *a, **k: _refuse(path) if _ro(path) else _mkdir(path, *a, **k)
"""


# the shipped miniatures are looked for under the case's folder (damaged copies)
MINIATURES_HERE = "import backbones; backbones.REPOSITORY = os.getcwd()"


# -----------------------------------------------------------------------------
# damage: functions (case folder, finished run) -> None, run before the command
def miniature_copy(damage, where="m"):
    """A copy of the shipped mini-sd3 in the case folder (at `where`), then damage(copy)."""

    def make(tmp, run):
        copy = tmp / where
        shutil.copytree(os.path.join(ROOT, "miniatures", "mini-sd3"), copy)
        damage(copy)

    return make


def truncate(path):
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)


def randomise(path):
    path.write_bytes(torch.randint(256, (5000,), dtype=torch.uint8).numpy().tobytes())


TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"


def policy_copy(damage):
    def make(tmp, run):
        shutil.copytree(run / "policy", tmp / "policy")
        damage(tmp / "policy")

    return make


def reward_model_copy(kind, damage):
    """A copy of the shipped miniatures/<kind> (classifier, preference), damaged."""

    def make(tmp, run):
        shutil.copytree(os.path.join(ROOT, "miniatures", kind), tmp / kind)
        damage(tmp / kind)

    return make


def write(name, text):
    def make(tmp, run):
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)

    return make


def evaluate_wrote(text):
    """A scores.json in a folder evaluate.py took (its marker beside it)."""

    def make(tmp, run):
        write("eval/written-by.json", '{"program": "evaluate.py"}')(tmp, run)
        write("eval/scores.json", text)(tmp, run)

    return make


def saved(name, value):
    return lambda tmp, run: torch.save(value, tmp / name)


def run_copy(damage=lambda out: None):
    def make(tmp, run):
        shutil.copytree(run, tmp / "run")
        damage(tmp / "run")

    return make


def edited_config(**fields):
    """A policy folder whose config.json was edited by hand: `fields` set at its top level."""

    def edit(policy):
        config = json.loads((policy / "config.json").read_text())
        (policy / "config.json").write_text(json.dumps({**config, **fields}))

    return policy_copy(edit)


def drop_a_tensor(policy):
    """A policy folder whose model.safetensors lost one tensor (a whole file, one key short)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(policy / "model.safetensors")
    weights.pop(sorted(weights)[-1])
    save_file(weights, policy / "model.safetensors")


def unknown_backbone(policy):
    """A policy folder whose config.json names, consistently, a backbone this project has not."""
    config = json.loads((policy / "config.json").read_text())
    config["backbone"] = config["training_config"]["backbone"] = "sd4"
    (policy / "config.json").write_text(json.dumps(config))


def users_files(tmp, run):
    """A folder a user keeps files in that a run would write: no run of train.py took it."""
    (tmp / "out" / "policy").mkdir(parents=True)
    (tmp / "out" / "train.png").write_bytes(b"a user's figure")
    (tmp / "out" / "metrics.jsonl").write_text('{"note": "a user\'s log"}\n')
    (tmp / "out" / "policy" / "README.md").write_text("a user's notes\n")


BOM = "\ufeff"


def nothing(tmp, run):
    pass


def garbled_metrics(out):
    """An unfinished run (no eval.json) whose metrics.jsonl is random bytes."""
    (out / "eval.json").unlink()
    randomise(out / "metrics.jsonl")


MINI = ["train.py", "--backbone", "mini-sd3", "--out-dir", "{tmp}/out"]
GENERATE = (
    "import torch; from backbones import pipeline; from store.checkpoint import load_policy; "
    "policy = load_policy('{run}/policy'); "
)
MINI_POLICY = (
    "import torch; from backbones import pipeline; from store.checkpoint import make_policy; "
    "policy = make_policy('instance', dict(latent_channels=16, text_dim=32, "
    "pooled_dim=64), 3, backbone='mini-sd3'); "
)
LONG = "an image of a handwritten digit drawn slowly with a thick black marker, the digit 7\n"

# (id, damage, fault, command, expected): the one line the command ends in (stderr), or, for a
# command that must work, what it prints (stdout). {tmp}: the case's folder (the working
# directory), {run}: a finished digits run (RUN_ARGS), {root}: this repository.
CASES = [
    # 1. damaged or wrong model files
    (
        "model-path-truncated",
        miniature_copy(lambda m: truncate(m / TRANSFORMER)),
        NONE,
        [*MINI, "--model-path", "{tmp}/m"],
        r"m/transformer/diffusion_pytorch_model.safetensors is (truncated|damaged).*download the "
        "model again, or pass another --model-path",
    ),
    (
        "model-path-random",
        miniature_copy(lambda m: randomise(m / "vae/diffusion_pytorch_model.safetensors")),
        NONE,
        [*MINI, "--model-path", "{tmp}/m"],
        r"vae/diffusion_pytorch_model.safetensors is damaged or truncated",
    ),
    (
        "model-path-no-vae-config",
        miniature_copy(lambda m: (m / "vae/config.json").unlink()),
        NONE,
        [*MINI, "--model-path", "{tmp}/m"],
        r"m/vae/config.json is missing",
    ),
    (
        "model-path-bad-json",
        miniature_copy(lambda m: (m / "transformer/config.json").write_text("{")),
        NONE,
        [*MINI, "--model-path", "{tmp}/m"],
        r"transformer/config.json is damaged \(not JSON",
    ),
    (
        "model-path-no-vocabulary",
        miniature_copy(lambda m: (m / "tokenizer_3/tokenizer.json").unlink()),
        NONE,
        [*MINI, "--model-path", "{tmp}/m"],
        r"m/tokenizer_3 has no vocabulary \(T5Tokenizer\)",
    ),
    (
        "model-path-weights-of-other-shapes",
        miniature_copy(lambda m: (m / "transformer/config.json").write_text('{"in_channels": 3}')),
        NONE,
        [*MINI, "--model-path", "{tmp}/m"],
        r"mini-sd3: .*/m does not load \(.*expected shape.*\); pass the folder of a mini-sd3 model",
    ),
    (
        "model-path-of-another-family",
        nothing,
        NONE,
        [*MINI, "--model-path", "{root}/miniatures/mini-sdxl"],
        "holds a StableDiffusionXLPipeline, not the StableDiffusion3Pipeline that mini-sd3 runs",
    ),
    (
        "miniature-truncated",
        miniature_copy(lambda m: truncate(m / TRANSFORMER), "miniatures/mini-sd3"),
        MINIATURES_HERE,
        MINI,
        r"is (truncated|damaged).*git checkout miniatures/mini-sd3.*python -m miniatures.build "
        "--family sd3",
    ),
    (
        "classifier-truncated",
        reward_model_copy("classifier", lambda folder: truncate(folder / "model.safetensors")),
        NONE,
        [*MINI, "--reward", "digit", "--reward-checkpoint", "{tmp}/classifier"],
        r"classifier/model.safetensors is (truncated|damaged).*python -m miniatures.build "
        "--family classifier",
    ),
    (
        "preference-scorer-truncated",
        reward_model_copy("preference", lambda folder: truncate(folder / "model.safetensors")),
        NONE,
        [*MINI, "--reward-checkpoint", "{tmp}/preference"],
        r"preference/model.safetensors is (truncated|damaged).*python -m miniatures.build "
        "--family preference",
    ),
    (
        "policy-truncated-evaluate",
        policy_copy(lambda folder: truncate(folder / "model.safetensors")),
        NONE,
        ["evaluate.py", "--ckpt", "{tmp}/policy"],
        r"policy/model.safetensors is (truncated|damaged).*train again",
    ),
    (
        "policy-config-damaged-sample",
        policy_copy(lambda folder: (folder / "config.json").write_text("{")),
        NONE,
        ["sample.py", "--ckpt", "{tmp}/policy"],
        r"policy/config.json is damaged \(not JSON",
    ),
    (
        "checkpoint-truncated",
        run_copy(lambda out: truncate(out / "ckpt.pt")),
        NONE,
        ["evaluate.py", "--ckpt", "{tmp}/run/ckpt.pt"],
        "run/ckpt.pt is not a readable checkpoint",
    ),
    (
        "eval-json-damaged",
        run_copy(lambda out: (out / "eval.json").write_text("{")),
        NONE,
        ["train.py", *RUN_ARGS, "--out-dir", "{tmp}/run"],
        r"run/eval.json is damaged \(not JSON.*delete it and run the same command again",
    ),
    (
        "metrics-garbled-resumes",
        run_copy(garbled_metrics),
        NONE,
        ["train.py", *RUN_ARGS, "--out-dir", "{tmp}/run"],
        "continuing .*run/ckpt.pt from iteration 2",
    ),
    # 2. a full disk during a checkpoint (the rerun: test_a_full_disk_at_a_checkpoint_...)
    (
        "disk-full-checkpoint",
        nothing,
        full_disk("ckpt.pt.tmp", after=1),
        ["train.py", *RUN_ARGS, "--out-dir", "{tmp}/out"],
        r"could not write .*out/ckpt.pt: the disk is full \(.* MiB free in .*out, the write "
        r"needs .* MiB free\); free some space and run the same command again",
    ),
    (
        "disk-full-metrics",
        nothing,
        full_disk("metrics.jsonl"),
        ["train.py", *RUN_ARGS, "--out-dir", "{tmp}/out"],
        r"could not write .*metrics.jsonl: the disk is full",
    ),
    (
        "disk-full-scores",
        nothing,
        full_disk("scores.json.tmp"),
        ["evaluate.py", "--ckpt", "{run}/ckpt.pt", "--out-dir", "{tmp}/eval", "--limit", "2"],
        r"could not write .*eval/scores.json: the disk is full",
    ),
    # 3. read-only storage
    (
        "read-only-out-dir",
        write("ro/note.txt", "x"),
        read_only("/ro"),
        ["train.py", *RUN_ARGS, "--out-dir", "{tmp}/ro"],
        "--out-dir .*/ro is a folder this user cannot write",
    ),
    (
        "read-only-finished-run-is-reported",
        run_copy(),
        read_only("/run"),
        ["train.py", *RUN_ARGS, "--out-dir", "{tmp}/run"],
        "holds this run, finished at iteration 2",
    ),
    (
        "read-only-run-evaluated",
        run_copy(),
        read_only("/run"),
        ["evaluate.py", "--ckpt", "{tmp}/run/ckpt.pt"],
        r"--out-dir .*/run/eval is not writable here \(.*/run is read-only for this user\)",
    ),
    # 4. sample.py checks its inputs before loading, and leaves no empty folder
    (
        "sample-out-dir-file",
        write("file", "x"),
        NONE,
        ["sample.py", "--ckpt", "{run}/ckpt.pt", "--out-dir", "{tmp}/file"],
        "--out-dir .*/file is a file, not a folder",
    ),
    (
        "sample-batch-size-0",
        nothing,
        NONE,
        ["sample.py", "--ckpt", "{run}/ckpt.pt", "--batch-size", "0"],
        r"--batch-size must be at least 1 \(got 0\)",
    ),
    (
        "sample-draw-seed-1e23",
        nothing,
        NONE,
        ["sample.py", "--ckpt", "{run}/ckpt.pt", "--draw-seed", str(10**23)],
        "a seed is an integer from 0 to 2",
    ),
    (
        "sample-device-foo",
        nothing,
        NONE,
        ["sample.py", "--ckpt", "{run}/ckpt.pt", "--device", "foo"],
        "--device 'foo' is not a device: pass cpu, cuda or cuda:N",
    ),
    (
        "sample-read-only-out-dir",
        write("ro/note.txt", "x"),
        read_only("/ro"),
        ["sample.py", "--ckpt", "{run}/ckpt.pt", "--out-dir", "{tmp}/ro"],
        "--out-dir .*/ro is a folder this user cannot write",
    ),
    (
        "sample-pipeline-on-digits",
        nothing,
        NONE,
        ["sample.py", "--ckpt", "{run}/ckpt.pt", "--pipeline", "--out-dir", "{tmp}/s"],
        "--pipeline needs a diffusers backbone, not 'digits'",
    ),
    # 6. evaluate.py
    (
        "evaluate-pt-holding-5",
        saved("five.pt", 5),
        NONE,
        ["evaluate.py", "--ckpt", "{tmp}/five.pt"],
        r"five.pt is not a checkpoint written by train.py \(a int\)",
    ),
    (
        "evaluate-pt-of-other-keys",
        saved("other.pt", {"weights": 1, 2: 3}),
        NONE,
        ["evaluate.py", "--ckpt", "{tmp}/other.pt"],
        r"other.pt is not a checkpoint written by train.py \(its keys: \['2', 'weights'\]\)",
    ),
    (
        "evaluate-scores-list",
        evaluate_wrote("[]"),
        NONE,
        ["evaluate.py", "--ckpt", "{run}/ckpt.pt", "--out-dir", "{tmp}/eval"],
        "eval/scores.json is not a scores.json of evaluate.py; move it away",
    ),
    (
        "evaluate-scores-without-parts",
        evaluate_wrote('{"contexts": []}'),
        NONE,
        ["evaluate.py", "--ckpt", "{run}/ckpt.pt", "--out-dir", "{tmp}/eval"],
        "eval/scores.json is not a scores.json of evaluate.py; move it away",
    ),
    (
        "evaluate-device-foo",
        nothing,
        NONE,
        ["evaluate.py", "--ckpt", "{run}/ckpt.pt", "--device", "foo"],
        "--device 'foo' is not a device",
    ),
    (
        "evaluate-digit-reward-on-digits",
        nothing,
        NONE,
        ["evaluate.py", "--ckpt", "{run}/ckpt.pt", "--rewards", "digit"],
        "the digit reward reads the 16x16 handwritten digits that only the mini-\\* backbones",
    ),
    # 7. pipeline.generate refuses before it touches the pipeline
    (
        "generate-digits-policy",
        nothing,
        NONE,
        ["-c", GENERATE + "pipeline.generate(None, policy, 'a handwritten 3')"],
        "trained on the embedded digits backbone, which no diffusers pipeline runs",
    ),
    (
        "generate-prompt-none",
        nothing,
        NONE,
        ["-c", MINI_POLICY + "pipeline.generate(None, policy, None)"],
        "prompt takes a string or a non-empty list of strings, got None",
    ),
    (
        "generate-prompt-empty",
        nothing,
        NONE,
        ["-c", MINI_POLICY + "pipeline.generate(None, policy, [])"],
        r"prompt takes a string or a non-empty list of strings, got \[\]",
    ),
    (
        "generate-no-images",
        nothing,
        NONE,
        ["-c", MINI_POLICY + "pipeline.generate(None, policy, 'a 3', num_images_per_prompt=0)"],
        "num_images_per_prompt must be at least 1, got 0",
    ),
    # 8. train.py
    (
        "train-seed-huge",
        nothing,
        NONE,
        ["train.py", "--seed", "99999999999999999999999", "--out-dir", "{tmp}/out"],
        "--seed must be an integer from 0 to",
    ),
    ("train-out-dir-empty", nothing, NONE, ["train.py", "--out-dir", ""], "--out-dir is empty"),
    # 9. a prompt longer than the text encoders' window, where the reward reads the cut words
    (
        "prompt-longer-than-the-window",
        write("long.txt", LONG),
        NONE,
        [*MINI, "--prompts", "{tmp}/long.txt"],
        r"1 prompt\(s\) are longer than the text encoders' window.*the preference reward scores "
        "the words that are cut",
    ),
    # 10. another run in the default folder of another command: its own folder instead
    (
        "another-run-in-the-folder",
        run_copy(),
        NONE,
        ["train.py", *RUN_ARGS, "--seed", "1", "--out-dir", "{tmp}/run", "--resume"],
        r"holds a run with seed=0, not 1; pass another --out-dir for this run \(or --seed 0",
    ),
    # 11. what a new user still hit: hand-edited policy folders, a foreign --out-dir, a run folder
    # given as --ckpt, prompt files with a byte-order mark or a folder, missing files named, seeds
    (
        "policy-config-kind-edited",
        edited_config(kind="tpdm"),
        NONE,
        ["sample.py", "--ckpt", "{tmp}/policy"],
        r'policy/config.json: "kind" is \'tpdm\', not a policy kind \(instance, global, stepwise\)',
    ),
    (
        "policy-config-backbone-edited",
        edited_config(backbone="mini-sd3"),
        NONE,
        ["sample.py", "--ckpt", "{tmp}/policy"],
        r'policy/config.json: "backbone" is \'mini-sd3\' but its "training_config" says \'digits\'',
    ),
    (
        "policy-config-unknown-backbone",
        policy_copy(unknown_backbone),
        NONE,
        ["evaluate.py", "--ckpt", "{tmp}/policy"],
        r'policy: "backbone" is \'sd4\', not a backbone here; restore the file',
    ),
    (
        "policy-config-steps-edited",
        edited_config(steps=7),
        NONE,
        ["evaluate.py", "--ckpt", "{tmp}/policy"],
        r'policy/config.json: "steps" is 7 but its "training_config" says 4',
    ),
    (  # a relative path with a typo reads as a hub id user/name: said to be a missing folder
        "policy-path-typo",
        policy_copy(lambda folder: None),
        NONE,
        ["sample.py", "--ckpt", "policy/polcy"],
        r"policy/polcy: no such folder \(.*policy/polcy\)$",
    ),
    (  # the hub mixin's default (strict=False) would leave the missing tensor random
        "policy-weights-missing-a-tensor",
        policy_copy(drop_a_tensor),
        NONE,
        ["sample.py", "--ckpt", "{tmp}/policy"],
        r"policy/config.json does not describe the weights beside it \(.*Missing key",
    ),
    (
        "policy-config-depth-edited",
        edited_config(depth=3),
        NONE,
        ["evaluate.py", "--ckpt", "{tmp}/policy"],
        r"policy/config.json does not describe the weights beside it \(.*Missing key",
    ),
    (
        "policy-config-heads-edited",
        edited_config(heads=3),
        NONE,
        ["evaluate.py", "--ckpt", "{tmp}/policy"],
        r"policy/config.json does not describe the weights beside it \(dim 64 must be a multiple "
        r"of heads 3\)",
    ),
    (
        "policy-config-training-not-a-mapping",
        edited_config(training_config=[1, 2]),
        NONE,
        ["sample.py", "--ckpt", "{tmp}/policy"],
        r'policy/config.json: "training_config" is not a mapping; restore the file',
    ),
    (
        "out-dir-of-a-users-files",
        users_files,
        NONE,
        ["train.py", *RUN_ARGS, "--out-dir", "{tmp}/out"],
        r"--out-dir .*out holds metrics.jsonl, train.png, policy, which no run of train.py wrote",
    ),
    (
        "sample-ckpt-a-run-folder",
        run_copy(),
        NONE,
        ["sample.py", "--ckpt", "{tmp}/run"],
        r"run is a run folder of train.py: pass .*run/policy or .*run/ckpt.pt",
    ),
    (
        "evaluate-ckpt-a-run-folder",
        run_copy(),
        NONE,
        ["evaluate.py", "--ckpt", "{tmp}/run"],
        r"run is a run folder of train.py: pass .*run/policy or .*run/ckpt.pt",
    ),
    (
        "prompts-txt-with-a-byte-order-mark",
        write("bom.txt", BOM + "a handwritten 3\na handwritten 5\n"),
        NONE,
        ["train.py", *RUN_ARGS, "--prompts", "{tmp}/bom.txt", "--out-dir", "{tmp}/out"],
        "wrote .*out/ckpt.pt",
    ),
    (
        "prompts-jsonl-with-a-byte-order-mark",
        write("bom.jsonl", BOM + '{"prompt": "a handwritten 3"}\n'),
        NONE,
        ["train.py", *RUN_ARGS, "--prompts", "{tmp}/bom.jsonl", "--out-dir", "{tmp}/out"],
        "wrote .*out/ckpt.pt",
    ),
    (
        "prompts-a-folder",
        write("prompts/a.txt", "a handwritten 3\n"),
        NONE,
        ["train.py", "--prompts", "{tmp}/prompts", "--out-dir", "{tmp}/out"],
        r"prompt file .*prompts is a folder; pass a .txt, .json or .jsonl file in it",
    ),
    (
        "miniature-no-scheduler-config",
        miniature_copy(
            lambda m: (m / "scheduler/scheduler_config.json").rename(m / "scheduler/old.json")
        ),
        NONE,
        [*MINI, "--model-path", "{tmp}/m"],
        r"m/scheduler/scheduler_config.json is missing",
    ),
    (
        "miniature-no-model-index",
        miniature_copy(lambda m: (m / "model_index.json").unlink(), "miniatures/mini-sd3"),
        MINIATURES_HERE,
        MINI,
        r"mini-sd3: miniatures/mini-sd3/model_index.json is missing from this checkout; restore "
        r"it with `git checkout miniatures/mini-sd3`",
    ),
    (
        "train-seed-negative",
        nothing,
        NONE,
        ["train.py", "--seed", "-1", "--out-dir", "{tmp}/out"],
        r"--seed must be an integer from 0 to 134,217,727 \(got -1\): a training context's noise "
        "seed is built from it",
    ),
    (
        "miniature-eval-contexts-below-the-realism-k",
        nothing,
        NONE,
        [*MINI, "--eval-contexts", "3"],
        r"--eval-contexts must be at least 4 on a miniature \(got 3\): its realism measure",
    ),
    (
        "miniature-resolution-other-than-16",
        nothing,
        NONE,
        [*MINI, "--resolution", "32"],
        r"--resolution 32: mini-sd3 draws 16x16 images .*; drop --resolution",
    ),
    (
        "digits-resolution-ignored",
        nothing,
        NONE,
        ["train.py", "--resolution", "16", "--out-dir", "{tmp}/out"],
        r"--resolution 16: digits draws 8x8 images",
    ),
    # what a new user still hit (a user's files, refusals after the claim, messages)
    (
        "users-run-lock-with-notes",
        lambda tmp, run: [
            write("out/run.lock", "my notes")(tmp, run),
            write("out/eval.json", "mine")(tmp, run),
        ],  # fmt: skip
        NONE,
        ["train.py", *RUN_ARGS, "--out-dir", "{tmp}/out"],
        r"--out-dir .*out holds run.lock, which no run of train.py wrote",
    ),
    (
        "users-folder-named-run-lock",
        write("out/run.lock/notes.txt", "mine"),
        NONE,
        ["train.py", *RUN_ARGS, "--out-dir", "{tmp}/out"],
        r"--out-dir .*out holds run.lock, which no run of train.py wrote",
    ),
    (
        "users-tmp-file-of-an-output",
        write("out/ckpt.pt.tmp", "mine"),
        NONE,
        ["train.py", *RUN_ARGS, "--out-dir", "{tmp}/out"],
        r"--out-dir .*out holds ckpt.pt.tmp, which no run of train.py wrote",
    ),
    (
        "policy-training-config-empty",
        edited_config(training_config={}),
        NONE,
        ["evaluate.py", "--ckpt", "{tmp}/policy", "--out-dir", "{tmp}/ev"],
        r"policy names no training reward; pass --rewards NAME",
    ),
    (
        "mixture-long-prompt-cut",
        write("long.txt", "x" * 5000 + "\n"),
        NONE,
        ["train.py", "--prompts", "{tmp}/long.txt", "--out-dir", "{tmp}/out"],
        r"knows only the prompts .*, got 'x+\.\.\.x+'$",
    ),
    (
        "model-path-typo-on-a-miniature",
        nothing,
        NONE,
        [
            "train.py",
            "--backbone",
            "mini-sd3",
            "--model-path",
            "{tmp}/nowhere",
            "--out-dir",
            "{tmp}/out",
        ],  # fmt: skip
        r"nowhere is not a diffusers folder .* drop --model-path to use the miniature shipped",
    ),
    (
        "policy-path-typo-in-its-first-folder",
        nothing,
        NONE,
        ["sample.py", "--ckpt", "nowhere/policy", "--out-dir", "{tmp}/ev"],
        r"nowhere/policy: no such folder here \(.*nowhere/policy\), nor a policy on the hub",
    ),
    (
        "disk-full-marker-evaluate",
        nothing,
        full_disk("written-by.json.tmp"),
        ["evaluate.py", "--ckpt", "{run}/ckpt.pt", "--out-dir", "{tmp}/ev"],
        r"could not write .*ev/written-by.json: the disk is full \(.*the write needs \d+ bytes\); "
        r"free some space and run the same command again$",
    ),
    (
        "sample-seed-negative",
        nothing,
        NONE,
        ["sample.py", "--seeds", "-1"],
        r"argument --seeds: a seed is an integer from 0 to 2\^63 - 1, got -1",
    ),
]


def run_case(tmp, command, fault):
    return SCRIPTS.run(command, tmp, fault)


def empty_folders(tmp):
    return [path for path, folders, files in os.walk(tmp) if not (folders or files) and path != tmp]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    return train_in_process(tmp_path_factory.mktemp("faults") / "run", *RUN_ARGS)


@pytest.mark.parametrize("name, damage, fault, command, expected", CASES, ids=[c[0] for c in CASES])
def test_a_fault_ends_in_one_line(tmp_path, finished_run, name, damage, fault, command, expected):
    damage(tmp_path, finished_run)
    tmp_path = str(tmp_path)
    values = dict(tmp=tmp_path, run=str(finished_run), root=ROOT)
    command = [part.format(**values) for part in command]
    result = run_case(tmp_path, command, fault.format(**values) if fault else fault)
    if result.returncode == 0:  # a case that works now: what it prints
        assert re_search(expected, result.stdout), result.stdout[-2000:]
        return
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    message = result.stderr.strip().splitlines()[-1]  # after the progress bars, if any
    assert re_search(expected, message), message
    assert not empty_folders(tmp_path), empty_folders(tmp_path)


def re_search(pattern, text):
    import re

    return re.search(pattern, text) is not None


# -----------------------------------------------------------------------------
# what the table cannot say in one line: the rerun after a fault, the files and figures


def read_rows(out):
    return [
        json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


def test_a_full_disk_at_a_checkpoint_keeps_the_last_one_and_the_rerun_continues(tmp_path):
    out = tmp_path / "out"
    command = ["train.py", *RUN_ARGS, "--iterations", "3", "--out-dir", str(out)]
    failed = run_case(tmp_path, command, full_disk("ckpt.pt.tmp", after=1))
    assert failed.returncode == 1 and "the disk is full" in failed.stderr
    assert not (out / "ckpt.pt.tmp").exists()  # the partial file went with the failure
    assert torch.load(out / "ckpt.pt", weights_only=True)["iteration"] == 1
    resumed = run_case(tmp_path, command, NONE)  # space is back
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "continuing" in resumed.stdout and read_rows(out) == [1, 2, 3]
    # exactly the run that had room all along: the same rows and the same policy
    whole = tmp_path / "whole"
    run_case(tmp_path, ["train.py", *RUN_ARGS, "--iterations", "3", "--out-dir", str(whole)], NONE)
    timing = ("rollout_s", "step_s", "clip_fraction")  # clip_fraction: null without PPO

    def rows(folder):
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in lines]

    assert rows(out) == rows(whole)
    final, expected = (torch.load(f / "ckpt.pt", weights_only=True)["policy"] for f in (out, whole))
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=0, atol=0)


def test_a_torn_row_of_the_checkpoint_iteration_is_written_back(finished_run, tmp_path):
    out = shutil.copytree(finished_run, tmp_path / "out")
    text = (out / "metrics.jsonl").read_text()  # the row of iteration 2, the checkpoint's, torn
    (out / "metrics.jsonl").write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])
    train_in_process(out, *RUN_ARGS, "--iterations", "3")
    assert read_rows(out) == [1, 2, 3]


def test_each_command_of_the_readme_has_its_own_default_folder():
    main, miniature = train.parse_config([]), train.parse_config(["--backbone", "mini-sd3"])
    assert main.out_dir == os.path.join("out", "digits-L4-instance-s0")
    assert miniature.out_dir == os.path.join("out", "mini-sd3-L3-instance-s0")
    assert sample.MAIN_RUN == os.path.join(main.out_dir, "ckpt.pt")
    assert train.parse_config(["--out-dir", "mine"]).out_dir == "mine"


def test_the_policy_folder_is_readable_and_its_card_says_what_it_is(finished_run):
    assert os.stat(finished_run / "policy" / "model.safetensors").st_mode & 0o044 == 0o044
    card = (finished_run / "policy" / "README.md").read_text()
    assert "More Information Needed" not in card and "arxiv.org/abs/2511.22177" in card


def test_a_verdict_without_a_gain_claims_none():
    def results(default, learned):
        return {"default": (None, None, None, torch.tensor(default)), "learned": (0, 0, 0, learned)}

    worse = sample.verdict(results([0.0, 0.0], torch.tensor([-1.0, -2.0])), "the digit reward")
    assert "better on 0 of 2 contexts, worse on 2, worse by 1.5000" in worse
    assert "mean gain" not in worse
    mixed = sample.verdict(results([0.0, 0.0], torch.tensor([3.0, -1.0])), "the digit reward")
    assert mixed.endswith("better by 1.0000 on average: a mean gain comes with per-context losses")


def test_figure_labels_keep_the_digit_and_steps_stay_readable(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    label = figures.context_labels(["a very long prompt about how to draw the number 7"], [0])[0]
    assert "7, seed 0" in label and len(label) < 50
    ax = Figure().subplots()
    figures.draw_schedules(ax, torch.rand(2, 1001), torch.linspace(1, 0, 1001))
    assert len(ax.get_xticks()) <= 21
    figure_axes, real = {}, Figure.savefig

    def keep(figure, *args, **kwargs):
        figure_axes["axes"] = figure.axes
        return real(figure, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "savefig", keep)
        figures.plot_results(  # a miniature's accuracy: 1 on every context, for both
            str(tmp_path / "results.png"),
            {"accuracy": {"default": torch.ones(5), "learned": torch.ones(5)}},
            {"learned": torch.linspace(1, 0, 4).expand(5, -1)},
            torch.linspace(1, 0, 4),
        )
    first = figure_axes["axes"][0]
    first.figure.canvas.draw()
    assert first.xaxis.get_offset_text().get_text() == ""


def test_a_prompt_past_the_window_is_refused_where_the_reward_reads_it_else_noted(capsys):
    import backbones

    backbone = backbones.load_backbone("mini-sd3", device="cpu")
    short = "an image of a handwritten 7"
    backbone.check_prompts([short] * 3, "digit")  # within the 12 tokens
    with pytest.raises(ValueError, match="the digit reward scores the words that are cut"):
        backbone.check_prompts([short, LONG.strip()], "digit")
    capsys.readouterr()
    backbone.check_prompts([LONG.strip()] * 3, "teacher")  # the same prompt: one note, one line
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("note: 1 prompt(s) are longer") and "\n" not in printed


# -----------------------------------------------------------------------------
# Ctrl-C: one line saying what was kept and that the same command goes on, exit 130, as a shell

# a KeyboardInterrupt as Ctrl-C raises it: after train.py's first checkpoint, in the middle of
# evaluate.py's scoring (after `batches` batches) or of sample.py's sampling
CTRL_C_AFTER_CHECKPOINT = """
import store.checkpoint as _checkpoint
_save = _checkpoint.save_checkpoint
def _save_then_ctrl_c(path, state):
    _save(path, state)
    if path.endswith("ckpt.pt"):
        raise KeyboardInterrupt
_checkpoint.save_checkpoint = _save_then_ctrl_c
"""


def ctrl_c_while_scoring(batches):
    return f"""
import scoring.paired as _heldout
_score_batches = _heldout.score_batches
def _stopped(*args, **kwargs):
    for index, batch in enumerate(_score_batches(*args, **kwargs)):
        if index == {batches}:
            raise KeyboardInterrupt
        yield batch
_heldout.score_batches = _stopped
"""


CTRL_C_WHILE_SAMPLING = """
import scoring.paired as _heldout
def _ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt
_heldout.run_method = _ctrl_c
"""


KEPT = r"interrupted: .*out/ckpt.pt holds iteration 1 of 2; the same command continues"


@pytest.mark.parametrize("backbone", ["digits", "mini-sd3"])
def test_ctrl_c_during_train_says_what_is_kept_and_the_same_command_continues(tmp_path, backbone):
    command = ["train.py", *RUN_ARGS, "--backbone", backbone, "--out-dir", str(tmp_path / "out")]
    if backbone != "digits":
        command += ["--steps", "2"]
    stopped = run_case(tmp_path, command, CTRL_C_AFTER_CHECKPOINT)
    assert stopped.returncode == 130 and "Traceback" not in stopped.stderr, stopped.stderr[-2000:]
    assert re_search(KEPT, stopped.stderr.strip().splitlines()[-1]), stopped.stderr
    again = run_case(tmp_path, command, NONE)
    assert again.returncode == 0 and "from iteration 1" in again.stdout, again.stderr[-2000:]
    assert read_rows(tmp_path / "out") == [1, 2]


def test_ctrl_c_during_evaluate_keeps_the_scores_or_leaves_no_folder(tmp_path, finished_run):
    out = tmp_path / "eval"
    command = ["evaluate.py", "--ckpt", f"{finished_run}/ckpt.pt", "--out-dir", str(out)]
    command += ["--batch-size", "2"]
    before = run_case(tmp_path, command, ctrl_c_while_scoring(0))  # before the first batch
    assert before.returncode == 130 and "Traceback" not in before.stderr, before.stderr[-2000:]
    assert "nothing was scored or written" in before.stderr and not out.exists()
    during = run_case(tmp_path, command, ctrl_c_while_scoring(1))  # after one batch of two
    assert during.returncode == 130 and "Traceback" not in during.stderr, during.stderr[-2000:]
    last = during.stderr.strip().splitlines()[-1]
    assert "scores.json keeps every score made so far; the same command scores the rest" in last
    kept = json.loads((out / "scores.json").read_text())["scores"]["default"]["teacher"]
    assert len(kept) == 2  # the first batch's contexts
    again = run_case(tmp_path, command, NONE)
    assert again.returncode == 0 and (out / "results.md").is_file(), again.stderr[-2000:]


def test_ctrl_c_during_sample_ends_in_one_line_and_writes_nothing(tmp_path, finished_run):
    out = tmp_path / "samples"
    command = ["sample.py", "--ckpt", f"{finished_run}/policy", "--out-dir", str(out)]
    stopped = run_case(tmp_path, command, CTRL_C_WHILE_SAMPLING)
    assert stopped.returncode == 130 and "Traceback" not in stopped.stderr, stopped.stderr[-2000:]
    assert "sample.py: interrupted" in stopped.stderr.strip().splitlines()[-1]
    assert not out.exists()


# Ctrl-C as the script starts to import torch (a fresh process: the server has torch imported)
CTRL_C_AT_IMPORT = """
import os, runpy, signal, sys
class CtrlC:
    def find_spec(self, name, *_):
        if name == "torch":
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, CtrlC())
sys.argv = [{script!r}, "--out-dir", {out!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.parametrize("script", ["train.py", "sample.py", "evaluate.py"])
def test_ctrl_c_during_the_imports_ends_in_one_line(tmp_path, script):
    code = CTRL_C_AT_IMPORT.format(script=os.path.join(ROOT, script), out=str(tmp_path / "o"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stderr == f"{script}: interrupted while starting: nothing was written\n"
    assert not (tmp_path / "o").exists()


def test_a_users_files_in_out_dir_are_refused_and_left_as_they_were(tmp_path):
    users_files(tmp_path, None)
    before = {path: path.read_bytes() for path in (tmp_path / "out").rglob("*") if path.is_file()}
    result = run_case(tmp_path, ["train.py", *RUN_ARGS, "--out-dir", str(tmp_path / "out")], NONE)
    assert result.returncode == 1 and "no run of train.py wrote" in result.stderr
    after = {path: path.read_bytes() for path in (tmp_path / "out").rglob("*") if path.is_file()}
    assert after == before  # nothing renamed, overwritten or added


def test_the_main_job_closes_every_file_it_opens(tmp_path):
    """`python -W error train.py`: no ResourceWarning (the run folder's lock is closed)."""
    result = subprocess.run(
        [sys.executable, "-W", "error", os.path.join(ROOT, "train.py"), *RUN_ARGS],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "Warning" not in result.stderr, result.stderr[-2000:]


def test_generate_samples_at_the_guidance_the_policy_was_trained_with():
    from backbones.pipeline import trained_guidance
    from store.checkpoint import make_policy

    dims = dict(latent_channels=16, text_dim=32, pooled_dim=64)
    policy = make_policy("instance", dims, 3, backbone="mini-sd3")
    assert trained_guidance(policy) == 1.25  # the miniature's, not the SD3 pipeline's 7.0
    policy.training_config = dict(backbone="mini-sd3", guidance=2.0)
    assert trained_guidance(policy) == 2.0
    assert trained_guidance(make_policy("instance", dims, 3, backbone="flux-schnell")) is None


def test_a_model_half_in_the_hub_cache_is_left_for_from_pretrained_to_complete(
    tmp_path, monkeypatch
):
    """A first run online caches model_index.json before from_pretrained fetches the components:
    those not downloaded yet are no error (else every rerun would be told to delete the cache and
    fail again), while a damaged file already in the cache is still named."""
    import huggingface_hub

    import backbones

    snapshot = tmp_path / "models--stabilityai--stable-diffusion-3.5-medium" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    index = {"_class_name": "StableDiffusion3Pipeline", "vae": ["diffusers", "AutoencoderKL"]}
    (snapshot / "model_index.json").write_text(json.dumps(index))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.file_download, "HF_HUB_CACHE", str(tmp_path), raising=False)
    hub_id = backbones.BACKBONES["sd35m"]["hub_id"]
    assert backbones.check_files("sd35m") == hub_id
    (snapshot / "vae").mkdir()
    (snapshot / "vae" / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"vae/config.json is damaged \(not JSON.*hub cache"):
        backbones.check_files("sd35m")


def test_a_refusal_after_the_claim_leaves_no_folder(tmp_path):
    """--concentration too small for the default schedule's smallest increment is known only once
    the backbone has given that schedule: the refusal still leaves the folder as it was."""
    out = tmp_path / "new" / "out"
    config = train.parse_config([*RUN_ARGS, "--concentration", "1e-6", "--out-dir", str(out)])
    with pytest.raises(SystemExit, match="--concentration 1e-06: every initial concentration"):
        train.main(config)
    assert not (tmp_path / "new").exists()


def test_a_users_run_lock_and_tmp_files_are_left_as_they_were(tmp_path):
    out = tmp_path / "out"
    (out / "policy.tmp").mkdir(parents=True)
    (out / "policy.tmp" / "keep.txt").write_text("mine")
    (out / "run.lock").write_text("my notes")
    with pytest.raises(SystemExit, match="holds run.lock"):
        train.main(train.parse_config([*RUN_ARGS, "--out-dir", str(out)]))
    (out / "run.lock").unlink()
    with pytest.raises(SystemExit, match="holds policy.tmp, which no run of train.py wrote"):
        train.main(train.parse_config([*RUN_ARGS, "--out-dir", str(out)]))
    assert (out / "policy.tmp" / "keep.txt").read_text() == "mine"
    assert sorted(path.name for path in out.iterdir()) == ["policy.tmp"]


def test_one_held_out_context_writes_strict_json(tmp_path):
    """No interval from one context: null in eval.json, which stays JSON (no NaN)."""
    out = tmp_path / "out"
    train.main(train.parse_config([*RUN_ARGS, "--eval-contexts", "1", "--out-dir", str(out)]))

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    report = json.loads((out / "eval.json").read_text(), parse_constant=refuse)
    assert all(row["ci95"] is None for row in report["rows"])


@pytest.mark.parametrize("script", ["sample.py", "evaluate.py"])
def test_an_ascii_terminal_gets_every_table(tmp_path, finished_run, script):
    """The tables' "±" on a terminal that cannot show it: escaped, and the run ends normally."""
    env = dict(ENV, PYTHONIOENCODING="ascii")
    command = [sys.executable, os.path.join(ROOT, script), "--ckpt", str(finished_run / "ckpt.pt")]
    command += ["--out-dir", str(tmp_path / "out")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert b"Traceback" not in result.stderr


def test_under_torchrun_only_rank_0_says_why(tmp_path, monkeypatch, capsys):
    config = train.parse_config(["--contexts", "5", "--out-dir", str(tmp_path / "out")])
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as error:
        train.check(config, world_size=2)
    assert error.value.code == 1 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit, match="--contexts 5 is not divisible by the 2 ranks"):
        train.check(config, world_size=2)
