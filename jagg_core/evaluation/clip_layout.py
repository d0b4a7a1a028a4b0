"""Where the evaluation of clips keeps a clip's files (:mod:`.clips`); apart so that the report reads them without
importing the rewards."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .benchmark import check_style

__all__ = ["VIDEO_BACKBONES", "clip_complete", "clip_dir", "frame_path", "strip_path"]

VIDEO_BACKBONES = ("wan",)  # backbones whose samples are clips (B, F, 3, H, W)


def clip_dir(root: str | Path, style: str, index: int) -> Path:
    """The folder of clip ``index`` of ``style``: ``<root>/<style>/<index:05d>``."""
    return Path(root) / check_style(style) / f"{index:05d}"


def frame_path(root: str | Path, style: str, index: int, frame: int) -> Path:
    """Where frame ``frame`` of clip ``index`` of ``style`` lives: ``<root>/<style>/<index:05d>/<frame:03d>.jpg``."""
    return clip_dir(root, style, index) / f"{frame:03d}.jpg"


def strip_path(root: str | Path, style: str, index: int) -> Path:
    """The frame strip of clip ``index`` of ``style``: ``<root>/<style>/<index:05d>/strip.png``."""
    return clip_dir(root, style, index) / "strip.png"


def clip_complete(root: str | Path, style: str, index: int, frames: Sequence[int]) -> bool:
    """Every chosen frame and the strip of the clip are there (the strip is written last)."""
    return strip_path(root, style, index).is_file() and all(frame_path(root, style, index, f).is_file()
                                                            for f in frames)
