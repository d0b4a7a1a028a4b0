"""The training reward: the weighted sum of named rewards (``reward.weights``), each on images or on the chosen frames
of clips (:mod:`.clips`); a pointwise reward on the whole batch, a groupwise one once per prompt group
(:mod:`.groupwise`)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .base import RewardError, RewardFn, make_reward
from .clips import on_frames
from .groupwise import score_groups

__all__ = ["make_weighted_reward"]


def make_weighted_reward(
    weights: Mapping[str, float], options: Mapping[str, Mapping[str, Any]] | None = None,
    frames: str | int | Sequence[int] = "all",
) -> RewardFn:
    """``Σ_k w_k · reward_k``; ``info`` holds each component's per-image values under ``reward/<name>``. Clips
    ``(B, F, 3, H, W)`` are scored on the frames ``frames`` chooses, averaged per clip (:mod:`.clips`).

    The returned ``fn(images, prompts, metadata, groups=None)`` calls a pointwise reward once on the whole batch and
    a groupwise reward once per group of ``groups`` (the (B,) group id of each image, its prompt: the trainer's
    ``Trajectory.group_ids``), which a groupwise reward needs."""
    if not weights:
        raise RewardError("at least one reward with a weight is needed.")
    options = options or {}
    fns = {name: on_frames(make_reward(name, **dict(options.get(name, {}))), frames) for name in weights}

    def fn(images, prompts, metadata, groups=None):
        total = torch.zeros(len(prompts), dtype=torch.float32)
        info: dict[str, Any] = {}
        for name, w in weights.items():
            if getattr(fns[name], "kind", "pointwise") == "groupwise":
                r, extra = score_groups(fns[name], name, images, prompts, metadata, groups)
            else:
                r, extra = fns[name](images, prompts, metadata)
            r = r.detach().float().cpu()
            total += float(w) * r
            info[f"reward/{name}"] = r
            info.update({f"reward/{name}/{k}": v for k, v in extra.items()})
        return total, info

    fn.groupwise = any(getattr(f, "kind", "pointwise") == "groupwise" for f in fns.values())
    return fn
