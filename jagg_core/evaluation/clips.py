"""The evaluation of clips (a video backbone, ``wan``): the test prompts as clip prompts, each metric an image score
averaged over chosen frames. Not a video benchmark: a mean of per-frame scores does not see motion (docs/video.md).

A clip is sampled per test prompt with the seed an image would get; what is saved is what the scorers and the report
need, per clip, under the images folder's ``<style>/`` layout:

- ``<root>/<style>/<index:05d>/<frame:03d>.jpg``: the frames ``reward.frames`` chooses
  (:func:`jagg_core.rewards.clips.frame_indices`, the training reward's selection), as the same JPEGs as images;
- ``<root>/<style>/<index:05d>/strip.jpg``: the clip's frame strip (:func:`jagg_core.media.frame_strips`, up to
  ``STRIP_FRAMES`` evenly spaced frames, no caption), which the report's grid stacks.

A clip's score for a metric is the mean of the metric over its saved frames against the clip's prompt, computed by
:func:`jagg_core.rewards.clips.on_frames` as the training reward computes it; the summaries are then those of images.
"""

from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ..setup.config import Params
from ..setup.registry import backbone_spec
from ..setup.storage import atomic_write_bytes
from .benchmark import ScoreFn, load_image, merge_score_parts, score_batch
from .clip_layout import clip_complete, clip_dir, frame_path, strip_path
from ..media import frame_strips
from ..rewards.clips import frame_indices, on_frames

__all__ = ["clip_complete", "clip_frames", "frame_path", "save_clip", "score_clip_folder",
           "strip_path"]


def clip_frames(params: Params) -> list[int] | None:
    """The frame indices of a clip that the evaluation saves and scores (``reward.frames`` of the profile's
    ``model.options.num_frames``); None for an image backbone."""
    spec = backbone_spec(params.model.backbone)
    if not spec.video:
        return None

    return frame_indices(int(params.model.options.get("num_frames", spec.defaults["num_frames"])),
                         params.reward.frames)


def save_clip(root: str | Path, style: str, index: int, clip: torch.Tensor, frames: Sequence[int],
              save_jpeg: Callable[[Path, torch.Tensor], None]) -> None:
    """Clip (F, 3, H, W) in [0, 1]: its chosen frames as JPEGs (``save_jpeg``, the images' encoder), then its strip
    (JPEG quality 90, 4:4:4)."""
    for f in frames:
        save_jpeg(frame_path(root, style, index, f), clip[f])
    buf = io.BytesIO()  # a JPEG: a 49-frame 512 px clip's strip is ~2100 x 290 px, a few hundred kB, not MBs of PNG
    frame_strips(clip[None].float()).save(buf, format="JPEG", quality=90, subsampling=0)
    atomic_write_bytes(strip_path(root, style, index), buf.getvalue())


def score_clip_folder(
    root: str | Path,
    prompts_by_style: Mapping[str, Sequence[str]],
    metrics: Mapping[str, ScoreFn],
    frames: Sequence[int],
    *,
    batch_size: int = 16,
    progress: bool = False,
    part: tuple[int, int] | None = None,
    needed: Callable[[str, int, int], Sequence[str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Score every clip's saved frames against its prompt with every metric: a clip's score is the mean over its
    frames (``on_frames``). The result is :func:`jagg_core.evaluation.benchmark.score_image_folder`'s, per clip:
    ``scores[key][style]`` in prompt order (with ``part`` = ``(rank, world)``: ``{index: float}`` of this process's
    batches of ``batch_size`` clips, batch ``k`` over styles in order being rank ``k % world``'s; with ``needed``,
    ``(style, start, stop) -> metric names``, each batch is scored with those only, and the result is a share too)."""
    from tqdm.auto import tqdm

    if not metrics:
        raise ValueError("at least one metric is needed to score clips.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}.")
    rank, world = part or (0, 1)
    missing = [(s, i) for s, ps in prompts_by_style.items() for i in range(len(ps))
               if not clip_complete(root, s, i, frames)]
    if missing:
        s, i = missing[0]
        total = sum(len(ps) for ps in prompts_by_style.values())
        raise FileNotFoundError(f"clip {clip_dir(root, s, i)} is incomplete ({len(missing)} of the {total} clips "
                                f"under {root} are): generate the clips first.")
    on_clips = {name: on_frames(fn, "all") for name, fn in metrics.items()}  # the saved frames are the chosen ones
    scores: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: {style: {} for style in prompts_by_style})
    chunks = [(s, a) for s, ps in prompts_by_style.items() for a in range(0, len(ps), batch_size)]
    mine = [c for k, c in enumerate(chunks) if k % world == rank]
    bar = tqdm(total=sum(min(batch_size, len(prompts_by_style[s]) - a) for s, a in mine),
               desc=f"scoring {Path(root).name}", unit="clip", disable=not progress)
    for style, start in mine:
        idx = list(range(start, min(start + batch_size, len(prompts_by_style[style]))))
        batch_metrics = on_clips if needed is None else {n: on_clips[n] for n in needed(style, start, idx[-1] + 1)}
        if batch_metrics:
            clips = torch.stack([torch.stack([load_image(frame_path(root, style, i, f)) for f in frames]) for i in idx])
            score_batch(scores, batch_metrics, clips, prompts_by_style[style], style, idx)  # each clip: its frames' mean
        bar.update(len(idx))
    bar.close()
    shares = {key: dict(by_style) for key, by_style in scores.items()}
    return shares if part is not None or needed is not None else merge_score_parts([shares], prompts_by_style)
