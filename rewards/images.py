"""
Decoded images as the reward models read them: quantised to 8 bits as a saved image is, CLIP's
preprocessing on tensors. Shared by the reward modules, none of which imports it back.
"""

import torch

# OpenAI CLIP's normalisation, used by both HPS (open_clip/constants.py) and CLIPImageProcessor
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def quantize(images):
    """(N, 3, H, W) floats -> the same images at 8 bits, as saved (rounded, like diffusers)."""
    return (images.float().clamp(0.0, 1.0) * 255.0).round() / 255.0


def normalize(images, mean=CLIP_MEAN, std=CLIP_STD):
    mean = torch.tensor(mean, device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
    std = torch.tensor(std, device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
    return (images - mean) / std


def clip_preprocess(images, size=224):
    """(N, 3, H, W) in [0, 1] -> (N, 3, size, size), as transformers' CLIPImageProcessor (PIL
    backend, the preprocessing CLIP was trained with) does to an 8-bit image: shortest side to
    `size` (long side int(size * long / short)) with Pillow's bicubic resize, centre crop (offset
    (H - size) // 2), /255, OpenAI CLIP mean/std. The resize runs per image on the CPU."""
    import numpy as np
    from PIL import Image

    pixels = (quantize(images) * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1)  # (N, H, W, 3)
    height, width = images.shape[-2:]
    if height <= width:
        new_height, new_width = size, int(size * width / height)
    else:
        new_height, new_width = int(size * height / width), size
    resized = [
        np.asarray(Image.fromarray(array).resize((new_width, new_height), Image.BICUBIC))
        for array in pixels.cpu().numpy()
    ]
    top, left = (new_height - size) // 2, (new_width - size) // 2
    cropped = np.stack(resized)[:, top : top + size, left : left + size]  # (N, size, size, 3)
    cropped = torch.from_numpy(cropped).permute(0, 3, 1, 2).float().div(255.0)  # (N, 3, size, size)
    return normalize(cropped.to(images.device))
