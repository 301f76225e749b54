"""
A run followed where researchers follow runs: `train.py --track tensorboard` or `--track wandb`
mirrors each row of metrics.jsonl (which stays the record) to TensorBoard or Weights & Biases, as
nanoGPT's wandb_log and cleanrl's --track do. Both are optional packages (requirements-track.txt),
imported only when asked for; off by default.

- tensorboard: event files in <out_dir>/tensorboard (`tensorboard --logdir out`).
- wandb: a run named after the run folder, its files in <out_dir>/wandb. Offline with
  WANDB_MODE=offline (nothing leaves the machine; `wandb sync` uploads it later); a resumed run
  continues the same wandb run, and rewritten iterations are skipped.
"""

import importlib.util
import json
import math
import os

INSTALL = "pip install -r requirements-track.txt"


def scalars(row):
    """The numbers of a metrics.jsonl row, without the iteration (the step) and NaN (a setting that
    does not apply, such as a clip fraction where no update clips)."""
    return {
        key: value
        for key, value in row.items()
        if key != "iteration" and isinstance(value, (int, float)) and math.isfinite(value)
    }


class TensorBoard:
    def __init__(self, out_dir, config):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        self.writer.add_text("config", json.dumps(config, indent=1))

    def log(self, row):
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, row["iteration"])

    def close(self):
        self.writer.close()


class WandB:
    def __init__(self, out_dir, config):
        import wandb

        name = os.path.basename(os.path.normpath(out_dir))
        self.run = wandb.init(
            project="instance-schedules",
            name=name,
            id=name,  # the same folder continues the same wandb run
            resume="allow",
            dir=out_dir,
            config=config,
        )

    def log(self, row):
        if row["iteration"] > self.run.step:  # wandb refuses a step it has already logged
            self.run.log(scalars(row), step=row["iteration"])

    def close(self):
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB}


def check_tracker(kind):
    """ValueError in one line, with the install command, when the package of tracker `kind` (None:
    none) is not installed: checked before anything heavy loads."""
    module = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(kind)
    if module and importlib.util.find_spec(module) is None:
        raise ValueError(f"--track {kind} needs the {module} package: {INSTALL}")


def open_tracker(kind, out_dir, config):
    """The tracker `kind` (None: none) for the run in out_dir, with its configuration (a dict)."""
    return None if kind is None else TRACKERS[kind](out_dir, config)
