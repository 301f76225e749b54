"""evidence/results.py: docs/RESULTS.md written section by section by the commands (record), the
door of a study's folder and the key of the runs it keeps."""

import os
import re
import subprocess
import sys

import pytest
from conftest import SCRIPTS

from evidence import results, stale

REPOSITORY = results.REPOSITORY


def test_a_section_is_written_under_its_command_and_commit_and_replaced_alone(tmp_path):
    path = str(tmp_path / "RESULTS.md")
    results.record("first", "python a.py", ["| a |", "|---|", "| 1 |"], at="abc123", path=path)
    results.record("second", "python b.py --x", ["b's table"], at="def456", path=path)
    lines = ["| a |", "|---|", "| 2 |"]
    results.record("first", "python a.py", lines, at="0ff1ce", path=path)
    text = open(path).read()
    assert text.startswith("# Results\n")
    found = results.sections(text)
    assert list(found) == ["first", "second"]  # replaced in place, order kept
    assert found["first"][:-2] == ["", "`python a.py`", "", "at commit 0ff1ce", "", *lines, ""]
    assert found["first"][-2].startswith("Ran at 0ff1ce in ")  # its minutes, cores and runs
    assert found["second"][1:4] == ["`python b.py --x`", "", "at commit def456"]
    assert "| 1 |" not in text


STUDIES = ["ablation", "ablation --miniatures", "ablation --distilled", "baseline_study", "bound"]
STUDIES += ["ceiling", "comparator_study", "instance_study", "regime_study", "tie_study"]


@pytest.mark.parametrize("study", [*STUDIES, "tie_confirm"])  # every command with an --out-dir
def test_a_study_refuses_a_users_folder_and_leaves_it_as_it_was(tmp_path, study):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my notes")
    alarm = "import signal; signal.alarm(60)"  # a door letting the folder through: the study starts
    result = SCRIPTS.run(["-m", *f"evidence.{study} --out-dir mine".split()], tmp_path, alarm)
    refusal = "error: --out-dir mine holds files the study did not write; pass another"
    assert (result.returncode, result.stderr.splitlines()) == (1, [refusal])
    assert [path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()] == [b"my notes"]


def git(folder, *args):
    config = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    command = ["git", "-C", str(folder), *config, *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def test_runs_are_keyed_by_the_code_and_kept_when_evidence_is_committed(tmp_path):
    def write(path, text, commit=True):  # -> the key of the runs after it
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(text)
        if commit:
            git(tmp_path, "add", ".")
            git(tmp_path, "commit", "-qm", path)
        return results.commit(str(tmp_path))

    git(tmp_path, "init", "-q")
    key = write("train.py", "rate = 1\n")
    assert key == git(tmp_path, "rev-parse", "HEAD")[:12]
    assert write("docs/RESULTS.md", "a section\n") == write("README.md", "its summary\n") == key
    assert write("train.py", "rate = 2\n", commit=False) == key + " with uncommitted changes"
    assert write("train.py", "rate = 2\n") == git(tmp_path, "rev-parse", "HEAD")[:12] != key


def test_without_git_the_code_is_unknown_and_no_other_runs_cache_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git installed, and a copy without .git:
    assert results.commit() == results.commit(str(tmp_path)) == "unknown"
    (tmp_path / "commit.txt").write_text("unknown")  # a study's folder, of another run
    (tmp_path / "cell.json").write_text("{}")
    results.this_commit_only(str(tmp_path))
    assert os.listdir(tmp_path) == ["commit.txt"]
    (tmp_path / "cell.json").write_text("{}")
    results.this_commit_only(str(tmp_path))  # this run's own cells are read
    assert sorted(os.listdir(tmp_path)) == ["cell.json", "commit.txt"]


def test_a_section_is_stale_where_a_file_it_depends_on_changed_and_kept_only_by_its_entry(
    tmp_path, monkeypatch
):
    git(tmp_path, "init", "-q")
    (tmp_path / "train.py").write_text("rate = 1\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "code")
    at = git(tmp_path, "rev-parse", "HEAD")[:12]
    monkeypatch.setattr(stale, "REPOSITORY", str(tmp_path))
    monkeypatch.setattr(stale, "SECTIONS", {"s": ("H", ("train.py",)), "t": ("H", ("toy.py",))})
    (tmp_path / "toy.py").write_text("seed = 0\n")  # toy.py is new: t's numbers changed too
    (tmp_path / "train.py").write_text("rate = 2\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "rate")
    assert stale.status("s", [f"at commit {at}"]).startswith("stale: changed since: train.py")
    assert stale.status("s", [f"at commit {git(tmp_path, 'rev-parse', 'HEAD')}"]) == "current"
    assert stale.status("s", [f"at commit {at} with uncommitted changes"]).startswith("stale")
    monkeypatch.setitem(stale.KEPT, "t", "a measured reason")
    assert stale.status("t", [f"at commit {at}"]) == "kept: a measured reason"
    with pytest.raises(ValueError, match="not in this repository's history"):
        stale.status("s", ["at commit 0123456789ab"])


@pytest.mark.skipif(not os.path.isdir(os.path.join(REPOSITORY, ".git")), reason="a copy: no git")
def test_no_section_of_the_results_is_stale_unless_kept_or_listed_and_the_claims_are_current():
    done = subprocess.run([sys.executable, "-m", "evidence.stale"], cwd=REPOSITORY, text=True,
                          capture_output=True)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_readmes_results_are_the_numbers_of_the_sections_they_name():
    readme = open(os.path.join(REPOSITORY, "README.md")).read()
    found = results.sections(open(results.RESULTS).read())
    summary = readme[readme.index("## Results") : readme.index("## Tests")]
    for bullet in summary.split("\n- ")[1:]:
        bullet = " ".join(bullet.split())
        names = [name for name in re.findall(r'"([^"]+)"', bullet) if name in found]
        cited = "\n".join(line for name in names for line in found[name])
        numbers = re.findall(r"\d+\.\d+(?: ± \d+\.\d+)?", bullet)  # a mean with its interval
        assert names and [n for n in numbers if n not in cited] == [], bullet
