"""The registry of backward modes: the one list that ``jagg.group_backward``, ``plan_groups`` and the configuration
accept (torch-free, so the configuration can validate against it without importing the algorithm).

Each mode names how one group of W consecutive steps gets its gradient (arXiv:2607.17572, §Method; the map of the
code is docs/architecture.md).
"""

from __future__ import annotations

__all__ = ["BACKWARD_MODES", "EXACT_MODES", "MODES", "RANDOM_ANCHOR", "VARIANTS"]

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
