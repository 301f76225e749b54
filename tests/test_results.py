"""docs/RESULTS.md is written section by section by the commands (results.record)."""

from evidence import results


def test_a_section_is_written_under_its_command_and_commit_and_replaced_alone(tmp_path):
    path = str(tmp_path / "RESULTS.md")
    results.record("first", "python a.py", ["| a |", "|---|", "| 1 |"], at="abc123", path=path)
    results.record("second", "python b.py --x", ["b's table"], at="def456", path=path)
    results.record("first", "python a.py", ["| a |", "|---|", "| 2 |"], at="0ff1ce", path=path)
    text = open(path).read()
    assert text.startswith("# Results\n")
    found = results.sections(text)
    assert list(found) == ["first", "second"]  # replaced in place, order kept
    assert found["first"] == [
        "",
        "`python a.py`",
        "",
        "at commit 0ff1ce",
        "",
        "| a |",
        "|---|",
        "| 2 |",
        "",
    ]
    assert found["second"][1:4] == ["`python b.py --x`", "", "at commit def456"]
    assert "| 1 |" not in text


def test_the_commit_names_the_checked_out_head():
    stamp = results.commit()
    head = stamp.split()[0]
    assert len(head) == 12 and all(c in "0123456789abcdef" for c in head)
