"""jagg_core.snr.gradient_snr on synthetic gradient estimates whose signal and noise are known."""

from __future__ import annotations

import pytest
import torch

from jagg_core.snr import gradient_snr


def _estimates(mu: torch.Tensor, sigma: float, n_images: int, k: int, seed: int) -> list[torch.Tensor]:
    """K means of ``n_images`` per-image contributions μ + N(0, σ² I)."""
    g = torch.Generator().manual_seed(seed)
    return [mu + sigma * torch.randn(n_images, mu.numel(), generator=g, dtype=torch.float64).mean(0)
            for _ in range(k)]


@pytest.mark.parametrize("scale", [0.0, 0.05, 0.3])
def test_gradient_snr_recovers_the_per_image_ratio(scale):
    mu = torch.full((40,), scale, dtype=torch.float64)
    sigma, n = 1.0, 16
    est = gradient_snr(_estimates(mu, sigma, n, 400, 0), n)
    truth = float(mu @ mu) / (mu.numel() * sigma**2)  # ‖μ‖² / tr Σ
    assert abs(est["snr_per_image"] - truth) < 3 * est["snr_per_image_se"] + 1e-12, (est, truth)
    assert est["noise"] == pytest.approx(mu.numel() * sigma**2 / n, rel=0.1)  # tr Σ / N


def test_gradient_snr_needs_three_estimates():
    with pytest.raises(ValueError, match="at least 3"):
        gradient_snr([torch.zeros(3), torch.zeros(3)], 4)
