"""Rewards in the core environment: teacher on the real digits backbone, CLIP through a tiny
randomly initialised transformers CLIPModel saved and loaded by path, the HPS loader's error
messages and tensor preprocessing. The HPS model itself is tested in tests/test_rewards_hps.py."""

import pathlib
import subprocess
import sys

import pytest
import torch
from PIL import Image

import backbones
import rewards
import rewards.images as preprocess
from rewards import hps, teacher


class ImageBackbone:
    """Stand-in whose latents are the images themselves: the image rewards only call decode."""

    device = torch.device("cpu")

    def decode(self, latents):
        return latents.float().clamp(0.0, 1.0)


def to_pil(image):
    """(3, H, W) in [0, 1] -> the 8-bit PIL image the reference transforms take."""
    pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).numpy())


# ----------------------------------------------------------------------------------------------
# common


def test_import_stays_light():
    # The core install has no torchvision, hpsv2x or easyocr: importing the scripts and rewards must
    # not need them, and a command line that fails on its input must answer before diffusers or
    # transformers load.
    heavy = (
        "torchvision",
        "hpsv2",
        "open_clip",
        "easyocr",
        "cv2",
        "easyocr_en_models",
        "transformers",
        "diffusers",
        "matplotlib",
    )
    code = (
        "import sys, train, evaluate, sample; from rewards import ocr, geneval; "
        f"print(sorted(m for m in {heavy} if m in sys.modules))"
    )
    repo = pathlib.Path(__file__).parents[1]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo
    )
    assert result.stdout.strip() == "[]"


def test_quantize_rounds_to_8_bits():
    images = torch.tensor([-0.1, 0.0, 0.5 / 255, 0.6 / 255, 0.5, 1.2])
    expected = (
        torch.tensor([0.0, 0.0, 0.0, 1.0, 128.0, 255.0]) / 255
    )  # 0.5*255 = 127.5 rounds to even 128
    assert torch.equal(preprocess.quantize(images), expected)


# ----------------------------------------------------------------------------------------------
# teacher, on the real digits backbone


@pytest.fixture(scope="module")
def digits():
    return backbones.load_backbone("digits")


class CountingBackbone:
    """Wraps a backbone and counts reference solves (calls and samples)."""

    def __init__(self, backbone):
        self.backbone, self.calls, self.solved = backbone, 0, 0
        self.device = backbone.device

    def reference(self, noise, cond):
        self.calls += 1
        self.solved += noise.shape[0]
        return self.backbone.reference(noise, cond)


@pytest.fixture(scope="module")
def digit_contexts(digits):
    """Three contexts, each repeated K = 2 times as the trainer lays out a batch; their teacher."""
    prompts = ["a handwritten 3", "a handwritten 7", "a handwritten 0"]
    noise = digits.sample_noise(3, torch.Generator().manual_seed(0))
    cond = digits.encode_prompts(prompts)
    teacher = digits.reference(noise, cond)

    def repeat(tensor):
        return tensor.repeat_interleave(2, 0)

    return (
        [p for p in prompts for _ in range(2)],
        repeat(noise),
        {k: repeat(v) for k, v in cond.items()},
        repeat(teacher),
    )


def test_teacher_scores_and_cache(digits, digit_contexts):
    prompts, noise, cond, teacher = digit_contexts
    counter = CountingBackbone(digits)
    reward = rewards.load_reward("teacher", counter)

    own = reward(teacher, prompts, noise, cond)
    # K = 2 rollouts of 3 contexts: one solve of the 3 distinct contexts, the repeats are hits
    assert (counter.calls, counter.solved, reward.misses, reward.hits) == (1, 3, 3, 3)
    assert own.dtype == torch.float32 and own.shape == (6,) and own.device == digits.device
    assert torch.equal(own, torch.zeros(6))  # the teacher's own output scores exactly 0

    times = digits.default_times(4).expand(6, -1)
    latents = digits.sample(noise, cond, times)
    scores = reward(latents, prompts, noise, cond)
    assert (counter.calls, reward.misses, reward.hits) == (1, 3, 9)  # all served from the cache
    assert torch.allclose(scores, -((latents - teacher) ** 2).mean((1, 2, 3)), rtol=1e-6, atol=0)
    assert (scores < 0).all()
    # same noise, same prompt, same teacher: the two rollouts of a context with equal latents agree
    assert torch.equal(scores[0::2], scores[1::2])


def test_teacher_context_is_noise_and_prompt(digits, digit_contexts):
    prompts, noise, cond, teacher = digit_contexts
    counter = CountingBackbone(digits)
    reward = rewards.load_reward("teacher", counter)
    pick = [0, 2]  # one rollout of contexts 0 and 1
    # the same noises under each other's prompt are other contexts with other teachers
    swapped = [prompts[2], prompts[0]]
    scores = reward(teacher[pick], swapped, noise[pick], digits.encode_prompts(swapped))
    assert (scores < 0).all()
    # the original contexts are not in the cache yet: a fresh solve, which reproduces the teacher
    scores = reward(
        teacher[pick],
        [prompts[i] for i in pick],
        noise[pick],
        {k: v[pick] for k, v in cond.items()},
    )
    assert torch.equal(scores, torch.zeros(2))
    assert (counter.calls, reward.misses, reward.hits) == (2, 4, 0)


class ToyReferenceBackbone:
    """Cheap deterministic teacher (2 x noise + label) to test the cache's bookkeeping."""

    device = torch.device("cpu")

    def __init__(self):
        self.solved = 0

    def reference(self, noise, cond):
        self.solved += noise.shape[0]
        return 2 * noise.float() + cond["label"].view(-1, 1, 1, 1).float()


def test_teacher_cache_is_bounded_lru():
    backbone = ToyReferenceBackbone()
    reward = rewards.load_reward("teacher", backbone, cache_size=2)
    noise = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    cond = dict(label=torch.tensor([0, 1, 2]))
    prompts = ["a", "b", "c"]
    scores = reward(2 * noise.float() + cond["label"].view(-1, 1, 1, 1), prompts, noise, cond)
    assert (
        torch.equal(scores, torch.zeros(3)) and len(reward.cache) == 2
    )  # oldest evicted after use
    reward(noise[1:].float(), prompts[1:], noise[1:], dict(label=cond["label"][1:]))
    assert backbone.solved == 3 and reward.hits == 2
    reward(noise[:1], prompts[:1], noise[:1], dict(label=cond["label"][:1]))
    assert backbone.solved == 4  # context "a" was evicted, solved again


def test_context_key():
    noise = torch.randn(2, 4, 3)
    assert teacher.context_key(noise[0], "p") == teacher.context_key(noise[0].clone(), "p")
    assert teacher.context_key(noise[0], "p") != teacher.context_key(noise[1], "p")
    assert teacher.context_key(noise[0], "p") != teacher.context_key(noise[0], "q")
    assert teacher.context_key(noise[0], "p") != teacher.context_key(noise[0].double(), "p")


# ----------------------------------------------------------------------------------------------
# clip, through a tiny CLIPModel saved to disk


def byte_level_vocab():
    """CLIP's byte-to-unicode alphabet, each char alone and as a word end, plus the two specials."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable + [256 + n for n in range(256 - len(printable))]
    chars = [chr(code) for code in codes]
    vocab = {char: index for index, char in enumerate(chars)}
    vocab.update({char + "</w>": index + 256 for index, char in enumerate(chars)})
    vocab.update({"<|startoftext|>": 512, "<|endoftext|>": 513})
    return vocab


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    path = tmp_path_factory.mktemp("tiny-clip")
    text = dict(
        vocab_size=514,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=512,
        eos_token_id=513,
        pad_token_id=513,
    )
    vision = dict(
        image_size=64,
        patch_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    torch.manual_seed(0)
    CLIPModel(
        CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    ).save_pretrained(path)
    CLIPTokenizer(vocab=byte_level_vocab(), merges=[], model_max_length=77).save_pretrained(path)
    return str(path)


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


def test_clip_reward_matches_transformers(tiny_clip):
    from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel

    reward = rewards.load_reward("clip", ImageBackbone(), checkpoint=tiny_clip, batch_size=3)
    assert reward.image_size == 64
    images = torch.rand(5, 3, 40, 56, generator=torch.Generator().manual_seed(2))
    prompts = ["a red cube", "a dog", "a red cube", "two cats", "a handwritten 3"]
    scores = reward(images, prompts, None, None)
    assert scores.dtype == torch.float32 and scores.shape == (5,)

    model = CLIPModel.from_pretrained(tiny_clip).eval()
    tokens = AutoTokenizer.from_pretrained(tiny_clip)(prompts, padding=True, return_tensors="pt")
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}
    )
    pixels = processor(images=[to_pil(image) for image in images], return_tensors="pt")[
        "pixel_values"
    ]
    with torch.no_grad():
        out = model(
            input_ids=tokens["input_ids"],
            attention_mask=tokens["attention_mask"],
            pixel_values=pixels,
        )
    expected = 100 * out.logits_per_image.diagonal() / model.logit_scale.exp()
    assert torch.allclose(scores, expected, rtol=1e-4, atol=1e-4)


def test_clip_prompts_follow_images(tiny_clip):
    reward = rewards.load_reward("clip", ImageBackbone(), checkpoint=tiny_clip)
    images = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    prompts = ["a red cube", "a dog", "two cats", "a handwritten 3"]
    scores = reward(images, prompts, None, None)
    order = [2, 0, 3, 1]
    assert torch.allclose(
        reward(images[order], [prompts[i] for i in order], None, None), scores[order], atol=1e-5
    )
    mismatched = reward(images, prompts[1:] + prompts[:1], None, None)
    assert (mismatched - scores).abs().min() > 1e-3


def test_clip_missing_weights_is_one_clear_line(tmp_path):
    with pytest.raises(
        ValueError, match=r"CLIP model .* not found .*--reward-checkpoint PATH"
    ) as error:
        rewards.load_reward("clip", ImageBackbone(), checkpoint=str(tmp_path / "no-such-model"))
    assert "\n" not in str(error.value)


# ----------------------------------------------------------------------------------------------
# hpsv2: what can be checked without the HPS environment


def test_hps_missing_checkpoint_path(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"HPS v2.1 checkpoint not found: get HPS_v2.1_compressed.pt from the hub repo "
        r"xswu/HPSv2 .*--reward-checkpoint PATH",
    ) as error:
        rewards.load_reward("hpsv2", ImageBackbone(), checkpoint=str(tmp_path / "missing.pt"))
    assert "\n" not in str(error.value)


def test_hps_missing_checkpoint_in_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    with pytest.raises(
        ValueError, match=r"HPS v2.0 checkpoint not found: get HPS_v2_compressed.pt .*xswu/HPSv2"
    ) as error:
        rewards.load_reward("hpsv2", ImageBackbone(), version="v2.0")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="unknown HPS version 'v3'"):
        rewards.load_reward("hpsv2", ImageBackbone(), version="v3")


def test_hps_missing_package(tmp_path, monkeypatch):
    checkpoint = tmp_path / "HPS_v2.1_compressed.pt"
    checkpoint.write_bytes(b"")
    monkeypatch.setitem(
        sys.modules, "hpsv2", None
    )  # makes `import hpsv2...` fail wherever it is installed
    with pytest.raises(
        ImportError,
        match=r"bash tests/hps_env\.sh && \. \.venv-hps/bin/activate$",
    ) as error:
        rewards.load_reward("hpsv2", ImageBackbone(), checkpoint=str(checkpoint))
    assert "\n" not in str(error.value)


def test_hps_preprocess_pads_the_short_side():
    images = torch.rand(1, 3, 30, 60, generator=torch.Generator().manual_seed(4))
    pixels = hps.hps_preprocess(images, 224)
    assert pixels.shape == (1, 3, 224, 224)
    # 30x60 -> 112x224, 56 rows of black above and below: 0 normalised is -mean/std
    black = -torch.tensor(preprocess.CLIP_MEAN) / torch.tensor(preprocess.CLIP_STD)
    assert torch.allclose(pixels[0, :, :56], black.view(3, 1, 1).expand(3, 56, 224))
    assert torch.allclose(pixels[0, :, 168:], black.view(3, 1, 1).expand(3, 56, 224))
    assert not torch.allclose(pixels[0, :, 56:57], black.view(3, 1, 1).expand(3, 1, 224))
    # a square image at the model's size is only normalised (ResizeMaxSize leaves it alone)
    square = torch.rand(2, 3, 224, 224, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(
        hps.hps_preprocess(square, 224),
        (preprocess.quantize(square) - torch.tensor(preprocess.CLIP_MEAN).view(1, 3, 1, 1))
        / torch.tensor(preprocess.CLIP_STD).view(1, 3, 1, 1),
    )


def test_check_reward_fails_fast_in_one_line(tmp_path):
    rewards.check_reward("teacher")  # needs nothing
    with pytest.raises(
        ValueError, match=r"CLIP model 'openai/clip-vit-large-patch14' not found: download it"
    ) as error:
        rewards.check_reward("clip")  # offline, not cached
    assert "\n" not in str(error.value)
    rewards.check_reward("clip", checkpoint=str(tmp_path))  # a local folder is taken as is
    try:
        import torchvision  # noqa: F401
    except Exception:  # the core environment: the HPS packages are missing
        with pytest.raises(ValueError, match="tests/hps_env.sh") as error:
            rewards.check_reward("hpsv2")
        assert "\n" not in str(error.value)


def test_no_import_circle_among_the_modules():
    """Every import between this repository's modules (top level or inside a function) points one
    way: the module graph has no cycle."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    modules = {path.stem: path for path in root.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module.split(".")[0])
        graph[name] = (targets & set(modules)) - {name}
    state = {}

    def visit(name, path):
        state[name] = "open"
        for target in graph[name]:
            assert state.get(target) != "open", f"import circle: {' -> '.join(path + [target])}"
            if target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])
