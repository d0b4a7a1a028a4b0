"""Group-relative advantages of GRPO (Shao et al. 2024; Flow-GRPO, DanceGRPO).

``A_i = (r_i − mean_group) / (std_group + eps)`` over the images of one prompt, clipped to ``±clip``. The standard
deviation is the population one (``numpy.std``, as Flow-GRPO's per-prompt stat tracker). With ``global_std`` the
denominator is the std of the whole batch instead (Flow-GRPO's ``global_std`` option), which keeps near-constant
groups from having their noise blown up.

A mix of rewards is normalised in one of two ways (:func:`mixed_advantages`): ``sum`` standardises the weighted sum
(Flow-GRPO's multi-reward scoring), ``per_reward`` standardises each reward on its own and sums the weighted
advantages (as DanceGRPO combines its HPS and CLIP advantages), so that each reward counts by its weight whatever its
spread.
"""

from __future__ import annotations

import torch

import math
from typing import Mapping

__all__ = ["group_advantages", "mixed_advantages"]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    eps: float = 1e-4,
    clip: float = 5.0,
    global_std: bool = False,
) -> torch.Tensor:
    """Per-group standardised rewards.

    Args:
        rewards: (B,) scalar reward per image.
        group_ids: (B,) integer id of each image's group (its prompt); any integers, any order.
        eps: added to the std; a group whose rewards are all equal gets advantages of exactly 0.
        clip: advantages are clipped to ``[-clip, clip]``.
        global_std: divide by the std of the whole batch instead of the group's.

    Returns:
        (B,) advantages, float64 if ``rewards`` is float64 else float32.
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of the same length, got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}."
        )
    if clip <= 0 or eps < 0:
        raise ValueError(f"clip must be positive and eps non-negative, got clip={clip}, eps={eps}.")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (B,) dense group index
    n_groups = int(inverse.max()) + 1 if r.numel() else 0
    counts = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    means = torch.zeros_like(counts).index_add_(0, inverse, r) / counts
    centred = r - means[inverse]  # (B,)
    if global_std:
        std = centred.new_full(r.shape, float(r.std(unbiased=False)) if r.numel() else 0.0)
    else:
        var = torch.zeros_like(counts).index_add_(0, inverse, centred**2) / counts
        std = var.sqrt()[inverse]
    # A constant group has centred == 0 exactly; keep it 0 even when eps == 0 (no 0/0).
    adv = torch.where(centred == 0, torch.zeros_like(centred), centred / (std + eps))
    return adv.clamp(-clip, clip)


def mixed_advantages(
    rewards: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_ids: torch.Tensor,
    *,
    normalize: str = "sum",
    eps: float = 1e-4,
    clip: float = 5.0,
    global_std: bool = False,
) -> torch.Tensor:
    """Advantages of a weighted mix of rewards.

    Args:
        rewards: name -> (B,) reward per image; every name of ``weights`` must be present.
        weights: name -> weight w_k.
        group_ids: (B,) group of each image.
        normalize: ``"sum"``: ``group_advantages(Σ_k w_k r_k)``; ``"per_reward"``:
            ``clip(Σ_k w_k · group_advantages(r_k, clip=∞))``.
        eps, clip, global_std: as in :func:`group_advantages`.

    Returns:
        (B,) advantages.
    """
    missing = [k for k in weights if k not in rewards]
    if missing:
        raise ValueError(f"no rewards given for {missing[0]!r}.")
    if normalize == "sum":
        total = sum(float(w) * rewards[k] for k, w in weights.items())
        return group_advantages(total, group_ids, eps=eps, clip=clip, global_std=global_std)
    if normalize != "per_reward":
        raise ValueError(f"normalize must be 'sum' or 'per_reward', got {normalize!r}.")
    if clip <= 0:
        raise ValueError(f"clip must be positive, got clip={clip}.")
    total = sum(float(w) * group_advantages(rewards[k], group_ids, eps=eps, clip=math.inf, global_std=global_std)
                for k, w in weights.items())
    return total.clamp(-clip, clip)
