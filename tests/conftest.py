"""Shared runs of train.py itself: the checkpoints that evaluate.py and sample.py are tested on."""

import json
import os
import subprocess
import sys
import tempfile

# Every test is offline: a missing hub file must fail in milliseconds, not after retries.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

# The embedded backbones' tensors are tiny: a second intra-op thread only adds contention.
torch.set_num_threads(1)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


# A process that has imported torch, the scripts and diffusers once, and forks a child for each
# script run: the child is a fresh process as far as the script can tell (its own modules' state,
# working folder, arguments, output, exit code), without paying the imports again (about 3 s for
# torch, 6 s for diffusers, per run).
SERVER = """
import json, os, runpy, sys, traceback
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
torch.set_num_interop_threads(1)
import diffusers.pipelines.flux.pipeline_flux, diffusers.pipelines.stable_diffusion_3, \\
    diffusers.pipelines.stable_diffusion_xl
import evaluate, sample, train
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    child = os.fork()
    if child:
        _, status = os.waitpid(child, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
        continue
    os.chdir(request["cwd"])
    for stream, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), stream)
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
    script, *args = request["command"]
    code = 0
    try:
        exec(request["fault"])
        if script == "-c":  # an API call: its one-line ValueError is what a caller sees
            try:
                exec(args[0])
            except ValueError as error:
                sys.exit(f"ValueError: {{error}}")
        elif script == "-m":  # python -m evidence.bench ...
            sys.argv = args
            runpy.run_module(args[0], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        code = 1 if isinstance(stop.code, str) else stop.code or 0
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
"""


class Scripts:
    """run(command, cwd, fault) -> subprocess.CompletedProcess: `command` a script of the
    repository and its arguments ("-c" and code, "-m" and a module), after `fault` (code run
    first), in a child of the server process."""

    process = None

    def run(self, command, cwd, fault=""):
        if self.process is None:
            self.process = subprocess.Popen(
                [sys.executable, "-c", SERVER.format(root=ROOT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=ENV,
                text=True,
            )
            assert self.process.stdout.readline().strip() == "ready"
        script, *args = command
        script = script if script in ("-c", "-m") else os.path.join(ROOT, script)
        with tempfile.TemporaryDirectory() as folder:
            paths = dict(stdout=os.path.join(folder, "out"), stderr=os.path.join(folder, "err"))
            request = dict(paths, command=[script, *args], cwd=str(cwd), fault=fault)
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            code = int(self.process.stdout.readline())
            output = {name: open(path).read() for name, path in paths.items()}
        return subprocess.CompletedProcess(command, code, output["stdout"], output["stderr"])


SCRIPTS = Scripts()


def run_script(script, args, cwd):
    """A script of the repository as a user runs it, in a fresh process (a child of SCRIPTS)."""
    return SCRIPTS.run([script, *args], cwd)


def train_in_process(out_dir, *args):
    """train.py's main in this process; the embedded teacher solves 16 RK4 steps instead of 64 (RMS
    error 2e-4 on digits against 1e-6, both far below a 4-step sampler's 0.2) to keep tests fast."""
    import train
    from backbones import mixture

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mixture.MixtureBackbone, "reference_steps", 16)
        train.main(train.parse_config(["--out-dir", str(out_dir), *args]))
    return out_dir


def small_policies(patch):
    """The real backbones' policy (about 20M parameters) at the embedded size on the tests' tiny
    pipelines: the same code, a 100k-parameter network, so that a PPO step takes milliseconds."""
    import policy

    patch.setitem(policy.NETWORKS, "real", policy.NETWORKS["embedded"])


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """A short digits training (L = 4, 60 iterations, 128 held-out contexts): its out dir."""
    flags = "--iterations 60 --ckpt-interval 30 --eval-contexts 128 --log-interval 20"
    return train_in_process(tmp_path_factory.mktemp("digits") / "out", *flags.split())


@pytest.fixture(scope="session")
def digits_global_run(tmp_path_factory):
    flags = "--policy global --iterations 3 --eval-contexts 4"
    return train_in_process(tmp_path_factory.mktemp("digits_global") / "out", *flags.split())


@pytest.fixture(scope="session")
def digits_stepwise_run(tmp_path_factory):
    """TPDM's comparator: a step-wise policy trained with PPO, 3 iterations."""
    flags = "--policy stepwise --optimizer ppo --iterations 3 --eval-contexts 4 --contexts 8"
    return train_in_process(tmp_path_factory.mktemp("digits_stepwise") / "out", *flags.split())


def train_tiny(folder, name, *args):
    """train.py on the tiny SD3, SD-XL and Flux-Dev pipelines saved in `folder` (two iterations, the
    teacher reward, rollouts in parts of 3 samples), with `args` added: backbone -> out dir."""
    import rollout
    from miniatures.layouts import TINY_RESOLUTION

    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        small_policies(patch)
        patch.setattr(rollout.Backbone, "reference_steps", 4)
        for backbone, family in (("sd35m", "sd3"), ("sdxl", "sdxl"), ("flux-dev", "flux-dev")):
            runs[backbone] = train_in_process(
                folder / f"{name}_{backbone}",
                *("--backbone", backbone, "--model-path", str(folder / family)),
                *("--resolution", str(TINY_RESOLUTION), "--prompts", str(folder / "prompts.txt")),
                *("--eval-prompts", str(folder / "prompts.txt"), "--reward", "teacher"),
                *("--steps", "2", "--iterations", "2", "--contexts", "4", "--eval-contexts", "4"),
                *("--rollout-batch", "3", "--device", "cpu", *args),
            )
    return runs


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory):
    """train.py on saved tiny random SD3, SD-XL and Flux-Dev pipelines (from_pretrained from a local
    folder), two iterations each with the teacher reward; the teacher solves 4 default steps instead
    of 50, which keeps the test fast and the code path the same. Returns backbone -> out dir, and
    the folders of the saved pipelines (flux-schnell too, for evaluate.py --schnell)."""
    from miniatures.layouts import tiny_pipeline

    folder = tmp_path_factory.mktemp("tiny")
    for family in ("sd3", "sdxl", "flux-dev", "flux-schnell"):
        tiny_pipeline(family).save_pretrained(folder / family)
    (folder / "prompts.txt").write_text("a red fox in snow\na blue car\na bowl of soup\n")
    return train_tiny(folder, "out"), folder


@pytest.fixture(scope="session")
def tiny_stepwise_runs(tiny_runs):
    """train.py --policy stepwise --optimizer ppo on the tiny SD3, SD-XL and Flux-Dev folders of
    tiny_runs (two iterations, rollouts in parts of 3 samples): backbone -> out dir."""
    args = ("--policy", "stepwise", "--optimizer", "ppo", "--ppo-minibatches", "2")
    return train_tiny(tiny_runs[1], "out_stepwise", *args)


def pytest_collection_modifyitems(items):
    """With pytest-xdist (pytest.ini runs one worker per core): all tests that read the shared
    train.py runs above go to one worker, the tests of each other file to one worker, so each run
    and each module fixture is built once."""
    for item in items:
        shared = {"tiny_runs", "digits_run", "digits_global_run", "digits_stepwise_run"}
        shared &= set(item.fixturenames)
        item.add_marker(pytest.mark.xdist_group("train-runs" if shared else item.path.name))
