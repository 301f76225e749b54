"""The HPSv2 reward against hpsv2x's own code, with a tiny open_clip model of random weights saved
as an HPS-style checkpoint ({"state_dict": ...}) and loaded the way the real one is."""

import json

import pytest
import torch
from hpsv2.src import open_clip
from test_rewards import ImageBackbone, to_pil  # the image stand-in and the 8-bit PIL conversion

import rewards
from rewards import hps

TINY = "hps-test-tiny"  # an open_clip config registered under this name by the fixture below


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    """Register a tiny ViT config with open_clip and save random weights as an HPS checkpoint.

    Same code as ViT-H-14 (open_clip CLIP, 224 px input, the real 49408-token vocabulary and
    77-token context, so hpsv2's own tokenizer applies), only narrow and shallow."""
    folder = tmp_path_factory.mktemp("hps")
    vision = dict(image_size=224, layers=2, width=32, head_width=16, patch_size=32)
    text = dict(context_length=77, vocab_size=49408, width=32, heads=2, layers=2)
    config = dict(embed_dim=16, vision_cfg=vision, text_cfg=text)
    (folder / f"{TINY}.json").write_text(json.dumps(config))
    open_clip.add_model_config(folder / f"{TINY}.json")
    torch.manual_seed(0)
    model = open_clip.create_model(TINY, pretrained=None, output_dict=True)
    checkpoint = folder / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    return str(checkpoint)


@pytest.fixture(scope="module")
def hps_reference(tiny_hps, tmp_path_factory):
    """hpsv2.img_score.score itself, on the tiny model: its model cache is pre-filled with the
    tiny model and the transform create_model_and_transforms makes for it, exactly as
    img_score.initialize_model builds them for ViT-H-14; score() then loads the checkpoint."""
    from hpsv2 import img_score

    model, _, preprocess_val = open_clip.create_model_and_transforms(
        TINY, precision="amp", device=img_score.device, light_augmentation=True, output_dict=True
    )
    saved = dict(img_score.model_dict)
    img_score.model_dict.update(model=model, preprocess_val=preprocess_val)
    root = img_score.root_path
    img_score.root_path = str(tmp_path_factory.mktemp("hps-root"))  # score() creates this folder
    options = dict(cp=tiny_hps, hps_version="v2.1")
    yield lambda image, prompt: 100.0 * float(img_score.score(to_pil(image), prompt, **options)[0])
    img_score.model_dict.clear()
    img_score.model_dict.update(saved)
    img_score.root_path = root


@pytest.mark.parametrize(
    "height,width", [(8, 8), (48, 80), (300, 200), (1024, 1024), (224, 224), (224, 100)]
)
def test_preprocess_matches_hps_transform(tiny_hps, height, width):
    # the transform hpsv2 scores with: create_model_and_transforms(..., light_augmentation=True)
    _, _, transform = open_clip.create_model_and_transforms(TINY, None, light_augmentation=True)
    generator = torch.Generator().manual_seed(height + width)
    images = torch.rand(2, 3, height, width, generator=generator)
    ours = hps.hps_preprocess(images, 224)
    reference = torch.stack([transform(to_pil(image)) for image in images])
    assert ours.shape == reference.shape
    assert torch.allclose(ours, reference, rtol=0, atol=1e-6)


# inside hpsv2.img_score
@pytest.mark.filterwarnings("ignore:`torch.cuda.amp.autocast:FutureWarning")
def test_reward_matches_hpsv2_score(tiny_hps, hps_reference):
    reward = rewards.load_reward(
        "hpsv2", ImageBackbone(), checkpoint=tiny_hps, model_name=TINY, batch_size=3
    )
    assert reward.image_size == 224
    images = torch.rand(5, 3, 40, 56, generator=torch.Generator().manual_seed(1))
    prompts = ["a red cube", "a dog", "a red cube", "two cats, oil painting", "a handwritten 3"]
    scores = reward(images, prompts, None, None)
    assert scores.dtype == torch.float32 and scores.shape == (5,)
    expected = torch.tensor(list(map(hps_reference, images, prompts)))
    assert torch.allclose(scores, expected, rtol=0, atol=1e-4)


def test_checkpoint_loads_strictly(tiny_hps, tmp_path):
    state = torch.load(tiny_hps, weights_only=True)["state_dict"]
    state.pop("text_projection")
    incomplete = str(tmp_path / "incomplete.pt")
    torch.save({"state_dict": state}, incomplete)
    with pytest.raises(RuntimeError, match="text_projection"):
        rewards.load_reward("hpsv2", ImageBackbone(), checkpoint=incomplete, model_name=TINY)
