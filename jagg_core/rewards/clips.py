"""Image rewards on clips: each reward scores chosen frames of a clip and the clip's reward is their mean.

A video backbone (``wan``) decodes clips ``(B, F, 3, H, W)``; the image rewards (HPSv2.1, PickScore, CLIPScore, the
toy ones) take images ``(B, 3, H, W)``. :func:`on_frames` wraps a reward so that it takes either: images pass through
unchanged; a clip's frames ``reward.frames`` are scored as images against the clip's prompt and averaged, as
Pref-GRPO's ``clip`` reward scores a video by CLIP on its frames. ``frames`` is one of

- ``"first"`` (Pref-GRPO's ``clip`` reward: the first frame), ``"last"``, ``"all"``;
- an integer N: N frames evenly spaced from the first to the last (``linspace(0, F − 1, N)`` rounded down, the frames
  Pref-GRPO hands its video reward model);
- a list of frame indices (negative ones count from the end).

A groupwise reward (:mod:`.groupwise`) sees, for each chosen frame, that frame of every clip of the group together,
and a clip's score is the mean over the frames: it ranks clips frame by frame, never one clip's frame against another
frame of the same clip.

Video-native rewards (a VLM judging motion and temporal coherence, Pref-GRPO's UnifiedReward-Think) are out of scope:
a mean of per-frame scores does not see motion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from .base import RewardError, RewardFn

if TYPE_CHECKING:
    import torch

__all__ = ["FRAME_CHOICES", "frame_indices", "on_frames"]

FRAME_CHOICES = ("first", "last", "all")


def frame_indices(num_frames: int, frames: str | int | Sequence[int]) -> list[int]:
    """The frame indices (in order, each once) that ``frames`` chooses from a clip of ``num_frames`` frames."""
    if isinstance(frames, str):
        if frames not in FRAME_CHOICES:
            raise RewardError(f"reward.frames must be one of {', '.join(FRAME_CHOICES)}, a count or a list of frame "
                              f"indices, got {frames!r}.")
        return {"first": [0], "last": [num_frames - 1], "all": list(range(num_frames))}[frames]
    if isinstance(frames, bool):
        raise RewardError(f"reward.frames must be a frame count or a list of frame indices, got {frames!r}.")
    if isinstance(frames, int):
        if not 1 <= frames <= num_frames:
            raise RewardError(f"reward.frames asks for {frames} frames of a clip of {num_frames}; use 1 to "
                              f"{num_frames} (or 'all').")
        if frames == 1:
            return [0]
        return sorted({(num_frames - 1) * k // (frames - 1) for k in range(frames)})
    chosen = [int(i) for i in frames]
    bad = [i for i in chosen if not -num_frames <= i < num_frames]
    if not chosen or bad:
        raise RewardError(f"reward.frames {list(frames)} names no frame or a frame outside a clip of {num_frames} "
                          f"frames (0 to {num_frames - 1}, or negative from the end).")
    return sorted({i % num_frames for i in chosen})


def _per_clip(value: Any, b: int, n: int) -> Any:
    """A per-frame (B·n,) extra → its per-clip mean (B,); scalars and other shapes pass through."""
    import torch

    if isinstance(value, torch.Tensor) and value.ndim == 1 and value.shape[0] == b * n:
        return value.detach().float().cpu().view(b, n).mean(1)
    return value


def on_frames(fn: RewardFn, frames: str | int | Sequence[int] = "all") -> RewardFn:
    """``fn`` that also takes clips ``(B, F, 3, H, W)``: the mean of its scores on the frames ``frames`` chooses."""

    kind = getattr(fn, "kind", "pointwise")

    def clip_fn(images, prompts, metadata):
        if images.ndim != 5:
            return fn(images, prompts, metadata)
        b, f = images.shape[:2]
        idx = frame_indices(f, frames)
        if kind == "groupwise":
            return _frame_by_frame(fn, images, prompts, metadata, idx)
        n = len(idx)
        flat = images[:, idx].flatten(0, 1)  # (B·n, 3, H, W), clip-major
        rewards, info = fn(flat, [p for p in prompts for _ in range(n)], [m for m in metadata for _ in range(n)])
        rewards = rewards.detach().float().cpu().view(b, n).mean(1)
        return rewards, {k: _per_clip(v, b, n) for k, v in info.items()}

    clip_fn.modules = getattr(fn, "modules", ())  # rewards_off_device still finds the networks
    clip_fn.kind = kind
    for attr in ("beside_policy", "request_size", "max_in_flight"):  # how the trainer may call it (.weighted)
        if hasattr(fn, attr):
            setattr(clip_fn, attr, getattr(fn, attr))
    return clip_fn


def _frame_by_frame(fn: RewardFn, clips: torch.Tensor, prompts, metadata, idx: list[int]):
    """A groupwise ``fn`` on each chosen frame of every clip together, averaged over the frames per clip."""
    import torch

    parts = [fn(clips[:, k], prompts, metadata) for k in idx]
    rewards = torch.stack([r.detach().float().cpu().reshape(-1) for r, _ in parts]).mean(0)
    info = {key: torch.stack([extra[key].detach().float().cpu() for _, extra in parts]).mean(0)
            for key, value in parts[0][1].items()
            if isinstance(value, torch.Tensor) and value.ndim == 1 and value.shape[0] == clips.shape[0]}
    return rewards, info
