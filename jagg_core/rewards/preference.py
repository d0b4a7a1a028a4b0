"""``toy_preference``: the embedded default's preference score, playing HPSv2.1's part in the paper's reward mix.

The JAGG paper (arXiv:2607.17572) trains on HPSv2.1 + CLIPScore: a dense learned *preference* score plus an
*alignment* score. ``toy_fidelity`` is the toy's alignment score; it is set by a few discrete outcomes (which shape,
which cell, which colour) and its GRPO gradient is almost pure noise at CPU batch sizes (docs/toy_rl.md).
``toy_preference`` is the dense one. It prefers what a person prefers in this world, the same way for every prompt —
crisp, clean, complete pictures — and moves smoothly with every small improvement of the pixels. Of the prompt it
reads only how many objects it asks for; which shapes, colours, places and background is ``toy_fidelity``'s job.

``preference = clean · complete``

- ``clean``: the mean over pixels of ``exp(−d²/(2·clean_sigma²))``, ``d`` the RGB distance to the nearest colour
  of the world's palette (objects and backgrounds). Muddy, noisy or off-palette pixels lower it; a render scores 1.
  On its own it is hacked by emptiness (a blank canvas is perfectly clean), hence the product.
- ``complete``: with smooth memberships ``exp(−d²/(2·sigma²))`` in "any object colour" and in each background,
  every cell's best-fitting shape template (soft IoU, any shape and size); ``objects`` is the mean IoU of the n
  best-drawn cells, n the prompt's object count (missing or half-drawn objects lower it); ``background`` the match of
  the best-fitting background outside those n shapes; ``precision`` the share of the paint inside them (extra
  objects, stray paint). ``complete = objects · (1 − w_b − w_p + w_b · background + w_p · precision)``. A blank
  canvas has no objects, a one-colour canvas no background and no precision: both score near 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Mapping, Sequence

import numpy as np
from pydantic import Field

from ..setup.options import Share
from .base import RewardError, register_reward
from .toy import _K, _PALETTE, _geometry, _parse, _pixels, palette_d2, toy_world_reward

if TYPE_CHECKING:
    import torch

__all__ = ["preference_components", "toy_preference"]

SIGMA = 60.0  # RGB units: width of the smooth colour memberships of `complete`
CLEAN_SIGMA = 40.0  # RGB units: width of the clean-colour kernel


def preference_components(
    images: np.ndarray, prompts: Sequence[str], *, sigma: float = SIGMA, clean_sigma: float = CLEAN_SIGMA,
    w_background: float = 0.4, w_precision: float = 0.4,
) -> dict[str, np.ndarray]:
    """``clean``, ``objects``, ``background``, ``precision``, ``complete`` and ``preference`` of each image, each
    (B,) float64.

    ``images``: (B, H, W, 3) RGB in [0, 255], H == W.
    """
    images = np.asarray(images, dtype=np.float64)
    if images.ndim != 4 or images.shape[-1] != 3 or images.shape[1] != images.shape[2]:
        raise ValueError(f"images must be square RGB (B, H, W, 3), got shape {images.shape}.")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts.")
    b_count, size = images.shape[0], images.shape[1]
    d2 = palette_d2(images).reshape(b_count, len(_PALETTE), size * size)  # (B, K + G, HW)
    clean = np.exp(-d2.min(1) / (2.0 * clean_sigma**2)).mean(1)  # (B,)
    member = np.exp(-d2 / (2.0 * sigma**2))
    paint, backgrounds = member[:, :_K].max(1), member[:, _K:]  # (B, HW) any object colour, (B, G, HW)

    flat, counts, cell_of = _geometry(size)  # (S·Z·9, HW), (S, Z, 9), (HW, 9)
    overlap = (paint @ flat.T).reshape(b_count, *counts.shape)  # (B, S, Z, 9)
    iou = overlap / (counts + (paint @ cell_of)[:, None, None, :] - overlap)  # soft IoU of each template in its cell
    best = iou.reshape(b_count, -1, 9).max(1)  # (B, 9): the best-fitting shape of each cell
    best_template = iou.reshape(b_count, -1, 9).argmax(1)  # (B, 9) index into (S·Z)
    masks = flat.reshape(-1, 9, size * size) > 0  # (S·Z, 9, HW)

    out = {k: np.empty(b_count) for k in ("objects", "background", "precision")}
    for b, prompt in enumerate(prompts):
        n = min(9, len(_parse(prompt).objects))
        cells = np.argsort(-best[b], kind="stable")[:n]  # the n best-drawn cells
        out["objects"][b] = best[b, cells].mean()
        placed = np.zeros(size * size, dtype=bool)
        for k in cells:
            placed |= masks[best_template[b, k], k]
        outside = backgrounds[b][:, ~placed].mean(1)  # (G,)
        g = int(outside.argmax())
        out["background"][b] = outside[g]
        foreground = 1.0 - backgrounds[b, g]  # paint that is not this background
        out["precision"][b] = (foreground[placed].sum() + 1e-6) / (foreground.sum() + 1e-6)
    complete = out["objects"] * (1.0 - w_background - w_precision + w_background * out["background"]
                                 + w_precision * out["precision"])
    return {"clean": clean, **out, "complete": complete, "preference": clean * complete}


_WIDTH = Annotated[float, Field(gt=0, le=1000)]  # RGB units


@register_reward("toy_preference", describe=toy_world_reward("toy_preference"), options={"sigma": (_WIDTH, None), "clean_sigma": (_WIDTH, None),
                                            "w_background": (Share, None), "w_precision": (Share, None)})
def toy_preference(sigma: float = SIGMA, clean_sigma: float = CLEAN_SIGMA, w_background: float = 0.4,
                   w_precision: float = 0.4):
    """Clean, complete pictures of the prompt, in [0, 1]; ground-truth renders score about 0.99 (the smooth memberships overlap a little).

    Args:
        sigma: width, in RGB units, of the smooth colour membership the completeness term uses.
        clean_sigma: width, in RGB units, of the kernel that scores a pixel's distance to the palette.
        w_background: weight of the background term inside ``complete``.
        w_precision: weight of the precision term (no unrequested paint) inside ``complete``.
    """
    import torch

    for name, value in (("sigma", sigma), ("clean_sigma", clean_sigma)):
        if not 0 < value <= 255:
            raise RewardError(f"toy_preference: {name} must be in (0, 255] RGB units, got {value!r}.")
    if not (0 <= w_background and 0 <= w_precision and w_background + w_precision <= 1):
        raise RewardError(
            f"toy_preference: w_background and w_precision must be non-negative with a sum of at most 1, "
            f"got {w_background!r} and {w_precision!r}."
        )

    def fn(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]):
        parts = preference_components(_pixels(images), prompts, sigma=sigma, clean_sigma=clean_sigma,
                                      w_background=w_background, w_precision=w_precision)
        info = {k: torch.from_numpy(parts[k]).float() for k in ("clean", "complete", "objects")}
        return torch.from_numpy(parts["preference"]).float(), info

    return fn
