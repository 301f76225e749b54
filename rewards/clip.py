"""
CLIP image-text similarity through transformers (no torchvision): a lighter prompt-alignment
reward than HPSv2.
"""

import torch
import torch.nn.functional as F

from rewards.hps import unique_prompts
from rewards.images import clip_preprocess

CLIP_DEFAULT = "openai/clip-vit-large-patch14"


class CLIPReward:
    """100 x cos(image, prompt) in a CLIP model's projected embedding space."""

    def __init__(self, backbone, checkpoint=CLIP_DEFAULT, device=None, batch_size=32):
        from transformers import AutoTokenizer, CLIPModel

        self.backbone = backbone
        self.device = torch.device(device or backbone.device)
        self.batch_size = batch_size
        model = CLIPModel.from_pretrained(checkpoint)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.image_size = self.model.config.vision_config.image_size
        self.max_length = self.model.config.text_config.max_position_embeddings

    def embed_text(self, prompts):
        tokens = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        ids, mask = tokens["input_ids"], tokens["attention_mask"]
        pooled = self.model.text_model(input_ids=ids, attention_mask=mask).pooler_output
        return F.normalize(self.model.text_projection(pooled), dim=-1)

    def embed_image(self, pixels):
        """(N, 3, S, S) pixels preprocessed by clip_preprocess -> (N, D) unit embeddings."""
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output
        return F.normalize(self.model.visual_projection(pooled), dim=-1)

    @torch.no_grad()
    def __call__(self, latents, prompts, noise, cond):
        pixels = clip_preprocess(self.backbone.decode(latents).to(self.device), self.image_size)
        unique, which = unique_prompts(prompts)
        starts = range(0, len(unique), self.batch_size)
        text = [self.embed_text(unique[start : start + self.batch_size]) for start in starts]
        image = torch.cat([self.embed_image(chunk) for chunk in pixels.split(self.batch_size)])
        which = torch.tensor(which, device=self.device)
        return 100.0 * (image.float() * torch.cat(text).float()[which]).sum(-1)
