"""The registry of backward modes: the one list that ``jagg.group_backward``, ``plan_groups`` and the configuration
accept (torch-free, so the configuration can validate against it without importing the algorithm).

Each mode names how one group of W consecutive steps gets its gradient (arXiv:2607.17572, §Method; the map of the
code is docs/architecture.md).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["BACKWARD_MODES", "EXACT_MODES", "MODES", "RANDOM_ANCHOR", "VARIANTS", "anchor_positions",
           "placed_anchors"]

BACKWARD_MODES: dict[str, str] = {
    "exact": "every step forwards with grad and backwards on its own: W forwards, W backwards (the baseline)",
    "exact_batched": "the exact gradient with all W steps in ONE with-grad forward call and ONE backward",
    "jagg": "JAGG (Eq. 7): K anchors with grad, middle steps under no_grad, signals t-interpolated onto the anchors",
    "ablate": "the endpoint-only ablation: the anchors keep only their own signals, middle signals are discarded",
    "ablate_matched": "the ablation weight-matched: each of the K anchors keeps its own signal scaled by W/K",
}
MODES: tuple[str, ...] = tuple(BACKWARD_MODES)
EXACT_MODES: tuple[str, ...] = ("exact", "exact_batched")  # the exact gradient: every group routed, no anchors
VARIANTS: tuple[str, ...] = ("joint", "sequential")  # of the anchored modes: one backward over all anchors, or one each
# of the jagg mode: one more anchor drawn at random (unbiased JAGG, jagg.random_anchor): per group, or per image
RANDOM_ANCHOR: tuple[str, ...] = ("group", "image")


def anchor_positions(window: int, anchors: int = 2) -> tuple[int, ...]:
    """Indices of the K anchors in a group of W steps: evenly spread, always including both endpoints."""
    if window < 2:
        raise ValueError(f"window must be at least 2, got {window}.")
    if not 2 <= anchors <= window:
        raise ValueError(f"anchors must be between 2 and the window ({window}), got {anchors}.")
    return tuple(round(k * (window - 1) / (anchors - 1)) for k in range(anchors))


def placed_anchors(window: int, anchors: int = 2, anchor_at: Sequence[int] | None = None) -> tuple[int, ...]:
    """The anchors of a group: ``anchor_at`` as given (both endpoints included, strictly increasing), else
    :func:`anchor_positions`' K evenly spread. Torch-free: the configuration checks a method with it before any work,
    the algorithm routes its groups with it."""
    if anchor_at is None:
        return anchor_positions(window, anchors)
    pos = tuple(int(a) for a in anchor_at)
    if len(pos) < 2 or pos[0] != 0 or pos[-1] != window - 1 or any(b <= a for a, b in zip(pos, pos[1:])):
        raise ValueError(f"anchor_at must increase strictly from 0 to the window's last step ({window - 1}), "
                         f"got {list(pos)}.")
    return pos
