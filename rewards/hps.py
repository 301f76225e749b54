"""
HPSv2 (Human Preference Score v2, Wu et al. 2023), the paper's reward, through hpsv2x's own
open_clip code: 100 x the cosine similarity of HPS's ViT-H-14 image and text embeddings. Needs the
optional environment (requirements-hps.txt) and HPS_v2.1_compressed.pt from the hub repo xswu/HPSv2.
"""

import os

import torch
import torch.nn.functional as F

from rewards.images import import_optional, normalize, quantize
from store.files import hub_file

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


def unique_prompts(prompts):
    """Distinct prompts in order and, per sample, the index of its prompt among them."""
    unique = list(dict.fromkeys(prompts))
    position = {prompt: index for index, prompt in enumerate(unique)}
    return unique, [position[prompt] for prompt in prompts]


def hps_preprocess(images, size=224):
    """(N, 3, H, W) in [0, 1] -> (N, 3, size, size), HPS's inference transform on tensors.

    hpsv2 builds its transform with light_augmentation=True (hpsv2/src/open_clip/factory.py,
    create_model_and_transforms), i.e. image_transform(..., resize_longest_max=True) in
    hpsv2/src/open_clip/transform.py: ToTensor on the 8-bit image, then ResizeMaxSize: scale the
    longest side to `size` with torchvision's bicubic resize on the float tensor (antialiased),
    zero-pad the short side (half before, rest after), OpenAI CLIP mean/std. As ResizeMaxSize
    does, an image whose longest side is already `size` is left as it is.
    """
    images = quantize(images)
    height, width = images.shape[-2:]
    scale = size / float(max(height, width))
    if scale != 1.0:
        # Python round, as ResizeMaxSize
        new_height, new_width = round(height * scale), round(width * scale)
        images = F.interpolate(
            images, (new_height, new_width), mode="bicubic", align_corners=False, antialias=True
        )
        pad_height, pad_width = size - new_height, size - new_width
        top, left = pad_height // 2, pad_width // 2
        images = F.pad(images, (left, pad_width - left, top, pad_height - top))
    return normalize(images)


def import_hps():  # hpsv2's transforms need torchvision, which fails beside a mismatched torch
    needs = "the hpsv2 reward needs hpsv2x and a matching torchvision"
    return import_optional(["torchvision", "hpsv2.src.open_clip"], needs)


class HPSReward:
    """100 x cos(image, prompt) in HPS's embedding space, as hpsv2.img_score.score computes it.
    `checkpoint`: see hps_checkpoint; `model_name`: an open_clip model config (the tests register a
    tiny one)."""

    def __init__(
        self,
        backbone,
        device=None,
        version="v2.1",
        checkpoint=None,
        model_name="ViT-H-14",
        batch_size=16,
    ):
        checkpoint = hps_checkpoint(version, checkpoint)
        open_clip = import_hps()
        self.backbone = backbone
        self.device = torch.device(device or backbone.device)
        self.batch_size = batch_size
        # pretrained=None: no LAION download, the HPS checkpoint below replaces every weight anyway
        model = open_clip.create_model(
            model_name, pretrained=None, precision="fp32", device="cpu", output_dict=True
        )
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("state_dict", state))  # strict, as hpsv2 loads it
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(model_name)
        image_size = model.visual.image_size
        self.image_size = image_size[0] if isinstance(image_size, (tuple, list)) else image_size

    @torch.no_grad()
    def __call__(self, latents, prompts, noise, cond):
        images = self.backbone.decode(latents)
        unique, which = unique_prompts(prompts)
        tokens = self.tokenizer(unique).to(self.device)  # (P, 77)
        # fp16 autocast on CUDA as hpsv2.img_score.score runs it; plain float32 elsewhere
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.device.type == "cuda"):
            text = torch.cat(
                [
                    self.model.encode_text(chunk, normalize=True)
                    for chunk in tokens.split(self.batch_size)
                ]
            )
            image = torch.cat(
                [
                    self.model.encode_image(
                        hps_preprocess(chunk.to(self.device), self.image_size), normalize=True
                    )
                    for chunk in images.split(self.batch_size)
                ]
            )
        which = torch.tensor(which, device=self.device)
        return 100.0 * (image.float() * text.float()[which]).sum(-1)


def hps_checkpoint(version="v2.1", checkpoint=None):
    """The path of the HPS checkpoint: `checkpoint` (a local HPS_v2*.pt) if given, else the HF cache
    (downloaded when online). ValueError with one line saying how to get it."""
    if version not in HPS_FILES:
        raise ValueError(f"unknown HPS version {version!r}; known: {', '.join(HPS_FILES)}")
    filename = HPS_FILES[version]
    hint = (
        f"HPS {version} checkpoint not found: get {filename} from the hub repo {HPS_REPO} "
        f"(hf download {HPS_REPO} {filename}) or pass --reward-checkpoint PATH"
    )
    if checkpoint is None:
        return hub_file(HPS_REPO, filename, hint)
    if not os.path.isfile(checkpoint):
        raise ValueError(f"{hint}; no file at {checkpoint}")
    return checkpoint
