"""Group-relative advantages of GRPO (Shao et al. 2024; Flow-GRPO, DanceGRPO).

``A_i = (r_i − mean_group) / (std_group + eps)`` over the images of one prompt, clipped to ``±clip``. The standard
deviation is the population one (``numpy.std``, as Flow-GRPO's per-prompt stat tracker). With ``global_std`` the
denominator is the std of the whole batch instead (Flow-GRPO's ``global_std`` option), which keeps near-constant
groups from having their noise blown up.
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages"]


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
