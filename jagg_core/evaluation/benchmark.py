"""The HPSv2.1 benchmark protocol: its prompts, scoring a folder of generated images, and the summary metrics.

The test set is HPDv2's ``benchmark/{anime,concept-art,paintings,photo}.json`` (each a JSON list of 800 prompts; HF
dataset ``zhwang/HPDv2``). Images are laid out as hpsv2's evaluation reads them: ``<root>/<style>/<index:05d>.jpg``,
image ``index`` generated from prompt ``index`` of that style.

Summary. Per style, as hpsv2's ``evaluation.py`` (``evaluate_benchmark``): the per-image scores in prompt order are
cut into consecutive blocks of ``block_size`` = 80 images (10 blocks of 80 for the 800 prompts); with ``m_k`` the mean
of block ``k`` over its images,

    block_mean(style) = mean_k m_k,        block_std(style) = sqrt(mean_k (m_k - block_mean)^2)   (population std)

With equal blocks ``block_mean`` is the style's plain mean; the std of block means is hpsv2's spread measure. hpsv2
prints both x100; here they stay in the reward's own units. A style whose length is not a multiple of ``block_size``
(small toy test sets) ends with one shorter block that counts as a block like the others, exactly what hpsv2's
``res[i:i+80] for i in range(0, n, 80)`` does on such a list; a style shorter than ``block_size`` is one block (std 0).

Overall, two numbers. ``mean`` is the plain mean over all images of all styles pooled: that is hpsv2's "Average"
(``np.mean(all_score)``), always. ``benchmark`` (the number reports and curves use) is the average over styles of
``block_mean``. The two are equal when every style has the same number of images and that number is a multiple of
``block_size`` or at most ``block_size`` (then each ``block_mean`` is its style's mean), as on the real benchmark (4
styles x 800); otherwise, as on uneven toy test sets, ``benchmark`` is not hpsv2's "Average" but ``mean`` still is.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import UserError
from ..setup.storage import PromptFileError, open_image, read_prompt_list, read_score_records

__all__ = [
    "BLOCK_SIZE",
    "HPDV2_REPO",
    "HPS_STYLES",
    "IMAGE_FIX",
    "ImageFileError",
    "block_means",
    "check_style",
    "image_path",
    "load_image",
    "merge_score_parts",
    "PromptFileError",
    "load_hps_benchmark",
    "score_image_folder",
    "read_score_records",
    "score_records",
    "summarize_scores",
]

HPS_STYLES = ("anime", "concept-art", "paintings", "photo")
HPDV2_REPO = "zhwang/HPDv2"
BLOCK_SIZE = 80  # images per block in hpsv2's benchmark protocol

_STYLE = re.compile(r"[a-z0-9-]+")

# fn(images, prompts, metadata) -> (rewards, info), the reward interface of jagg_core.rewards.
ScoreFn = Callable[[torch.Tensor, Sequence[str], Sequence[Mapping[str, Any]]], tuple[torch.Tensor, dict[str, Any]]]


def check_style(style: str) -> str:
    """A style name is a file and folder name: lowercase letters, digits and dashes only (no ``..``, no ``/``)."""
    if not isinstance(style, str) or _STYLE.fullmatch(style) is None:
        raise PromptFileError(f"benchmark style name {style!r} (a file benchmark/<style>.json) is invalid: use "
                              f"lowercase letters, digits and dashes only, e.g. rename it to "
                              f"{re.sub(r'[^a-z0-9-]+', '-', str(style).lower()).strip('-') or 'style'}.json.")
    return style


def image_path(root: str | Path, style: str, index: int) -> Path:
    """Where image ``index`` of ``style`` lives: ``<root>/<style>/<index:05d>.jpg`` (hpsv2's layout)."""
    return Path(root) / check_style(style) / f"{index:05d}.jpg"


# --- Prompts ---------------------------------------------------------------------------------------------------------


def _download_hint(styles: Sequence[str]) -> str:
    files = ",".join(styles)
    return (
        f"download benchmark/{{{files}}}.json from the Hugging Face dataset {HPDV2_REPO} into the local Hugging Face "
        f"cache (hf download {HPDV2_REPO} --repo-type dataset --include 'benchmark/*.json'), or into a folder and "
        f"pass the folder that holds benchmark/"
    )


def load_hps_benchmark(
    source: str | Path | None = None, *, styles: Sequence[str] = HPS_STYLES, subset: int | None = None
) -> dict[str, list[str]]:
    """The benchmark prompts by style, in file order.

    Args:
        source: a folder holding ``benchmark/<style>.json``, or the ``benchmark`` folder itself; ``None`` reads the
            files from the local Hugging Face cache of the dataset ``zhwang/HPDv2`` (never the network).
        styles: the style files to read (the toy world's test split uses its own, laid out the same way).
        subset: keep the first ``subset`` prompts of each style (``None``: all).

    Returns:
        ``{style: [prompt, ...]}`` in ``styles`` order.
    """
    styles = [check_style(s) for s in styles]
    if not styles:
        raise ValueError("at least one benchmark style is needed.")
    if subset is not None and (isinstance(subset, bool) or not isinstance(subset, int) or subset < 1):
        raise ValueError(f"subset must be a positive integer or None, got {subset!r}.")
    paths = {}
    if source is None:
        from huggingface_hub import try_to_load_from_cache

        for style in styles:
            cached = try_to_load_from_cache(HPDV2_REPO, f"benchmark/{style}.json", repo_type="dataset")
            if not isinstance(cached, str):
                raise FileNotFoundError(
                    f"the benchmark prompts benchmark/{style}.json are not in the local Hugging Face cache: "
                    f"{_download_hint(styles)}."
                )
            paths[style] = Path(cached)
    else:
        folder = Path(source).expanduser()
        if (folder / "benchmark").is_dir():
            folder = folder / "benchmark"
        elif not folder.is_dir():
            raise FileNotFoundError(f"the benchmark folder {str(source)!r} does not exist: {_download_hint(styles)}.")
        for style in styles:
            paths[style] = folder / f"{style}.json"
            if not paths[style].is_file():
                raise FileNotFoundError(f"the benchmark file {paths[style]} does not exist: {_download_hint(styles)}.")
    return {style: read_prompt_list(path)[:subset] for style, path in paths.items()}


class ImageFileError(UserError, ValueError):
    """An evaluation image that cannot be read (not a regular file, a link, too many pixels, not an image)."""


IMAGE_FIX = "remove it; `jagg evaluate` generates the images it lacks"


# --- Scoring images --------------------------------------------------------------------------------------------------


def load_image(path: Path) -> torch.Tensor:
    """(3, H, W) float32 in [0, 1], read through the storage door (:func:`open_image`: a regular file, never a link,
    a pixel limit), else one :class:`ImageFileError` sentence."""
    import numpy as np

    pixels = np.asarray(open_image(path, ImageFileError, fix=IMAGE_FIX))  # (H, W, 3) uint8
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 255


def score_image_folder(
    root: str | Path,
    prompts_by_style: Mapping[str, Sequence[str]],
    metrics: Mapping[str, ScoreFn],
    *,
    batch_size: int = 16,
    progress: bool = False,
    part: tuple[int, int] | None = None,
    needed: Callable[[str, int, int], Sequence[str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Score every image ``<root>/<style>/<index:05d>.jpg`` against its prompt with every metric.

    All files are checked before any model runs. Images of one batch that differ in size are scored in separate
    runs of equal size.

    Args:
        root: the folder of one method's images.
        prompts_by_style: ``{style: prompts}``; image ``i`` of a style belongs to prompt ``i``.
        metrics: ``{name: fn}``, each a reward function ``fn(images, prompts, metadata) -> (rewards, info)``.
        batch_size: images loaded and scored together.
        progress: show a progress bar.
        part: ``(rank, world)``: score only this process's batches (batch ``k`` of the folder, counted over styles
            in order, is rank ``k % world``'s); the batches are those of one process, so the scores are too.
        needed: ``(style, start, stop) -> metric names``: score batch ``[start, stop)`` of ``style`` with those only
            (the others' scores are reused: ``score_cache.py``); a batch no metric needs is not read. The result is
            then this process's share, as with ``part``.

    Returns:
        ``scores[key][style]`` = per-image floats in prompt order, for key = each metric name (its reward) and
        ``<name>/<info key>`` for each per-image (B,) tensor of its info (e.g. ``pickscore/score``). With ``part``:
        ``scores[key][style]`` = ``{index: float}`` of this process's images, for :func:`merge_score_parts`.
    """
    from tqdm.auto import tqdm

    if not metrics:
        raise ValueError("at least one metric is needed to score images.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}.")
    rank, world = part or (0, 1)
    paths = {style: [image_path(root, style, i) for i in range(len(ps))] for style, ps in prompts_by_style.items()}
    every = [p for ps in paths.values() for p in ps]
    missing = [p for p in every if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"image {missing[0]} is missing ({len(missing)} of the {len(every)} images under {root} are missing): "
            f"generate the images first."
        )

    scores: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: {style: {} for style in prompts_by_style})
    chunks = [(style, start) for style, prompts in prompts_by_style.items()
              for start in range(0, len(prompts), batch_size)]
    mine = [c for k, c in enumerate(chunks) if k % world == rank]
    bar = tqdm(total=sum(min(batch_size, len(prompts_by_style[s]) - a) for s, a in mine),
               desc=f"scoring {Path(root).name}", unit="img", disable=not progress)
    for style, start in mine:
        prompts = prompts_by_style[style]
        stop = min(start + batch_size, len(prompts))
        batch_metrics = metrics if needed is None else {n: metrics[n] for n in needed(style, start, stop)}
        if not batch_metrics:
            bar.update(stop - start)
            continue
        loaded = [load_image(p) for p in paths[style][start:stop]]
        # Stack consecutive images of equal size; a folder of one method's images is normally one run.
        for _, run in itertools.groupby(range(start, stop), key=lambda i: loaded[i - start].shape):
            idx = list(run)
            images = torch.stack([loaded[i - start] for i in idx])  # (b, 3, H, W)
            score_batch(scores, batch_metrics, images, prompts, style, idx)
            bar.update(len(idx))
    bar.close()
    shares = {key: dict(by_style) for key, by_style in scores.items()}
    return shares if part is not None or needed is not None else merge_score_parts([shares], prompts_by_style)


def score_batch(scores: dict, metrics: Mapping[str, ScoreFn], batch: torch.Tensor, prompts: Sequence[str],
                style: str, idx: list[int]) -> None:
    """Score ``batch`` (the images, or clips, of prompts ``idx`` of ``style``) with every metric into
    ``scores[name][style]``, and each per-image value a metric's info holds into ``scores[f"{name}/{key}"]``."""
    texts = [prompts[i] for i in idx]
    metadata = [{"style": style, "index": i} for i in idx]
    for name, fn in metrics.items():
        rewards, info = fn(batch, texts, metadata)
        scores[name][style].update(zip(idx, rewards.detach().float().cpu().tolist()))
        for key, value in info.items():
            if torch.is_tensor(value) and value.shape == (len(idx),):
                scores[f"{name}/{key}"][style].update(zip(idx, value.detach().float().cpu().tolist()))


def merge_score_parts(
    shares: Sequence[Mapping[str, Mapping[str, Mapping[int, float]]]], prompts_by_style: Mapping[str, Sequence[str]]
) -> dict[str, dict[str, list[float]]]:
    """The scores of every process (:func:`score_image_folder` with ``part``) as one folder's: per-image floats in
    prompt order; every image must have every key."""
    keys = list(dict.fromkeys(k for share in shares for k in share))
    out: dict[str, dict[str, list[float]]] = {}
    for key in keys:
        out[key] = {}
        for style, prompts in prompts_by_style.items():
            merged: dict[int, float] = {}
            for share in shares:
                merged.update(share.get(key, {}).get(style, {}))
            if sorted(merged) != list(range(len(prompts))):
                raise RuntimeError(f"metric output {key!r} was not returned for every image of style {style!r}.")
            out[key][style] = [merged[i] for i in range(len(prompts))]
    return out


def score_records(
    prompts_by_style: Mapping[str, Sequence[str]], scores: Mapping[str, Mapping[str, Sequence[float]]]
) -> list[dict[str, Any]]:
    """One row per image -- ``{"style", "index", "prompt", <key>: value, ...}`` -- e.g. for ``scores.jsonl``."""
    return [
        {"style": style, "index": i, "prompt": prompt, **{key: float(s[style][i]) for key, s in scores.items()}}
        for style, prompts in prompts_by_style.items()
        for i, prompt in enumerate(prompts)
    ]


# --- Summary ---------------------------------------------------------------------------------------------------------


def block_means(values: Sequence[float], block_size: int = BLOCK_SIZE) -> list[float]:
    """Means of consecutive blocks of ``block_size`` values; the last block may be shorter (module docstring)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    blocks = [values[i : i + block_size] for i in range(0, len(values), block_size)]
    return [math.fsum(block) / len(block) for block in blocks]


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs)


def _std(xs: Sequence[float]) -> float:
    mu = _mean(xs)
    return math.sqrt(math.fsum((x - mu) ** 2 for x in xs) / len(xs))  # population std, as numpy's np.std


def summarize_scores(
    scores: Mapping[str, Mapping[str, Sequence[float]]], *, block_size: int = BLOCK_SIZE
) -> dict[str, dict[str, Any]]:
    """Benchmark metrics for each metric from per-image scores (the protocol in the module docstring).

    Args:
        scores: ``scores[metric][style]`` = per-image scores in prompt order (what :func:`score_image_folder` returns).
        block_size: images per block (hpsv2: 80).

    Returns:
        ``{metric: {"mean": over all images (hpsv2's "Average"), "n_images", "benchmark": average over styles of
        block_mean (hpsv2's "Average" only for equal styles of whole blocks, see the module docstring),
        "styles": {style: {"mean", "block_mean", "block_std", "n_images", "n_blocks"}}}}``.
    """
    if not scores:
        raise ValueError("no scores to summarize.")
    summary: dict[str, dict[str, Any]] = {}
    for metric, by_style in scores.items():
        if not by_style:
            raise ValueError(f"metric {metric!r} has no styles.")
        styles: dict[str, dict[str, Any]] = {}
        pooled: list[float] = []
        for style, values in by_style.items():
            values = [float(v) for v in values]
            if not values:
                raise ValueError(f"metric {metric!r} has no scores for style {style!r}.")
            bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
            if bad is not None:
                raise ValueError(f"metric {metric!r}, style {style!r}: image {bad} scored {values[bad]} (not finite).")
            blocks = block_means(values, block_size)
            styles[style] = {
                "mean": _mean(values),
                "block_mean": _mean(blocks),
                "block_std": _std(blocks),
                "n_images": len(values),
                "n_blocks": len(blocks),
            }
            pooled.extend(values)
        summary[metric] = {
            "mean": _mean(pooled),
            "n_images": len(pooled),
            "benchmark": _mean([s["block_mean"] for s in styles.values()]),
            "styles": styles,
        }
    return summary
