"""One rule for every output folder (docs/FAILURES.md): a folder is a program's only if it carries
that program's marker (store.files.MARKER), the lock is taken before the folder's state is read,
and a program writes, replaces or deletes only the files it writes."""

import json

import pytest
from PIL import Image

import evaluate
import sample
import train
from store import checkpoint, files

SHORT = ["--iterations", "3", "--contexts", "8", "--eval-contexts", "4", "--ckpt-interval", "2"]


def test_a_users_tmp_files_in_a_run_folder_are_kept(tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    (out / "draft.tmp").write_text("draft")
    (out / "cache.tmp").mkdir()
    train.main(train.parse_config([*SHORT, "--out-dir", str(out)]))
    assert (out / "draft.tmp").read_text() == "draft" and (out / "cache.tmp").is_dir()
    assert json.loads((out / files.MARKER).read_text())["program"] == "train.py"
    assert (out / "eval.json").is_file()


def test_a_lock_file_alone_does_not_make_a_users_folder_a_run(tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    (out / "run.lock").write_text("")
    (out / "eval.json").write_text("mine")
    with pytest.raises(SystemExit, match="holds eval.json, which no run of train.py wrote"):
        train.main(train.parse_config([*SHORT, "--out-dir", str(out)]))
    assert (out / "eval.json").read_text() == "mine"
    assert sorted(path.name for path in out.iterdir()) == ["eval.json", "run.lock"]


def test_another_programs_folder_is_refused(tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    (out / files.MARKER).write_text('{"program": "sample.py"}')
    with pytest.raises(SystemExit, match="holds the outputs of sample.py, not of train.py"):
        train.main(train.parse_config([*SHORT, "--out-dir", str(out)]))
    assert sorted(path.name for path in out.iterdir()) == [files.MARKER]


def test_the_folder_is_locked_before_its_run_is_read(tmp_path, monkeypatch):
    # a run finishing while a second start loads its backbone must find the folder taken
    out, read = tmp_path / "d", []
    existing_run = checkpoint.existing_run

    def while_locked(config):
        with pytest.raises(ValueError, match="in use by another run"):
            files.lock_run(config["out_dir"])
        read.append(config["out_dir"])
        return existing_run(config)

    monkeypatch.setattr(checkpoint, "existing_run", while_locked)
    *_, claim = train.check(train.parse_config([*SHORT, "--out-dir", str(out)]), 1)
    files.release(claim)
    assert read == [str(out)] and not out.exists()  # a refused or released start leaves nothing


@pytest.mark.parametrize("error", [RuntimeError("a warning made an error"), KeyboardInterrupt()])
def test_a_start_that_fails_while_loading_leaves_no_folder(tmp_path, monkeypatch, error):
    # not only a refusal (ValueError): an error under -W error, or Ctrl-C, while the backbone loads
    def failing(*_, **__):
        raise error

    monkeypatch.setattr(train.backbones, "trained_backbone", failing)
    out = tmp_path / "new" / "d"
    with pytest.raises(type(error)):
        train.main(train.parse_config([*SHORT, "--out-dir", str(out)]))
    assert not (tmp_path / "new").exists()


@pytest.fixture(scope="module")
def ckpt(digits_run):
    return str(digits_run / "ckpt.pt")


def test_sample_refuses_a_folder_with_a_users_grid(tmp_path, ckpt):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "grid.png").write_text("my grid")
    with pytest.raises(SystemExit, match="holds grid.png, which no run of sample.py wrote"):
        sample.main(["--ckpt", ckpt, "--out-dir", str(out)])
    assert sorted(path.name for path in out.iterdir()) == ["grid.png"]
    assert (out / "grid.png").read_text() == "my grid"


def test_a_second_sampling_replaces_the_first_and_a_repeated_seed_is_sampled_once(
    tmp_path, ckpt, capsys
):
    out = tmp_path / "samples"
    (tmp_path / "samples").mkdir()
    (out / "notes.txt").write_text("mine")  # not a name sample.py writes: kept
    sample.main(["--ckpt", ckpt, "--out-dir", str(out), "--prompt", "a handwritten 1"])
    first = sorted(path.name for path in out.glob("0*.png"))
    assert first == [
        f"000_a-handwritten-1_seed0_{m}.png" for m in ("default", "learned", "teacher")
    ]
    capsys.readouterr()
    prompt = ["--prompt", "a handwritten 7", "--seeds", "0", "0", "3"]
    sample.main(["--ckpt", ckpt, "--out-dir", str(out), *prompt])
    assert "1 repeated context(s) sampled once" in capsys.readouterr().out
    second = sorted(path.name for path in out.glob("0*.png"))
    assert len(second) == 6 and all("handwritten-7" in name for name in second)
    assert len(json.loads((out / "schedules.json").read_text())["contexts"]) == 2
    assert (out / "notes.txt").read_text() == "mine"


def test_the_grid_draws_at_most_grid_contexts_rows(tmp_path, ckpt):
    out = tmp_path / "samples"
    seeds = [str(seed) for seed in range(sample.GRID_CONTEXTS + 4)]
    sample.main(["--ckpt", ckpt, "--out-dir", str(out), "--prompt", "a handwritten 2", "--seeds"]
                + seeds)  # fmt: skip
    assert len(list(out.glob("0*_learned.png"))) == len(seeds)  # every context's images
    # save_figures: 2.5 inches per row at 150 dpi
    assert Image.open(out / "grid.png").height == round(2.5 * sample.GRID_CONTEXTS * 150)


def test_a_full_disk_while_writing_the_policy_keeps_the_last_one_whole(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import backbones

    dims = backbones.load_backbone("digits").policy_dims
    policy = checkpoint.make_policy("instance", dims, 4)
    folder = str(tmp_path / "policy")
    checkpoint.save_policy(folder, policy, dict(backbone="digits", steps=4), 1)
    before = {path.name: path.read_bytes() for path in (tmp_path / "policy").iterdir()}

    def full_disk(staging, config):  # the config written, the weights cut short
        (tmp_path / "policy.tmp").mkdir()
        (tmp_path / "policy.tmp" / "config.json").write_text("{}")
        raise SafetensorError("Error while serializing: I/O error: No space left (os error 28)")

    monkeypatch.setattr(policy, "save_pretrained", full_disk)
    with pytest.raises(files.WriteFailed, match=r"could not write .*policy: the disk is full"):
        checkpoint.save_policy(folder, policy, dict(backbone="digits", steps=4), 2)
    after = {path.name: path.read_bytes() for path in (tmp_path / "policy").iterdir()}
    assert after == before and not (tmp_path / "policy.tmp").exists()
    assert checkpoint.load_checkpoint(folder)[0]["iteration"] == 1


@pytest.mark.parametrize("program", ["sample", "evaluate"])
def test_sample_and_evaluate_failing_while_loading_leave_no_folder(
    tmp_path, monkeypatch, ckpt, program
):
    module = {"sample": sample, "evaluate": evaluate}[program]

    def failing(*_, **__):
        raise RuntimeError("a warning made an error")

    monkeypatch.setattr(module.backbones, "trained_backbone", failing)
    out = tmp_path / "new" / "d"
    with pytest.raises(RuntimeError):
        module.main(["--ckpt", ckpt, "--out-dir", str(out)])
    assert not (tmp_path / "new").exists()
