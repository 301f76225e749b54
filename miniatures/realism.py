"""
How realistic the miniatures' samples are, against real handwritten digits no miniature saw:

- Frechet distance (Heusel et al., 2017, FID) between Gaussians fitted to the features of samples
  and of real images, |mu_s - mu_r|^2 + Tr(S_s + S_r - 2 (S_s S_r)^(1/2)).
- k-NN precision and recall (Kynkaanniemi et al., 2019, "Improved Precision and Recall Metric for
  Assessing Generative Models"): precision is the share of samples inside some real feature's ball
  (reaching its k-th nearest real neighbour), recall the share of real images inside some sample's
  ball. k = 3 as in the paper.

The features are the leading principal components of the reference images' pixels, grey for the
digits, RGB for mini-mix's colour (FID's Inception features have no 16x16 counterpart that sees
blur). Both measures depend on N, so every table gives the real-against-real value at the same N
(`floor`).
"""

import torch

from miniatures.data import digit_splits
from miniatures.mix import mix_splits
from prompts import context_noise
from rewards.images import quantize

COMPONENTS = 32  # principal components kept
NEIGHBOURS = 3  # k of the k-NN balls (Kynkaanniemi et al.'s default)


def pixels_of(images, colour=False):
    """(N, 3, H, W) images in [0, 1] -> (N, H*W) float64 grey pixels of their 8-bit form, or with
    `colour` (N, 3*H*W) RGB ones."""
    pixels = quantize(images)
    return (pixels if colour else pixels.mean(1)).flatten(1).double()


class FeatureSpace:
    """PCA of the reference images' pixels (grey or colour), fitted once: (N, 3, H, W) -> (N,
    COMPONENTS)."""

    def __init__(self, reference_images, components=COMPONENTS, colour=False):
        self.colour = colour
        pixels = pixels_of(reference_images, colour)
        self.mean = pixels.mean(0)
        _, _, directions = torch.linalg.svd(pixels - self.mean, full_matrices=False)
        self.directions = directions[:components].T  # (H*W, components)

    def __call__(self, images):
        return (pixels_of(images, self.colour) - self.mean) @ self.directions


def frechet_distance(features, reference):
    """Frechet distance between Gaussians fitted to two feature sets (N, D) and (M, D)."""
    mean_a, mean_b = features.mean(0), reference.mean(0)
    cov_a, cov_b = features.T.cov(), reference.T.cov()
    # Tr((A B)^(1/2)) = Tr((A^(1/2) B A^(1/2))^(1/2)), a symmetric PSD matrix: exact by eigh
    values, vectors = torch.linalg.eigh(cov_a)
    root_a = vectors @ torch.diag(values.clamp(min=0).sqrt()) @ vectors.T
    cross = torch.linalg.eigvalsh(root_a @ cov_b @ root_a).clamp(min=0).sqrt().sum()
    return ((mean_a - mean_b).square().sum() + cov_a.trace() + cov_b.trace() - 2 * cross).item()


def knn_radii(features, k=NEIGHBOURS):
    """Distance of each point to its k-th nearest other point of the same set."""
    return torch.cdist(features, features).kthvalue(k + 1, dim=1).values  # the first: itself


def precision_recall(features, reference, k=NEIGHBOURS):
    """Kynkaanniemi et al.'s (precision, recall) of samples `features` against `reference`."""
    distances = torch.cdist(features, reference)  # (N, M)
    precision = (distances <= knn_radii(reference, k)[None, :]).any(1).double().mean()
    recall = (distances <= knn_radii(features, k)[:, None]).any(0).double().mean()
    return precision.item(), recall.item()


class Realism:
    """The realism measures of sample images against `reference` real images (N, 3, H, W); the
    floor from `unseen`, other real images of the same kind."""

    def __init__(self, reference, unseen, colour=False):
        self.space = FeatureSpace(reference, colour=colour)
        self.reference = self.space(reference)
        self.unseen = unseen

    def __call__(self, images):
        """images (N, 3, H, W) in [0, 1] -> dict(frechet, precision, recall)."""
        features = self.space(images)
        precision, recall = precision_recall(features, self.reference)
        frechet = frechet_distance(features, self.reference)
        return dict(frechet=frechet, precision=precision, recall=recall)

    def floor(self, count):
        """The measures of `count` unseen real images (all when `count` is larger): what samples as
        real as the data would score at this N."""
        order = torch.randperm(len(self.unseen), generator=torch.Generator().manual_seed(0))
        return self(self.unseen[order][:count])


def realism_measure(backbone=None):
    """Realism against the reference digits (mini-mix: its reference images, in colour), its floor
    from the preference scorer's (both unseen by every miniature; miniatures/data.py, mix.py)."""
    if backbone == "mini-mix":
        splits = mix_splits()
        return Realism(splits["reference"][0], splits["preference"][0], colour=True)
    splits = digit_splits()
    return Realism(splits["reference"][0], splits["preference"][0])


@torch.no_grad()
def sample_images(backbone, method, prompts, seeds, batch_size=128):
    """The decoded 8-bit images (N, 3, H, W) in [0, 1] of the contexts (prompts[i], seeds[i])
    sampled with `method` (evaluate.py's: noise, cond -> times, or -> (times, latents))."""
    images = []
    for start in range(0, len(prompts), batch_size):
        noise = context_noise(backbone, seeds[start : start + batch_size])
        cond = backbone.encode_prompts(prompts[start : start + batch_size])
        used = method(noise, cond)
        latents = used[1] if isinstance(used, tuple) else backbone.sample(noise, cond, used)
        images.append(quantize(backbone.decode(latents)).clamp(0, 1).cpu())
    return torch.cat(images)


def realism_table(backbone, methods, prompts, seeds, realism):
    """method name -> the realism of its samples of the contexts (prompts[i], seeds[i])."""
    return {
        name: realism(sample_images(backbone, method, prompts, seeds))
        for name, method in methods.items()
    }


def realism_report(backbone, methods, prompts, seeds):
    """train.py's realism rows on a miniature, printed: each method's, and the floor of unseen real
    digits at the same N (eval.json's "realism" and "realism_floor"); none for too few contexts."""
    if len(seeds) <= NEIGHBOURS:  # a k-NN ball needs k other samples
        print(f"realism left out: it needs more than {NEIGHBOURS} held-out contexts")
        return {}
    measure = realism_measure(backbone.name)
    realism = realism_table(backbone, methods, prompts, seeds, measure)
    floor = measure.floor(len(seeds))
    print("realism against real images (Frechet distance lower, precision and recall higher):")
    real = f"unseen real images, the same {len(seeds)}"  # what data as real as the data scores
    for name, row in {**realism, real: floor}.items():
        print(f"  {name}: " + ", ".join(f"{key} {value:.3f}" for key, value in row.items()))
    return dict(realism=realism, realism_floor=floor)
