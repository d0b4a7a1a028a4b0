"""`colorfulness`: an example pointwise reward plugin, Hasler and Süsstrunk's colourfulness metric (2003).

A pointwise reward scores each image on its own: a factory takes the reward's options and returns
``fn(images, prompts, metadata) -> (scores, info)`` with ``images`` (B, 3, H, W) in [0, 1] and ``scores`` (B,) float32
on the CPU. Register it where it is defined, with the schema of its options (what ``reward.options.colorfulness`` is
read through before any work: a wrong type or a value out of bounds is one sentence). Use it::

    plugins: [examples/plugins/colorfulness.py]
    reward: {weights: {colorfulness: 1.0}, options: {colorfulness: {scale: 100.0}}}

docs/extending.md walks through it.
"""

from __future__ import annotations

from typing import Annotated, Any, Mapping, Sequence

import torch
from pydantic import Field

from jagg_core.rewards import register_reward


def colorfulness_of(images: torch.Tensor) -> torch.Tensor:
    """M = σ_rgyb + 0.3 · μ_rgyb on 0–255 pixels (Hasler & Süsstrunk): (B, 3, H, W) in [0, 1] -> (B,) float64."""
    r, g, b = (images.detach().to("cpu", torch.float64) * 255.0).unbind(dim=1)  # (B, H, W) each
    rg, yb = r - g, 0.5 * (r + g) - b
    std = torch.sqrt(rg.flatten(1).var(dim=1, unbiased=False) + yb.flatten(1).var(dim=1, unbiased=False))
    mean = torch.sqrt(rg.flatten(1).mean(dim=1) ** 2 + yb.flatten(1).mean(dim=1) ** 2)
    return std + 0.3 * mean


@register_reward("colorfulness", options={"scale": (Annotated[float, Field(gt=0, le=1e6)], None)},
                 describe=lambda options: f"Hasler-Süsstrunk colourfulness / {options.get('scale', 100.0):g}")
def colorfulness(scale: float = 100.0):
    """Colourfulness divided by ``scale`` (about 0 for grey images, ~1 for very colourful ones at the default)."""

    def fn(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]):
        return (colorfulness_of(images) / scale).float(), {}

    return fn
