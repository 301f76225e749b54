"""evidence/bench.py --gpu: its real configurations' sizes, and its code run end to end with --tiny
(the same layouts scaled down, train.py's main on each, on the CPU), which records nothing."""

import math
import pathlib
import re

import torch
from conftest import ROOT, SCRIPTS

import backbones
import train

RESULTS = pathlib.Path(ROOT, "docs", "RESULTS.md")
# the published sizes in billions (SD3.5's MMDiT with its position table, as its checkpoint holds
# it), each rounded to two or three digits: a configuration within 2% of it is the model's
PUBLISHED = {
    "sd35m": {"MMDiT": 2.5, "T5-XXL": 4.7},
    "sd35l": {"MMDiT": 8.1, "T5-XXL": 4.7},
    "sdxl": {"UNet": 2.6},
    "flux-dev": {"Flux transformer": 11.9, "T5-XXL": 4.7},
}


def test_gpu_benchmark_runs_tiny_on_the_cpu_without_git_and_records_nothing(tmp_path):
    results_before = RESULTS.read_bytes()
    no_git = "os.environ['PATH'] = ''"  # a machine without git: the commit is unknown
    result = SCRIPTS.run(["-m", "evidence.bench", "--gpu", "--tiny"], tmp_path, no_git)
    assert result.returncode == 0, result.stderr
    assert RESULTS.read_bytes() == results_before  # --tiny records nothing
    out = result.stdout
    assert re.search(r"^torch \S+ on cpu", out, re.M) and "diffusers " in out and "reward: " in out
    for name, sizes in PUBLISHED.items():
        real = re.search(rf"^  {name}: (.*)$", out, re.M).group(1)  # the meta device's counts
        counts = dict(part.rsplit(" ", 1) for part in real.split(", "))  # "MMDiT": "2.470B", ...
        for component, billions in sizes.items():
            assert counts[component].endswith("B"), (name, real)
            assert abs(float(counts[component][:-1]) / billions - 1) < 0.02, (name, real)

        report = re.search(rf"^{name}: .*?(?=^\S|\Z)", out, re.M | re.S).group()
        # a full model call: the rollout batch, doubled by [uncond; cond] under CFG (not Flux-Dev's
        # distilled guidance)
        cfg = backbones.BACKBONES[name]["family"] != "flux"
        per_call = train.PRESETS[name]["rollout_batch"] * (2 if cfg else 1)
        assert f"({per_call} per model call" in report
        largest = re.search(r"largest model batch: loop (\d+), held-out report (\d+)", report)
        assert (int(largest[1]), int(largest[2])) == (per_call, per_call), report
        memory = re.search(
            r"peak memory .*: load ([\d.]+) .*loop ([\d.]+) .*report ([\d.]+)", report
        )
        assert all(float(peak) > 0 for peak in memory.groups()), report
        ratio = float(re.search(r"loop / pipeline ([\d.]+)", report)[1])
        assert math.isfinite(ratio) and ratio > 0, report


def test_the_hps_reward_is_built_on_its_device(tmp_path, monkeypatch):
    """The benchmark's reward as train.py loads it (rewards/hps.py): HPSv2's model is built on its
    device, here the meta device, and its checkpoint loaded there, not first on the CPU."""
    from evidence import bench

    seen, load = [], torch.nn.Module.load_state_dict

    def spy(module, state):  # where the model is when its checkpoint is loaded into it
        seen.append(next(module.parameters()).device)
        return load(module, state)

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", spy)
    bench.gpu_reward(torch.device("meta"), str(tmp_path), tiny=True)
    assert seen == [torch.device("meta")]
