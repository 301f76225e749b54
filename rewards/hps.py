"""
HPSv2 (Human Preference Score v2, Wu et al. 2023), the paper's reward, through hpsv2x's own
open_clip code: 100 x the cosine similarity of HPS's ViT-H-14 image and text embeddings. Needs
HPS_v2.1_compressed.pt from the hub repo xswu/HPSv2.
"""

import torch
import torch.nn.functional as F
from huggingface_hub import hf_hub_download

from rewards.images import normalize, quantize

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


def unique_prompts(prompts):
    """Distinct prompts in order and, per sample, the index of its prompt among them."""
    unique = list(dict.fromkeys(prompts))
    return unique, [unique.index(prompt) for prompt in prompts]


def hps_preprocess(images, size=224):
    """(N, 3, H, W) in [0, 1] -> (N, 3, size, size), HPS's inference transform on tensors: hpsv2
    builds it with light_augmentation=True (hpsv2/src/open_clip/factory.py), i.e. ResizeMaxSize
    (hpsv2/src/open_clip/transform.py): ToTensor on the 8-bit image, the longest side scaled to
    `size` by torchvision's antialiased bicubic resize on the float tensor (an image already that
    long left as it is), the short side zero-padded (half before, rest after), then OpenAI CLIP's
    mean and std."""
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


class HPSReward:
    """100 x cos(image, prompt) in HPS's embedding space, as hpsv2.img_score.score computes it.
    `checkpoint`: a local HPS_v2*.pt, else `version`'s file from the hub repo xswu/HPSv2 (the HF
    cache, downloaded when online); `model_name`: an open_clip model config (the tests register a
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
        from hpsv2.src import open_clip  # imports torchvision: here, not with rewards

        checkpoint = checkpoint or hf_hub_download(HPS_REPO, HPS_FILES[version])
        self.backbone = backbone
        self.device = torch.device(device or backbone.device)
        self.batch_size = batch_size
        # on its device, not the CPU; on CUDA in float16 (hpsv2's autocast); no LAION download
        precision = "fp16" if self.device.type == "cuda" else "fp32"
        with torch.device(self.device):
            model = open_clip.create_model(
                model_name, None, precision, self.device, output_dict=True
            )
        state = torch.load(checkpoint, map_location=self.device, weights_only=True)
        model.load_state_dict(state.get("state_dict", state))  # strict, as hpsv2 loads it
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(model_name)
        image_size = model.visual.image_size
        self.image_size = image_size[0] if isinstance(image_size, (tuple, list)) else image_size

    @torch.no_grad()
    def __call__(self, latents, prompts, noise, cond):
        images = self.backbone.decode(latents)
        unique, which = unique_prompts(prompts)
        tokens = self.tokenizer(unique).to(self.device)  # (P, 77)
        model, size, text, image = self.model, self.image_size, [], []
        # fp16 autocast on CUDA as hpsv2.img_score.score runs it; plain float32 elsewhere
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.device.type == "cuda"):
            for chunk in tokens.split(self.batch_size):
                text.append(model.encode_text(chunk, normalize=True))
            for chunk in images.split(self.batch_size):
                pixels = hps_preprocess(chunk.to(self.device), size)
                image.append(model.encode_image(pixels, normalize=True))
        text, image = torch.cat(text).float(), torch.cat(image).float()
        return 100.0 * (image * text[torch.tensor(which, device=self.device)]).sum(-1)
