"""The per-step PPO-clip GRPO loss on one denoising step (paper Eq. 4; cleanrl's ``ppo.py`` naming).

``ratio = exp(log_prob − old_log_prob)``; ``L = mean_i max(−A_i·ratio, −A_i·clip(ratio, 1 − ε, 1 + ε))``, plus
``β·KL`` between the current and reference transition kernels under one of two named conventions
(:data:`KL_CONVENTIONS`), which differ by a factor ``1/(−dt)`` per step (25×, 12× and 3.7× at steps 0, 4 and 8 of a
10-step schedule), so a β means something only with its convention:

- ``"gaussian"``: the kernels' own KL, ``mean‖μ_θ − μ_ref‖² / (2·std²)`` with the step's std (``s·√(−dt)`` for the
  Flow-GRPO SDE);
- ``"flow_grpo"``: Flow-GRPO's (scripts/train_sd3.py), ``mean‖μ_θ − μ_ref‖² / (2·s²)`` with its ``std_dev_t`` = s,
  the SDE's noise scale before the step's ``√(−dt)``: a β taken from a Flow-GRPO recipe (0.04) needs this one.

``approx_kl = ½·mean(log_ratio²)`` and ``clipfrac`` are diagnostics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["KL_CONVENTIONS", "PpoStepLoss", "kernel_kl", "ppo_step_loss"]

KL_CONVENTIONS: tuple[str, ...] = ("gaussian", "flow_grpo")


class PpoStepLoss(NamedTuple):
    loss: torch.Tensor  # () differentiable policy loss (+ β·KL)
    policy_loss: torch.Tensor  # () detached
    kl: torch.Tensor  # () detached KL to the reference (0 without one)
    approx_kl: torch.Tensor  # () detached ½·mean((log_prob − old_log_prob)²)
    clipfrac: torch.Tensor  # () detached fraction of samples with |ratio − 1| > clip_range


def kernel_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, *, convention: str = "gaussian",
              dt: float | torch.Tensor | None = None) -> torch.Tensor:
    """() the step's KL to the reference, averaged over images and dimensions: the β term's KL and ``train/kl_ref``'s
    estimate. ``"gaussian"``: KL(N(μ_θ, std²) ‖ N(μ_ref, std²)); ``"flow_grpo"``: Flow-GRPO's ``‖Δμ‖²/(2·s²)`` with
    ``s² = std²/(−dt)`` (needs ``dt = σ_next − σ``). Samples whose step has zero noise (``std`` 0) have no density and
    add 0."""
    if convention not in KL_CONVENTIONS:
        raise ValueError(f"the KL convention must be one of {KL_CONVENTIONS}, got {convention!r}.")
    var = std**2
    if convention == "flow_grpo":
        if dt is None:
            raise ValueError("the flow_grpo KL divides by the SDE's s² = std²/(−dt): it needs the step's dt.")
        var = var / -torch.as_tensor(dt, dtype=std.dtype, device=std.device)
    dims = tuple(range(1, mean.ndim))
    sq = ((mean - ref_mean.detach()) ** 2).mean(dim=dims, keepdim=True)
    noiseless = var == 0
    return torch.where(noiseless, torch.zeros_like(sq), sq / (2.0 * torch.where(noiseless, 1.0, var))).mean()


def ppo_step_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_convention: str = "gaussian",
    dt: float | torch.Tensor | None = None,
) -> PpoStepLoss:
    """GRPO loss of one step for a batch of B images.

    Args:
        log_prob: (B,) log-probability of the stored next latents under the current policy.
        old_log_prob: (B,) the rollout's log-probability.
        advantages: (B,) group advantages (already clipped).
        clip_range: PPO's ε_c.
        mean, ref_mean, std: the step's mean under the current and reference policies and its std, for the KL term
            (needed when ``beta > 0``).
        beta: KL coefficient.
        kl_convention: ``"gaussian"`` or ``"flow_grpo"`` (module docstring; :func:`kernel_kl`), with the step's ``dt``
            for the latter.
    """
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(ratio.dtype)
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(pg_loss1, pg_loss2).mean()
    if beta > 0:
        if mean is None or ref_mean is None or std is None:
            raise ValueError("beta > 0 needs mean, ref_mean and std for the KL term.")
        kl = kernel_kl(mean, ref_mean, std, convention=kl_convention, dt=dt)
        loss = policy_loss + beta * kl
    else:
        kl = policy_loss.new_zeros(())
        loss = policy_loss
    with torch.no_grad():
        approx_kl = 0.5 * (log_ratio**2).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_range).to(ratio.dtype).mean()
    return PpoStepLoss(loss, policy_loss.detach(), kl.detach(), approx_kl, clipfrac)
