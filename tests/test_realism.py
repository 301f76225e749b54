"""The realism measures (miniatures/realism.py) on hand-computed cases, and on real digits against
blurred and averaged ones."""

import math

import pytest
import torch

from miniatures import build as miniature
from miniatures.data import digit_splits
from miniatures.realism import (
    FeatureSpace,
    frechet_distance,
    knn_radii,
    precision_recall,
    realism_measure,
)

# four points, mean 0, unbiased covariance diag(2/3, 8/3)
CROSS = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 2.0], [0.0, -2.0]], dtype=torch.float64)


def test_frechet_distance_of_diagonal_gaussians_by_hand():
    """b = 2 a + (1, 1): |mu|^2 = 2, covariances scaled by 4, so the trace term is
    sum_i (sqrt(v_i) - sqrt(4 v_i))^2 = sum_i v_i = 2/3 + 8/3; 16/3 in all, with a and b swapped
    too, and after a common rotation (non-diagonal covariances)."""
    cos, sin = math.cos(0.7), math.sin(0.7)  # a rotation by 0.7 radians
    rotation = torch.tensor([[cos, -sin], [sin, cos]], dtype=torch.float64)
    other = 2 * CROSS + 1
    for a, b in ((CROSS, other), (other, CROSS), (CROSS @ rotation, other @ rotation)):
        assert frechet_distance(a, b) == pytest.approx(16 / 3, rel=1e-9)
    assert frechet_distance(CROSS, CROSS) == pytest.approx(0, abs=1e-9)


def test_precision_and_recall_by_hand():
    """Real points 0, 1, 2, 3 on a line with k = 1: every ball has radius 1. Samples 0.5 and 10:
    only 0.5 lies in a real ball (precision 1/2); the samples' own balls have radius 9.5, and the
    one around 0.5 holds every real point (recall 1)."""
    real = torch.tensor([[0.0], [1.0], [2.0], [3.0]], dtype=torch.float64)
    samples = torch.tensor([[0.5], [10.0]], dtype=torch.float64)
    assert knn_radii(real, k=1).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert precision_recall(samples, real, k=1) == (0.5, 1.0)
    assert precision_recall(real, real, k=1) == (1.0, 1.0)


def test_the_feature_space_is_the_reference_digits_principal_components():
    images = digit_splits()["reference"][0]
    space = FeatureSpace(images, components=8)
    features = space(images)
    assert features.shape == (len(images), 8)
    assert features.mean(0).abs().max() < 1e-9  # centred on the reference
    variances = features.var(0)
    assert (variances[:-1] >= variances[1:]).all()  # leading components first


def test_real_digits_are_more_realistic_than_blurred_or_averaged_ones():
    """Unseen real digits against the reference set, against the same digits blurred or replaced
    by their class means (the failure modes of few-step samples): a Frechet distance under half
    theirs and a higher recall; blur also lowers precision, while class means, central to the real
    digits, keep all of it (precision sees realism, recall the missing variety)."""
    realism = realism_measure()
    real, labels = digit_splits()["preference"]
    real, labels = real[:256], labels[:256]
    blurred = miniature.blurred(real, torch.full((len(real),), 1.2, dtype=real.dtype))
    means = torch.stack([real[labels == label].mean(0) for label in labels])
    sets = dict(real=real, blur=blurred, mean=means)
    scores = {name: realism(images) for name, images in sets.items()}
    for worse in ("blur", "mean"):
        assert scores["real"]["frechet"] < scores[worse]["frechet"] / 2
        assert scores["real"]["recall"] > scores[worse]["recall"] + 0.5
    assert scores["real"]["precision"] > scores["blur"]["precision"] + 0.05
    assert scores["mean"]["precision"] == 1.0
