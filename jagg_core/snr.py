"""The signal-to-noise ratio of a stochastic gradient estimate, from independent estimates of it.

A GRPO gradient from N images is ``g = μ + noise`` with ``E[noise] = 0`` and ``E‖noise‖² = tr Σ / N`` (Σ: the
covariance of one image's contribution). From K independent estimates ``g_1 … g_K`` of N images each:

- ``‖μ‖²`` is estimated without bias by the mean of the pairwise inner products ``⟨g_i, g_j⟩``, i ≠ j (the cross
  terms have expectation ‖μ‖²; the squared norms, which also carry the noise, are left out);
- ``tr Σ / N`` by the sample variance ``Σ_k ‖g_k − ḡ‖² / (K − 1)``.

Their ratio times 1/N is the *per-image* signal-to-noise ratio ``ρ₁ = ‖μ‖² / tr Σ``: the number of images it takes
for the drift along the true gradient to match the random walk is about ``1/ρ₁`` (docs/toy_rl.md). Estimates that
reuse the same rollouts with other advantages (two rewards on the same images) are still independent across k.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["gradient_snr"]


def gradient_snr(grads: Sequence[torch.Tensor], images_per_estimate: int) -> dict[str, float]:
    """Per-image signal-to-noise ratio from K ≥ 3 independent flat gradient estimates of ``images_per_estimate``
    images each.

    Returns ``signal`` (the estimate of ‖μ‖²), its standard error ``signal_se`` (from the spread of the pairwise
    products, treated as independent: an approximation that is good when the noise dominates), ``noise`` (of
    tr Σ / N), ``snr_per_image`` (signal / (N · noise)), its standard error, and ``cos_pairs`` (the mean pairwise
    cosine, ≈ ρ / (1 + ρ) with ρ = N · ρ₁).
    """
    k = len(grads)
    if k < 3:
        raise ValueError(f"need at least 3 independent gradient estimates, got {k}.")
    if images_per_estimate < 1:
        raise ValueError(f"images_per_estimate must be positive, got {images_per_estimate}.")
    g = torch.stack([x.reshape(-1).double() for x in grads])  # (K, P)
    gram = g @ g.T  # (K, K)
    i, j = torch.triu_indices(k, k, offset=1)
    cross = gram[i, j]  # (K(K−1)/2,) pairwise inner products
    signal = float(cross.mean())
    signal_se = float(cross.std() / math.sqrt(cross.numel()))
    noise = float(((g - g.mean(0)) ** 2).sum() / (k - 1))
    norms = gram.diagonal().sqrt()
    cos = float((cross / (norms[i] * norms[j] + 1e-300)).mean())
    scale = 1.0 / (images_per_estimate * noise) if noise > 0 else float("nan")
    return {"signal": signal, "signal_se": signal_se, "noise": noise, "snr_per_image": signal * scale,
            "snr_per_image_se": signal_se * scale, "cos_pairs": cos, "estimates": k,
            "images_per_estimate": images_per_estimate}
