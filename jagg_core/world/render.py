"""The renderer: a :class:`Scene` drawn exactly, without antialiasing, on a square RGB image.

A pixel belongs to a shape when its centre lies inside the shape, so every pixel is exactly one palette colour and the
same masks (:func:`templates`) serve the toy reward: a rendered ground truth matches its templates pixel for pixel.
"""

from __future__ import annotations

import functools

import numpy as np

from .scene import BACKGROUNDS, CELLS, COLORS, SHAPES, SIZES, Object, Scene

__all__ = ["MIN_IMAGE_SIZE", "cell_boxes", "object_mask", "render", "templates"]

MIN_IMAGE_SIZE = 12  # below this, small objects lose their shape
# Half the width of an object, as a fraction of the narrowest cell: large ones nearly fill their cell.
HALF_EXTENT: dict[str, float] = {"small": 0.3, "large": 0.46}


def _check_size(size: int) -> None:
    if not isinstance(size, (int, np.integer)) or size < MIN_IMAGE_SIZE:
        raise ValueError(f"image size must be an integer of at least {MIN_IMAGE_SIZE} pixels, got {size!r}.")


def cell_boxes(size: int) -> list[tuple[int, int, int, int]]:
    """Pixel boxes ``(y0, y1, x0, x1)`` (ends exclusive) of the 9 cells, in the order of :data:`CELLS`."""
    _check_size(size)
    edges = [int(np.floor(j * size / 3 + 0.5)) for j in range(4)]
    return [(edges[r], edges[r + 1], edges[c], edges[c + 1]) for r in range(3) for c in range(3)]


def _shape_mask(shape: str, h: float, cy: float, cx: float, size: int) -> np.ndarray:
    centres = np.arange(size) + 0.5
    dy = (centres - cy)[:, None]  # (H, 1)
    dx = (centres - cx)[None, :]  # (1, W)
    ay, ax = np.abs(dy), np.abs(dx)
    if shape == "circle":
        inside = dy**2 + dx**2 <= (h + 0.3) ** 2  # a little wider than h: rounder on the pixel grid
    elif shape == "square":
        # A little smaller than the circle's box, so that the two differ by more than the corners.
        inside = np.maximum(ay, ax) <= 0.82 * h
    elif shape == "triangle":
        # Pointing up: apex at the top, base of width 2h at the bottom.
        inside = (dy >= -h) & (dy <= h) & (ax <= (dy + h) / 2)
    elif shape == "diamond":
        inside = ay + ax <= h
    elif shape == "cross":
        inside = (np.maximum(ay, ax) <= h) & (np.minimum(ay, ax) <= h / 4)
    else:
        raise ValueError(f"unknown shape {shape!r}; the world has {', '.join(SHAPES)}.")
    return np.broadcast_to(inside, (size, size))


@functools.lru_cache(maxsize=16)
def templates(size: int) -> np.ndarray:
    """Masks of every shape × size × cell: bool (S, Z, 9, H, W), indexed like SHAPES, SIZES and CELLS (read-only)."""
    boxes = cell_boxes(size)
    width = min(min(y1 - y0, x1 - x0) for y0, y1, x0, x1 in boxes)
    out = np.zeros((len(SHAPES), len(SIZES), len(CELLS), size, size), dtype=bool)
    for s, shape in enumerate(SHAPES):
        for z, size_name in enumerate(SIZES):
            for k, (y0, y1, x0, x1) in enumerate(boxes):
                # Centred on the pixel nearest the cell's centre, so an object looks the same in every cell.
                cy, cx = (y0 + y1) // 2 + 0.5, (x0 + x1) // 2 + 0.5
                out[s, z, k] = _shape_mask(shape, HALF_EXTENT[size_name] * width, cy, cx, size)
    out.flags.writeable = False
    return out


def object_mask(obj: Object, size: int = 32) -> np.ndarray:
    """Pixels of ``obj``: bool (H, W)."""
    return templates(size)[SHAPES.index(obj.shape), SIZES.index(obj.size), CELLS.index(obj.cell)]


def render(scene: Scene, size: int = 32) -> np.ndarray:
    """The image of ``scene``: uint8 (H, W, 3), exact and deterministic."""
    _check_size(size)
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = BACKGROUNDS[scene.background]
    for obj in scene.objects:
        image[object_mask(obj, size)] = COLORS[obj.color]
    return image
