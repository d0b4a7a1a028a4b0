"""`colorfulness_rank`: an example groupwise reward plugin, a ranking within each prompt's group.

A groupwise reward sees a prompt's whole group of G images at once (``kind="groupwise"``): the trainer calls it once
per prompt group, so it can compare the images of one prompt with each other, as a pairwise-preference judge does.
Here each image scores the share of its group's other images it is more colourful than (a tie counts half), in
[0, 1]. A groupwise reward trains; it cannot be an evaluation metric (evaluation draws one image per prompt). Use it::

    plugins: [examples/plugins/colorfulness_rank.py]
    reward: {weights: {colorfulness_rank: 1.0}}

docs/extending.md walks through it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from jagg_core.rewards import register_reward


def _colorfulness(images: torch.Tensor) -> torch.Tensor:
    """Hasler and Süsstrunk's colourfulness of (G, 3, H, W) images in [0, 1]: (G,) float64."""
    r, g, b = (images.detach().to("cpu", torch.float64) * 255.0).unbind(dim=1)
    rg, yb = (r - g).flatten(1), (0.5 * (r + g) - b).flatten(1)
    return torch.sqrt(rg.var(1, unbiased=False) + yb.var(1, unbiased=False)) + 0.3 * torch.sqrt(
        rg.mean(1) ** 2 + yb.mean(1) ** 2)


@register_reward("colorfulness_rank", kind="groupwise", options={},
                 describe=lambda options: "the share of its group an image is more colourful than")
def colorfulness_rank():
    def fn(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]):
        c = _colorfulness(images)  # (G,): one prompt's group
        if len(c) < 2:
            return torch.full((len(c),), 0.5), {}
        wins = (c[:, None] > c[None, :]).double() + 0.5 * (c[:, None] == c[None, :]).double()  # (G, G)
        return ((wins.sum(1) - 0.5) / (len(c) - 1)).float(), {"colorfulness": c.float()}  # self-tie removed

    return fn
