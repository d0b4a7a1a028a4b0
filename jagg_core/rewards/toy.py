"""Toy rewards of the embedded default: prompt fidelity computed exactly from the world's definition, its groupwise
ranking (``toy_fidelity_rank``), and JPEG compressibility as in DDPO.

``toy_fidelity`` reads only the prompt text (evaluation has nothing else). For each image:

1. Soft colour membership of every pixel in every palette colour: 1 within ``tau_full`` of the colour (a model's
   small colour errors cost nothing), then ``((τ² − d²)/(τ² − tau_full²))²`` falling to 0 at ``d = τ``. The palette
   colours are at least τ apart, so a rendered image has memberships of exactly 0 or 1 and its ground truth scores
   exactly 1.
2. ``objects``: every way the prompt allows to place its objects (distinct cells, named positions, the relation;
   any size or colour the prompt leaves open) is scored by the mean soft IoU of each object's template with the
   membership map of its colour inside the template's cell; the best placement is kept.
3. ``background``: the mean membership in the prompt's background colour (the best-fitting background if it names
   none) of the pixels outside the placed templates.
4. ``precision``: the share of the image's paint that is not that background and lies inside the placed templates;
   extra objects, stray paint and a wrong background lower it.

``reward = objects · (w_objects + w_background · background + w_precision · precision)`` with the weights summing to
1: the objects gate the rest, so a blank canvas of the right colour still scores 0.
"""

from __future__ import annotations

import functools
import io
from typing import TYPE_CHECKING, Annotated, Any, Callable, Mapping, Sequence

import numpy as np
from pydantic import Field

from ..setup.options import TAU_OPTIONS, Share
from ..world import BACKGROUNDS, COLORS, SHAPES, SIZES, cell_assignments, cell_boxes, parse_prompt, templates
from ..world.render import MIN_IMAGE_SIZE
from .base import RewardError, RewardFn, register_reward
from .groupwise import pairwise_wins

if TYPE_CHECKING:
    import torch

__all__ = ["TAU", "TAU_FULL", "fidelity_components", "jpeg_compressibility", "toy_background", "toy_fidelity",
           "toy_fidelity_rank", "toy_objects", "toy_precision"]

TAU = 120.0  # default distance, in RGB units (0–255), at which a pixel stops counting as a colour
TAU_FULL = 50.0  # default distance within which it counts fully
_PALETTE = np.array([*COLORS.values(), *BACKGROUNDS.values()], dtype=np.float64)  # (K + G, 3), objects first
_K = len(COLORS)
_ANY = _K  # index of the "any object colour" membership map
_COLOR_INDEX = {name: i for i, name in enumerate(COLORS)}
_BACKGROUND_INDEX = {name: i for i, name in enumerate(BACKGROUNDS)}
_parse = functools.lru_cache(maxsize=1 << 16)(parse_prompt)


@functools.lru_cache(maxsize=16)
def _geometry(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat templates (S·Z·9, HW) float64, their pixel counts (S, Z, 9), and the pixel → cell one-hot (HW, 9)."""
    flat = templates(size).reshape(-1, size * size).astype(np.float64)
    cell_of = np.zeros((size, size, 9), dtype=np.float64)
    for k, (y0, y1, x0, x1) in enumerate(cell_boxes(size)):
        cell_of[y0:y1, x0:x1, k] = 1.0
    return flat, flat.sum(1).reshape(len(SHAPES), len(SIZES), 9), cell_of.reshape(size * size, 9)


def palette_d2(images: np.ndarray) -> np.ndarray:
    """(B, H, W, 3) in [0, 255] → (B, K + G, H, W) squared RGB distance of every pixel to every palette colour."""
    channels = np.moveaxis(images, -1, 0)[:, :, None]  # (3, B, 1, H, W)
    return sum((channels[c] - _PALETTE[:, c, None, None]) ** 2 for c in range(3))  # (B, K + G, H, W)


def _memberships(images: np.ndarray, tau: float, tau_full: float) -> np.ndarray:
    """(B, H, W, 3) in [0, 255] → (B, K + G, H, W) soft membership in each palette colour."""
    return np.clip((tau**2 - palette_d2(images)) / (tau**2 - tau_full**2), 0.0, 1.0) ** 2


def fidelity_components(
    images: np.ndarray, prompts: Sequence[str], tau: float = TAU, tau_full: float = TAU_FULL
) -> dict[str, np.ndarray]:
    """``objects``, ``background`` and ``precision`` of each image against its prompt, each (B,) float64.

    ``images``: (B, H, W, 3) RGB in [0, 255] (uint8 or float), H == W.
    """
    images = np.asarray(images, dtype=np.float64)
    if images.ndim != 4 or images.shape[-1] != 3 or images.shape[1] != images.shape[2]:
        raise ValueError(f"images must be square RGB (B, H, W, 3), got shape {images.shape}.")
    b_count, size = images.shape[0], images.shape[1]
    if size < MIN_IMAGE_SIZE:
        raise ValueError(f"images must be at least {MIN_IMAGE_SIZE} pixels wide for the toy world, got {size}.")
    if len(prompts) != b_count:
        raise ValueError(f"got {b_count} images but {len(prompts)} prompts.")
    flat, counts, cell_of = _geometry(size)
    masks = templates(size).reshape(len(SHAPES), len(SIZES), 9, size * size)

    m = _memberships(images, tau, tau_full).reshape(b_count, -1, size * size)  # (B, K + G, HW)
    colors = np.concatenate([m[:, :_K], m[:, :_K].max(1, keepdims=True)], axis=1)  # (B, K + 1, HW)
    # One 2-D matmul each: numpy's stacked matmul can stall for seconds on a busy machine.
    colors = colors.reshape(b_count * (_K + 1), size * size)
    overlap = (colors @ flat.T).reshape(b_count, _K + 1, len(SHAPES), len(SIZES), 9)  # (B, K+1, S, Z, 9)
    in_cell = (colors @ cell_of).reshape(b_count, _K + 1, 1, 1, 9)
    iou = overlap / (counts + in_cell - overlap)  # soft IoU of each template within its cell

    out = {name: np.empty(b_count) for name in ("objects", "background", "precision")}
    for b, prompt in enumerate(prompts):
        spec = _parse(prompt)
        n = len(spec.objects)
        gain = np.empty((n, 9))  # best IoU of object i in cell k, over the sizes the prompt allows
        best_size = np.empty((n, 9), dtype=np.int64)
        for i, o in enumerate(spec.objects):
            sizes = np.arange(len(SIZES)) if o.size is None else np.array([SIZES.index(o.size)])
            table = iou[b, _ANY if o.color is None else _COLOR_INDEX[o.color], SHAPES.index(o.shape), sizes]
            gain[i], best_size[i] = table.max(0), sizes[table.argmax(0)]
        rows = cell_assignments(spec)  # (A, n)
        totals = gain[np.arange(n), rows].sum(1)  # (A,)
        cells = rows[totals.argmax()]
        out["objects"][b] = totals.max() / n

        placed = np.zeros(size * size, dtype=bool)
        for i, o in enumerate(spec.objects):
            placed |= masks[SHAPES.index(o.shape), best_size[i, cells[i]], cells[i]]
        backgrounds = m[b, _K:]  # (G, HW)
        outside = backgrounds[:, ~placed].mean(1)  # (G,)
        g = int(outside.argmax()) if spec.background is None else _BACKGROUND_INDEX[spec.background]
        out["background"][b] = outside[g]
        foreground = 1.0 - backgrounds[g]  # (HW,) paint that is not this background
        out["precision"][b] = (foreground[placed].sum() + 1e-6) / (foreground.sum() + 1e-6)
    return out


def toy_world_reward(name: str) -> Callable[[Mapping[str, Any]], str]:
    """A toy reward's line in the evaluation conventions (what it scores with)."""
    return lambda options: f"the toy world's {name}; the reward's value"


@register_reward("toy_fidelity", describe=toy_world_reward("toy_fidelity"),
                 options={**TAU_OPTIONS, "w_background": (Share, None), "w_precision": (Share, None)})
def toy_fidelity(
    tau: float = TAU, tau_full: float = TAU_FULL, w_background: float = 0.3, w_precision: float = 0.3
) -> RewardFn:
    """How well each image shows its prompt in the toy world, in [0, 1]; ground truth scores 1.

    Reads the prompt text only (``metadata`` is ignored), so evaluation prompts need nothing else.

    Args:
        tau: colour tolerance in RGB units (0–255): a pixel this far from a colour no longer counts as it.
        tau_full: a pixel this close to a colour counts fully as it.
        w_background: weight of the background term.
        w_precision: weight of the precision term (no unrequested objects); ``1 − w_background − w_precision``
            goes to the objects themselves.
    """
    import torch

    _check_tau("toy_fidelity", tau, tau_full)
    if not (0 <= w_background and 0 <= w_precision and w_background + w_precision <= 1):
        raise RewardError(
            f"toy_fidelity: w_background and w_precision must be non-negative with a sum of at most 1, "
            f"got {w_background!r} and {w_precision!r}."
        )
    w_objects = 1.0 - w_background - w_precision

    def fn(
        images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        parts = fidelity_components(_pixels(images), prompts, tau, tau_full)
        reward = parts["objects"] * (w_objects + w_background * parts["background"] + w_precision * parts["precision"])
        info = {k: torch.from_numpy(v).float() for k, v in parts.items()}
        return torch.from_numpy(reward).float(), info

    return fn


def _check_tau(name: str, tau: float, tau_full: float) -> None:
    if not 0 <= tau_full < tau <= 127:
        raise RewardError(
            f"{name}: need 0 <= tau_full < tau <= 127 RGB units (127 is the palette's spacing), "
            f"got tau_full={tau_full!r} and tau={tau!r}."
        )


def _pixels(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) in [0, 1] -> (B, H, W, 3) float64 in [0, 255]."""
    import torch

    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (B, 3, H, W), got shape {tuple(images.shape)}.")
    # Upcast to float64 so that a rendered ground truth scores 1 to within 1e-12.
    return images.detach().to("cpu", torch.float64).clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255.0


def _component_reward(component: str, doc: str):
    def factory(tau: float = TAU, tau_full: float = TAU_FULL) -> RewardFn:
        _check_tau(f"toy_{component}", tau, tau_full)

        def fn(images, prompts, metadata):
            import torch

            return torch.from_numpy(fidelity_components(_pixels(images), prompts, tau, tau_full)[component]).float(), {}

        return fn

    factory.__doc__ = doc
    return register_reward(f"toy_{component}", options=TAU_OPTIONS,
                           describe=toy_world_reward(f"toy_{component}"))(factory)


# The components of toy_fidelity as rewards of their own, for reward mixes that weight what every prompt shares
# (a clean background, no stray paint) apart from the objects each prompt names.
toy_objects = _component_reward("objects", "The mean soft IoU of the prompt's objects at their best placement, in [0, 1].")
toy_background = _component_reward("background", "The match of the background outside the placed objects, in [0, 1].")
toy_precision = _component_reward("precision", "The share of the paint that lies inside the placed objects, in [0, 1].")


_FIDELITY_OPTIONS = {**TAU_OPTIONS, "w_background": (Share, None), "w_precision": (Share, None)}


@register_reward("toy_fidelity_rank", kind="groupwise", options=_FIDELITY_OPTIONS,
                 describe=toy_world_reward("toy_fidelity_rank"))
def toy_fidelity_rank(
    tau: float = TAU, tau_full: float = TAU_FULL, w_background: float = 0.3, w_precision: float = 0.3
) -> RewardFn:
    """A groupwise reward: the share of its prompt's other images whose ``toy_fidelity`` an image beats (a tie counts
    half), in [0, 1]; a pairwise-preference ranking within the group, as Flow-Factory's ``PickScore_Rank`` ranks by
    PickScore. Its options are ``toy_fidelity``'s; ``info['fidelity']`` holds the raw scores it ranks."""
    fidelity = toy_fidelity(tau=tau, tau_full=tau_full, w_background=w_background, w_precision=w_precision)

    def fn(
        images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        raw, _ = fidelity(images, prompts, metadata)
        return pairwise_wins(raw), {"fidelity": raw}

    return fn


@register_reward("jpeg_compressibility", options={"quality": (Annotated[int, Field(ge=1, le=100)], None)},
                 describe=toy_world_reward("jpeg_compressibility"))
def jpeg_compressibility(quality: int = 95) -> RewardFn:
    """Minus the JPEG size in kB at ``quality``, as DDPO's ``jpeg_compressibility`` (kvablack/ddpo-pytorch)."""
    import torch
    from PIL import Image

    if not 1 <= quality <= 100:
        raise RewardError(f"jpeg_compressibility: quality must be in 1..100, got {quality!r}.")

    def fn(
        images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        arrays = (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8)
        kb = []
        for array in arrays.permute(0, 2, 3, 1).numpy():  # NCHW -> NHWC
            buffer = io.BytesIO()
            Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
            kb.append(buffer.tell() / 1000)
        kb = torch.tensor(kb, dtype=torch.float32)
        return -kb, {"kb": kb}

    return fn
