"""The prompt sets shipped in prompts/: format, counts, balance, and train/held-out disjointness;
load_prompt_file's one-line error on a file with a bad record."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from prompts import HPDV2_STYLES, load_prompt_file

PROMPTS = Path(__file__).resolve().parent.parent / "prompts"
# file: (minimum lines, minimum lines per style or None for the OCR sets)
MINIMUM = {
    "train.jsonl": (440, 110),
    "heldout.jsonl": (220, 55),
    "ocr_train.jsonl": (220, None),
    "ocr_heldout.jsonl": (110, None),
}
PAIRS = [("train.jsonl", "heldout.jsonl"), ("ocr_train.jsonl", "ocr_heldout.jsonl")]


def load(name):
    with open(PROMPTS / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def norm(text):
    return " ".join(text.lower().split())


@pytest.mark.parametrize("name", sorted(MINIMUM))
def test_rows_are_objects_with_clean_distinct_prompts(name):
    rows = load(name)
    assert len(rows) >= MINIMUM[name][0], f"{name}: {len(rows)} rows"
    for row in rows:
        assert isinstance(row, dict)
        prompt = row.get("prompt")
        assert isinstance(prompt, str) and prompt and prompt == prompt.strip(), row
    counts = Counter(norm(row["prompt"]) for row in rows)
    assert [p for p, c in counts.items() if c > 1] == []


@pytest.mark.parametrize("train, heldout", PAIRS)
def test_train_and_heldout_disjoint(train, heldout):
    """No held-out prompt is a training prompt; the OCR sets share no target text either."""
    for key in ["prompt", "text"] if train.startswith("ocr") else ["prompt"]:
        assert {norm(r[key]) for r in load(train)} & {norm(r[key]) for r in load(heldout)} == set()


@pytest.mark.parametrize("name", ["train.jsonl", "heldout.jsonl"])
def test_styles_balanced_and_interleaved(name):
    rows = load(name)
    counts = Counter(row["style"] for row in rows)
    assert set(counts) == set(HPDV2_STYLES), counts
    assert min(counts.values()) >= MINIMUM[name][1], counts
    head = [row["style"] for row in rows[:40]]
    assert head == list(HPDV2_STYLES) * 10, head


@pytest.mark.parametrize("name", ["ocr_train.jsonl", "ocr_heldout.jsonl"])
def test_ocr_target_is_the_single_quoted_span(name):
    for row in load(name):
        prompt, text = row["prompt"], row["text"]
        assert prompt.count('"') == 2, prompt
        assert re.search(r'"([^"]*)"', prompt).group(1) == text, row
        assert 1 <= len(text.split()) <= 4 and text == text.strip(), row
        assert re.fullmatch(r"[A-Za-z0-9'\- ]+", text), row


@pytest.mark.parametrize(
    "name, data",
    [
        ("no_prompt.jsonl", b'{"text": "a cat"}\n'),
        ("null.jsonl", b'{"prompt": null}\n'),
        ("nested.json", b'[["a"]]'),
        ("number.jsonl", b"3\n"),
        ("broken.jsonl", b'{"prompt": "a cat"\n'),
        ("object.json", b'{"a": 1}'),
        ("empty.txt", b""),
        ("not_utf8.txt", b"\xff\xfe\x00a"),
    ],
)
def test_a_bad_record_is_one_line_naming_the_file(tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / name))) as error:
        load_prompt_file(str(tmp_path / name))
    assert "\n" not in str(error.value)
