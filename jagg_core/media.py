"""What a user sees of sampled clips: frame strips (one row of frames per clip) and a small animated GIF, both
bounded in size like the image grids; and :func:`log_samples`, which logs images or clips to a metric sink.

- :func:`frame_strips`: clips ``(B, F, 3, H, W)`` → a PIL grid, one row per clip of at most ``STRIP_FRAMES`` evenly
  spaced frames, the prompt under the first, the frame indices as column titles; the grid's cells and long side are
  bounded by :func:`jagg_core.sampling.image_grid` (``GRID_CELL_MAX``, ``GRID_MAX_SIDE``).
- :func:`clips_gif`: at most ``GIF_CLIPS`` clips side by side, at most ``GIF_FRAMES`` evenly spaced frames, each
  cell at most ``GIF_CELL`` pixels, as GIF bytes (about 1 MB for noise, far less for real clips).
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import torch

from .sampling import image_grid, to_uint8

__all__ = ["GIF_CELL", "GIF_CLIPS", "GIF_FRAMES", "STRIP_FRAMES", "clips_gif", "frame_strips", "log_samples", "strip_frames"]

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
