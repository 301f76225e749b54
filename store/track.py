"""
A run followed where researchers follow runs, as nanoGPT's wandb_log and cleanrl's --track do:
`train.py --track tensorboard` (event files in <out_dir>/tensorboard) or `--track wandb` (a run
named after the run folder, in <out_dir>/wandb; WANDB_MODE=offline keeps it on the machine for a
later `wandb sync`) mirrors each row of metrics.jsonl, which stays the record. A resumed run
continues the same wandb run, and TensorBoard drops the steps after the checkpoint, which the
resumed run logs again. Both packages are optional (requirements-track.txt), imported only
when asked for.
"""

import hashlib
import importlib.util
import json
import math
import netrc
import os
import urllib.parse


def scalars(row):
    """The numbers of a metrics.jsonl row, without the iteration (the step) and NaN (a setting that
    does not apply, such as a clip fraction where no update clips)."""
    return {
        key: value
        for key, value in row.items()
        if key != "iteration" and isinstance(value, (int, float)) and math.isfinite(value)
    }


class TensorBoard:
    def __init__(self, out_dir, config, start):
        from torch.utils.tensorboard import SummaryWriter

        purge = start + 1 if start else None  # the steps a killed run logged past its checkpoint
        self.writer = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=purge)
        self.writer.add_text("config", json.dumps(config, indent=1))

    def log(self, row):
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, row["iteration"])

    def close(self):
        self.writer.close()


class WandB:
    def __init__(self, out_dir, config, start):
        import wandb

        name = os.path.basename(os.path.normpath(out_dir))
        folder = hashlib.sha256(os.path.abspath(out_dir).encode()).hexdigest()[:8]
        run_id = f"{name}-{folder}"  # the same folder, the same wandb run; another, another
        options = dict(name=name, id=run_id, resume="allow", dir=out_dir, config=config)
        self.run = wandb.init(project="instance-schedules", **options)

    def log(self, row):
        if row["iteration"] > self.run.step:  # wandb refuses a step it has already logged
            self.run.log(scalars(row), step=row["iteration"])

    def close(self):
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB}


def check_tracker(kind):
    """ValueError in one line, saying what to do, when tracker `kind` (None: none) cannot start: its
    package is not installed, or wandb has no login and is not offline. Checked before anything
    heavy loads."""
    if kind and importlib.util.find_spec(kind) is None:
        raise ValueError(
            f"--track {kind} needs the {kind} package: pip install -r requirements-track.txt"
        )
    if kind == "wandb" and not wandb_ready():
        raise ValueError(
            "--track wandb needs a login: run `wandb login`, or set WANDB_MODE=offline to keep the "
            "run on this machine (`wandb sync` it later)"
        )


def wandb_ready():
    """Whether wandb will start without asking: offline, or an API key in the environment or in
    the netrc file `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def open_tracker(kind, out_dir, config, start=0):
    """The tracker `kind` (None: none) for the run in out_dir, with its configuration (a dict),
    continuing after iteration `start`."""
    return None if kind is None else TRACKERS[kind](out_dir, config, start)
