"""What a user sees of samples: image grids with captions, frame strips (one row of frames per clip) and a small
animated GIF of clips, all bounded in size; and :func:`log_samples`, which logs images or clips to a metric sink.

- :func:`image_grid`: images → a PIL grid with each caption wrapped underneath, its cells at most ``GRID_CELL_MAX``
  and its long side at most ``GRID_MAX_SIDE`` pixels.

- :func:`frame_strips`: clips ``(B, F, 3, H, W)`` → a PIL grid, one row per clip of at most ``STRIP_FRAMES`` evenly
  spaced frames, the prompt under the first, the frame indices as column titles; the grid's cells and long side are
  bounded by :func:`image_grid` (``GRID_CELL_MAX``, ``GRID_MAX_SIDE``).
- :func:`clips_gif`: at most ``GIF_CLIPS`` clips side by side, at most ``GIF_FRAMES`` evenly spaced frames, each
  cell at most ``GIF_CELL`` pixels, as GIF bytes (about 1 MB for noise, far less for real clips).
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import numpy as np
import torch

from .sampling import to_uint8

__all__ = ["GIF_CELL", "GIF_CLIPS", "GIF_FRAMES", "GRID_CELL_MAX", "GRID_MAX_SIDE", "STRIP_FRAMES", "clips_gif",
           "frame_strips", "image_grid", "log_samples", "strip_frames"]

GRID_CELL_MAX = 256  # px: the largest cell of a logged image grid
GRID_MAX_SIDE = 2048  # px: the longest side of a logged image grid, however many images it holds


def image_grid(
    images: torch.Tensor | np.ndarray,
    captions: Sequence[str] | None = None,
    *,
    ncols: int = 4,
    scale: int | None = None,
    col_titles: Sequence[str] | None = None,
    caption_width: int = 30,
):
    """A PIL grid of images with each caption wrapped underneath.

    ``scale``: an integer upscales every image that many times (nearest neighbour); None (the default) sizes cells
    for logging: small images (the toy's 24 px) are upscaled to about 96 px, large ones (Flux's 720 px) are
    downscaled to 256 px, and a grid of many rows shrinks as a whole to a long side of ``GRID_MAX_SIDE``, so a grid
    logged every few iterations stays a few hundred kB.
    """
    import textwrap

    from PIL import Image, ImageDraw, ImageFont

    arr = to_uint8(images) if isinstance(images, torch.Tensor) else np.asarray(images)
    n, h, w = arr.shape[:3]
    font = ImageFont.load_default()
    if scale is None:
        side = max(h, w)
        target = side * max(1, 96 // side) if side < 96 else min(side, GRID_CELL_MAX)
        cw, ch = max(1, round(w * target / side)), max(1, round(h * target / side))
    else:
        cw, ch = w * scale, h * scale
    resample = Image.NEAREST if cw >= w else Image.LANCZOS
    lines = [textwrap.wrap(c, caption_width) for c in captions] if captions else [[] for _ in range(n)]
    text_h = 12 * max((len(x) for x in lines), default=0) + (4 if captions else 0)
    title_h = 16 if col_titles else 0
    ncols = min(ncols, n)
    nrows = (n + ncols - 1) // ncols
    pad = 6
    grid = Image.new("RGB", (ncols * (cw + pad) + pad, title_h + nrows * (ch + text_h + pad) + pad), "white")
    draw = ImageDraw.Draw(grid)
    for c, title in enumerate(col_titles or []):
        draw.text((pad + c * (cw + pad), 2), title, fill="black", font=font)
    for i in range(n):
        r, c = divmod(i, ncols)
        x, y = pad + c * (cw + pad), title_h + pad + r * (ch + text_h + pad)
        grid.paste(Image.fromarray(arr[i]).resize((cw, ch), resample), (x, y))
        for k, line in enumerate(lines[i]):
            draw.text((x, y + ch + 2 + 12 * k), line, fill="black", font=font)
    if scale is None and max(grid.size) > GRID_MAX_SIDE:  # many rows: the whole grid shrinks to fit
        f = GRID_MAX_SIDE / max(grid.size)
        grid = grid.resize((max(1, int(grid.size[0] * f)), max(1, int(grid.size[1] * f))), Image.LANCZOS)
    return grid


STRIP_FRAMES = 8  # frames shown per clip in a strip
GIF_CLIPS = 4  # clips in the animated GIF
GIF_CELL = 128  # px: the longest side of one clip in the GIF
GIF_FRAMES = 25  # frames of the GIF (a 49-frame clip: every second one)


def strip_frames(num_frames: int, count: int = STRIP_FRAMES) -> list[int]:
    """``count`` frame indices evenly spaced from the first to the last (all of them for a short clip)."""
    if num_frames <= count:
        return list(range(num_frames))
    return sorted({(num_frames - 1) * k // (count - 1) for k in range(count)})


def frame_strips(clips: torch.Tensor, captions: Sequence[str] | None = None, *, count: int = STRIP_FRAMES):
    """Clips (B, F, 3, H, W) in [0, 1] → a PIL grid: one row of ``count`` frames per clip."""
    b, f = clips.shape[:2]
    idx = strip_frames(f, count)
    frames = clips[:, idx].flatten(0, 1)  # (B·n, 3, H, W), clip-major: row i is clip i
    cells = [c if k == 0 else "" for c in (captions or [""] * b) for k in range(len(idx))]
    return image_grid(frames, cells if captions else None, ncols=len(idx), col_titles=[f"frame {i}" for i in idx],
                      caption_width=24)


def clips_gif(clips: torch.Tensor, *, max_clips: int = GIF_CLIPS, cell: int = GIF_CELL,
              max_frames: int = GIF_FRAMES, fps: int = 8) -> bytes:
    """The first ``max_clips`` clips (B, F, 3, H, W) side by side, looping, as GIF bytes."""
    from PIL import Image

    clips = clips[:max_clips, strip_frames(clips.shape[1], max_frames)].float()
    b, f, _, h, w = clips.shape
    scale = cell / max(h, w) if max(h, w) > cell else max(1, 64 // max(h, w))
    cw, ch = max(1, round(w * scale)), max(1, round(h * scale))
    mode = "area" if cw < w else "nearest"
    small = torch.nn.functional.interpolate(clips.flatten(0, 1), size=(ch, cw), mode=mode)  # (B·F, 3, ch, cw)
    arr = to_uint8(small).reshape(b, f, ch, cw, 3)
    frames = []
    for j in range(f):
        canvas = Image.new("RGB", (b * (cw + 2) + 2, ch + 4), "white")
        for i in range(b):
            canvas.paste(Image.fromarray(arr[i, j]), (2 + i * (cw + 2), 2))
        frames.append(canvas.quantize(colors=255, method=Image.Quantize.FASTOCTREE))  # fast even on noise
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    return buf.getvalue()


def log_samples(sink: Any, samples: torch.Tensor, captions: Sequence[str], key: str, step: int) -> None:
    """Images (B, 3, H, W) as a grid; clips (B, F, 3, H, W) as frame strips under ``key`` and, where the sink takes
    artifacts (``log_artifact_bytes``), an animated GIF ``<key>/step_<step>.gif``."""
    if samples.ndim == 4:
        sink.log_image(image_grid(samples, captions, ncols=4), key, step)
        return
    sink.log_image(frame_strips(samples, captions), key, step)
    if hasattr(sink, "log_artifact_bytes"):
        sink.log_artifact_bytes(clips_gif(samples), f"{key}/step_{step:06d}.gif")
