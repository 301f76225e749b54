"""
The teacher reward: fidelity to the same frozen backbone's accurate solution from the same noise
and prompt, minus the per-sample mean squared error in latent space (0 is the best possible score).
No reward model; it works for every backbone and is the default for the embedded digits.
"""

import hashlib
from collections import OrderedDict

import torch


def context_key(noise, prompt):
    """A context's identity: hash of its noise (shape, dtype and bytes) and its prompt."""
    noise = noise.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{tuple(noise.shape)}|{noise.dtype}|{prompt}|".encode())
    digest.update(noise.reshape(-1).view(torch.uint8).numpy().tobytes())  # of any dtype, bf16 too
    return digest.hexdigest()


class TeacherReward:
    """-mean((latents - backbone.reference(noise, cond))^2) per sample.

    The cache holds up to `cache_size` teacher solutions (least recently used evicted first) on the
    CPU, so device memory does not grow with it; 4096 covers a held-out set plus the contexts of
    many training batches. A context repeated within a call is solved once.
    """

    def __init__(self, backbone, device=None, cache_size=4096):
        self.backbone = backbone
        self.device = torch.device(device or backbone.device)
        self.cache_size = cache_size
        self.cache = OrderedDict()  # context key -> teacher latents (CPU)

    @torch.no_grad()
    def __call__(self, latents, prompts, noise, cond):
        noise_cpu = noise.detach().cpu()
        keys = [context_key(noise_cpu[index], prompt) for index, prompt in enumerate(prompts)]
        unsolved = {}  # key -> index of its first sample in this call
        for index, key in enumerate(keys):
            if key in self.cache:
                self.cache.move_to_end(key)
            else:
                unsolved.setdefault(key, index)
        if unsolved:
            index = torch.tensor(list(unsolved.values()))
            sub_cond = {name: value[index.to(value.device)] for name, value in cond.items()}
            solved = self.backbone.reference(noise[index.to(noise.device)], sub_cond)
            self.cache.update(zip(unsolved, solved.detach().cpu()))
        targets = torch.stack([self.cache[key] for key in keys]).to(self.device, torch.float32)
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        error = (latents.detach().to(self.device, torch.float32) - targets) ** 2
        return -error.flatten(1).mean(1)
