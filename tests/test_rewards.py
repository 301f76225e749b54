"""Rewards: teacher on the real digits backbone, CLIP through a tiny randomly initialised
transformers CLIPModel saved and loaded by path. HPSv2, its preprocessing and its model, is tested
in tests/test_rewards_hps.py."""

import pathlib
import subprocess
import sys
from unittest import mock

import pytest
import torch
from PIL import Image

import backbones
import rewards
import rewards.images as preprocess


class ImageBackbone:
    """Stand-in whose latents are the images themselves: the image rewards only call decode."""

    name, device = "images", torch.device("cpu")

    def decode(self, latents):
        return latents.float().clamp(0.0, 1.0)


def to_pil(image):
    """(3, H, W) in [0, 1] -> the 8-bit PIL image the reference transforms take."""
    pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).numpy())


# ----------------------------------------------------------------------------------------------
# common


def test_import_stays_light():
    # torchvision, hpsv2x and easyocr load only with their rewards: importing the scripts and
    # rewards must not pull them in, and a command line that fails on its input must answer before
    # diffusers or transformers load.
    heavy = "torchvision hpsv2 open_clip easyocr cv2 easyocr_en_models transformers".split()
    heavy += ["diffusers", "matplotlib"]
    code = (
        "import sys, train, evaluate, sample; from rewards import ocr, geneval; "
        f"print(sorted(m for m in {heavy} if m in sys.modules))"
    )
    repo = pathlib.Path(__file__).parents[1]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo
    )
    assert result.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------------------
# teacher, on the real digits backbone


@pytest.fixture(scope="module")
def digits():
    return backbones.load_backbone("digits")


def test_teacher_scores_and_cache(digits):
    # three contexts, each repeated K = 2 times as the trainer lays out a batch
    prompts = [p for p in ["a handwritten 3", "a handwritten 7", "a handwritten 0"] for _ in "ab"]
    noise = digits.sample_noise(3, torch.Generator().manual_seed(0)).repeat_interleave(2, 0)
    cond = digits.encode_prompts(prompts)
    teacher = digits.reference(noise, cond)
    reward = rewards.load_reward("teacher", digits)

    with mock.patch.object(digits, "reference", wraps=digits.reference) as solve:
        own = reward(teacher, prompts, noise, cond)
        # K = 2 rollouts of 3 contexts: one solve of the 3 distinct contexts, the repeats are cached
        assert solve.call_count == 1 and len(solve.call_args.args[0]) == 3
        assert own.dtype == torch.float32 and own.shape == (6,) and own.device == digits.device
        assert torch.equal(own, torch.zeros(6))  # the teacher's own output scores exactly 0

        times = digits.default_times(4).expand(6, -1)
        latents = digits.sample(noise, cond, times)
        scores = reward(latents, prompts, noise, cond)
        assert solve.call_count == 1  # all served from the cache
    assert torch.allclose(scores, -((latents - teacher) ** 2).mean((1, 2, 3)), rtol=1e-6, atol=0)
    assert (scores < 0).all()
    # same noise, same prompt, same teacher: the two rollouts of a context with equal latents agree
    assert torch.equal(scores[0::2], scores[1::2])


class ToyReferenceBackbone:
    """Cheap deterministic teacher (2 x noise + label) to test the cache's bookkeeping."""

    device = torch.device("cpu")

    def __init__(self):
        self.solved = 0

    def reference(self, noise, cond):
        self.solved += noise.shape[0]
        return 2 * noise.float() + cond["label"].view(-1, 1, 1, 1).float()


def test_teacher_cache_keys_on_noise_and_prompt_and_is_bounded_lru():
    backbone = ToyReferenceBackbone()
    reward = rewards.load_reward("teacher", backbone, cache_size=2)
    noise = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    label = torch.tensor([0, 1, 2])
    prompts, zero = ["a", "b", "c"], torch.zeros(1)

    def teacher(noise_index, label_index):  # the toy teacher of one noise under one label
        return 2 * noise[[noise_index]].float() + label[label_index]

    scores = reward(2 * noise.float() + label.view(-1, 1, 1, 1), prompts, noise, dict(label=label))
    assert torch.equal(scores, torch.zeros(3)) and len(reward.cache) == 2  # oldest evicted
    reward(noise[1:].float(), prompts[1:], noise[1:], dict(label=label[1:]))
    assert backbone.solved == 3  # "b" and "c" served from the cache
    reward(noise[:1], prompts[:1], noise[:1], dict(label=label[:1]))
    assert backbone.solved == 4  # context "a" was evicted, solved again
    # the cached noise under another prompt, another noise under a cached prompt: new contexts,
    # each solved and scored against its own teacher
    assert torch.equal(reward(teacher(0, 1), ["b"], noise[:1], dict(label=label[1:2])), zero)
    assert torch.equal(reward(teacher(1, 0), ["a"], noise[1:2], dict(label=label[:1])), zero)
    assert backbone.solved == 6


# ----------------------------------------------------------------------------------------------
# clip, through a tiny CLIPModel saved to disk


def byte_level_vocab():
    """CLIP's byte-to-unicode alphabet, each char alone and as a word end, plus the two specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {char: index for index, char in enumerate(chars)}
    vocab.update({char + "</w>": index + 256 for index, char in enumerate(chars)})
    vocab.update({"<|startoftext|>": 512, "<|endoftext|>": 513})
    return vocab


def save_tiny_clip(path, image_size, patch_size):
    """A randomly initialised CLIPModel and its tokenizer, saved to `path` as a hub folder."""
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    text = dict(sizes, vocab_size=514, max_position_embeddings=77, bos_token_id=512)
    text.update(eos_token_id=513, pad_token_id=513)  # the specials of byte_level_vocab
    vision = dict(sizes, image_size=image_size, patch_size=patch_size)
    CLIPModel(
        CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    ).save_pretrained(path)
    CLIPTokenizer(vocab=byte_level_vocab(), merges=[], model_max_length=77).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    torch.manual_seed(0)
    return save_tiny_clip(tmp_path_factory.mktemp("tiny-clip"), image_size=64, patch_size=16)


@pytest.mark.parametrize(
    "height,width", [(8, 8), (48, 80), (300, 260), (224, 224), (224, 500), (97, 31)]
)
def test_clip_preprocess_matches_clip_image_processor(height, width):
    from transformers import CLIPImageProcessorPil

    images = torch.rand(
        2, 3, height, width, generator=torch.Generator().manual_seed(height * width)
    )
    ours = preprocess.clip_preprocess(images, 224)
    reference = CLIPImageProcessorPil()(
        images=[to_pil(image) for image in images], return_tensors="pt"
    )["pixel_values"]
    assert ours.shape == reference.shape == (2, 3, 224, 224)
    # Pillow's fixed-point resize is reproduced exactly; what remains is float32 normalisation
    assert torch.allclose(ours, reference, rtol=0, atol=1e-6)


def clip_reference(folder, size, texts, images):
    """(model, output) of transformers' CLIPModel saved in `folder` on `texts` and the PIL `images`,
    through its tokenizer and CLIPImageProcessorPil at `size` pixels."""
    from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel

    model = CLIPModel.from_pretrained(folder).eval()
    tokens = AutoTokenizer.from_pretrained(folder)(texts, padding=True, return_tensors="pt")
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        return model, model(**tokens, pixel_values=pixels)


def test_clip_reward_matches_transformers(tiny_clip):
    reward = rewards.load_reward("clip", ImageBackbone(), checkpoint=tiny_clip, batch_size=3)
    assert reward.image_size == 64
    images = torch.rand(5, 3, 40, 56, generator=torch.Generator().manual_seed(2))
    prompts = ["a red cube", "a dog", "a red cube", "two cats", "a handwritten 3"]
    scores = reward(images, prompts, None, None)
    assert scores.dtype == torch.float32 and scores.shape == (5,)
    model, out = clip_reference(tiny_clip, 64, prompts, [to_pil(image) for image in images])
    expected = 100 * out.logits_per_image.diagonal() / model.logit_scale.exp()
    assert torch.allclose(scores, expected, rtol=1e-4, atol=1e-4)
