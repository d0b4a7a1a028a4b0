"""Where the evaluation of clips keeps a clip's files (:mod:`.clips`), and :func:`strips_grid`, the saved frame strips
stacked for the report and MLflow; apart so that the report reads them without importing the rewards."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .benchmark import IMAGE_FIX, ImageFileError, check_style
from ..setup.storage import open_image
from ..media import GRID_MAX_SIDE, image_grid

__all__ = ["clip_complete", "clip_dir", "frame_path", "strip_path", "strips_grid"]

def clip_dir(root: str | Path, style: str, index: int) -> Path:
    """The folder of clip ``index`` of ``style``: ``<root>/<style>/<index:05d>``."""
    return Path(root) / check_style(style) / f"{index:05d}"


def frame_path(root: str | Path, style: str, index: int, frame: int) -> Path:
    """Where frame ``frame`` of clip ``index`` of ``style`` lives: ``<root>/<style>/<index:05d>/<frame:03d>.jpg``."""
    return clip_dir(root, style, index) / f"{frame:03d}.jpg"


def strip_path(root: str | Path, style: str, index: int) -> Path:
    """The frame strip of clip ``index`` of ``style``: ``<root>/<style>/<index:05d>/strip.jpg``."""
    return clip_dir(root, style, index) / "strip.jpg"


def clip_complete(root: str | Path, style: str, index: int, frames: Sequence[int]) -> bool:
    """Every chosen frame and the strip of the clip are there (the strip is written last)."""
    return strip_path(root, style, index).is_file() and all(frame_path(root, style, index, f).is_file()
                                                            for f in frames)


def strips_grid(paths: Sequence[Path], captions: Sequence[str]) -> Any:
    """Saved frame strips, one per row with its caption underneath, as one PIL image; unscaled, but the long
    side bounded by ``GRID_MAX_SIDE`` like the image grids (a strip of another size is resized to the first's)."""
    import numpy as np
    from PIL import Image

    strips = []
    for path in paths:
        strip = open_image(path, ImageFileError, fix=IMAGE_FIX)
        strips.append(strip if not strips or strip.size == strips[0].size else strip.resize(strips[0].size,
                                                                                            Image.LANCZOS))
    grid = image_grid(np.stack([np.asarray(s) for s in strips]), list(captions), ncols=1, scale=1,
                      caption_width=max(24, strips[0].size[0] // 7))
    if max(grid.size) > GRID_MAX_SIDE:
        f = GRID_MAX_SIDE / max(grid.size)
        grid = grid.resize((max(1, int(grid.size[0] * f)), max(1, int(grid.size[1] * f))), Image.LANCZOS)
    return grid
