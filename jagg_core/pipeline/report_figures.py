"""The report's figures: curves over iterations, the iteration breakdown's stacked bars, gradient fidelity by group
position, and the image grids (prompt x method, the base model's samples; for clips, the evaluation's frame strips,
one row per prompt and method), each written atomically as a PNG.

``runs`` are :mod:`jagg_core.pipeline.report`'s runs (method, seed, curve, eval); matplotlib is imported inside each
function, so importing this module does not.
"""

from __future__ import annotations

import io
import statistics
from pathlib import Path
from typing import Any, Sequence

from ..evaluation.clip_layout import strip_path, strips_grid
from ..setup.config import Params
from ..setup.paths import Layout
from ..setup.registry import backbone_spec
from ..setup.json_read import parse_json
from ..setup.storage import atomic_write_bytes, read_regular
from ..evaluation.benchmark import image_path, load_image
from ..media import image_grid
from .report_stats import ReportError, read_scores

__all__ = ["base_model_grid", "clip_grid", "comparison_grid", "mean_std", "plot_curves", "plot_fidelity", "plot_learning",
           "plot_per_second",
           "plot_stacked_bars", "save_figure", "save_png"]


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and population std of the non-NaN values (NaN, NaN for none; std 0 for one)."""
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), statistics.pstdev(xs) if len(xs) > 1 else 0.0


def plot_stacked_bars(labels: Sequence[str], rows: Sequence[dict[str, float]], phases: Sequence[str], path: Path, *,
                      title: str, xlabel: str, label_size: float | None = None) -> bool:
    """One horizontal bar per row, stacked from its ``phases`` (seconds; a phase that is 0 everywhere is left out);
    written as a PNG to ``path``. False (nothing written) without rows."""
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, (0.6 if label_size is None else 0.35) * len(rows) + 1.6), dpi=120)
    ys = list(range(len(rows)))[::-1]
    left = [0.0] * len(rows)
    cmap = plt.get_cmap("tab10")
    for i, name in enumerate(phases):
        widths = [r[name] for r in rows]
        if not any(w > 0 for w in widths):
            continue
        ax.barh(ys, widths, left=left, color=cmap(i % 10), label=name, height=0.6)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(ys, list(labels), fontsize=label_size)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="x")
    from matplotlib.transforms import ScaledTranslation

    # The legend 0.55 inch below the axes, under the x label, whatever the number of bars.
    below = ax.transAxes + ScaledTranslation(0, -0.55, fig.dpi_scale_trans)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=below, ncol=5, fontsize=7, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return True


def save_png(image, path: Path) -> None:
    """A PIL image written atomically as PNG."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())


def save_figure(fig, ax, path: Path) -> None:
    """Grid, legend, tight layout; written atomically as PNG and closed."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _method_curves(runs: Sequence[Any], key: str, *, base_point: float | None, from_eval: bool,
                   smooth: int) -> dict[str, list[dict[float, float]]]:
    """Per method, each seed's curve of ``key`` as {iteration: value} (the evaluation's curve with ``from_eval``,
    the base model's score as iteration 0 where given; a trailing mean over ``smooth`` points first)."""
    by_method: dict[str, list[dict[float, float]]] = {}
    for r in runs:
        pts = ([(p["step"], p[key]) for p in r.eval["curve"] if key in p] if from_eval and r.eval else
               [(row["iteration"], row[key]) for row in r.curve if key in row])
        if base_point is not None and from_eval:
            pts = [(0, base_point)] + [p for p in pts if p[0] != 0]
        if smooth > 1 and pts:
            ys = [y for _, y in pts]
            pts = [(x, statistics.fmean(ys[max(0, i - smooth + 1) : i + 1])) for i, (x, _) in enumerate(pts)]
        if pts:
            by_method.setdefault(r.method, []).append(dict(pts))
    return by_method


def _draw_curves(ax, by_method: dict[str, list[dict[float, float]]], *, markers: bool) -> None:  # noqa: ANN001
    """One line per method (the mean over seeds) with a ± one standard deviation band when there are several."""
    for i, (method, curves) in enumerate(by_method.items()):
        xs = sorted(set().union(*curves))
        stats = [mean_std([c[x] for c in curves if x in c]) for x in xs]
        counts = [sum(x in c for c in curves) for x in xs]  # seeds behind each point, not runs with any point
        n, lo = max(counts), min(counts)
        seeds = f"{n} seed{'s' if n > 1 else ''}" if lo == n else f"{lo}–{n} seeds by point: partial"
        ax.plot(xs, [m for m, _ in stats], color=f"C{i}", label=f"{method} ({seeds})",
                marker="o" if markers else None, markersize=3)
        if n > 1:
            ax.fill_between(xs, [m - sd for m, sd in stats], [m + sd for m, sd in stats], color=f"C{i}", alpha=0.15)
    ax.set_xlabel("iteration")


def plot_curves(runs: Sequence[Any], key: str, title: str, path: Path, *, base_point: float | None = None,
                from_eval: bool = False, smooth: int = 1) -> bool:
    """One line per method: the mean over seeds, with a band of ± one standard deviation when there are several.

    ``smooth`` > 1 averages each run's curve over a trailing window of that many points first (noisy rollout
    rewards).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method = _method_curves(runs, key, base_point=base_point, from_eval=from_eval, smooth=smooth)
    if not by_method:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    _draw_curves(ax, by_method, markers=from_eval)
    ax.set_title(title)
    save_figure(fig, ax, path)
    return True


def _split_label(subset: int | None) -> str:
    """What the curves' points are scored on (``eval.curve_subset``)."""
    return "test split" if subset is None else f"test split, first {subset} prompts/style"


def plot_learning(runs: Sequence[Any], metrics: Sequence[str], base: dict[str, float] | None, path: Path, *,
                  trained: Sequence[str] = (), subset: int | None = None) -> bool:
    """The report's first figure: each evaluation metric on the held-out test split by iteration, one panel each
    side by side (the first metric, the primary, on the left), every method's mean over seeds with its ± sd band
    and the base model at iteration 0 — what GRPO learned and, beside it, what it cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, _method_curves(runs, f"eval/{m}", base_point=(base or {}).get(m), from_eval=True, smooth=1))
              for m in metrics]
    panels = [(m, c) for m, c in panels if c]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), dpi=120, squeeze=False)
    for ax, (m, by_method) in zip(axes[0], panels):
        _draw_curves(ax, by_method, markers=True)
        role = "trained reward" if m in trained else "not trained on"
        ax.set_title(f"{_split_label(subset)}: {m} ({role})", fontsize=10)
    _save_panels(fig, axes[0], path)
    return True


def _save_panels(fig, axes, path: Path) -> None:  # noqa: ANN001  (matplotlib figure and axes)
    """Grid and legend on every panel; written atomically as PNG and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def plot_fidelity(fid: dict, threshold: float, path: Path) -> bool:
    """cos(JAGG, exact) and cos(ablate, exact) per group position, with the threshold of jagg_frac 'auto'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not fid["jagg"]:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for kind, colour in (("jagg", "C1"), ("ablate", "C2")):
        pts = sorted(fid[kind].items())
        if pts:
            xs = [g for g, _ in pts]
            ys = [m for _, (m, _, _) in pts]
            es = [s for _, (_, s, _) in pts]
            ax.errorbar(xs, ys, yerr=es, marker="o", color=colour, capsize=3, label=f"cos({kind}, exact)")
    ax.set_xticks(sorted({g for kind in ("jagg", "ablate") for g in fid[kind]}))
    ax.axhline(threshold, color="grey", ls="--", lw=1, label=f"threshold {threshold}")
    ax.set_xlabel("group position along the trajectory (0 = highest noise)")
    ax.set_ylabel("cosine to the exact gradient")
    ax.set_title("gradient fidelity by group position")
    save_figure(fig, ax, path)
    return True


def _images_of(card: Path) -> str:
    """The images folder an evaluation's ``metrics.json`` names (project-relative), read bounded and checked."""
    again = f"run `jagg evaluate --run {card.parent.name}` again to rewrite it"
    data = read_regular(card, ReportError, fix=again)
    try:
        images = parse_json(data, ValueError, str(card)).get("images")
    except (ValueError, AttributeError):  # not UTF-8, not JSON, not finite, too deep, not a mapping
        images = None
    if not isinstance(images, str) or images.startswith("/") or ".." in Path(images).parts:
        raise ReportError(f"{card} does not name its images folder inside the project; {again}.")
    return images


def comparison_grid(params: Params, lay: Layout, runs: Sequence[Any], out: Path, per_style: int = 2) -> list[str]:
    """Rows = test prompts, columns = base | each method (first seed) at its last evaluated step; clips (a video
    backbone): :func:`clip_grid` of the first test prompt of each style."""
    import torch

    columns: list[tuple[str, Path]] = []
    base = lay.eval_dir("base") / "metrics.json"
    if base.exists() or base.is_symlink():
        columns.append(("base", lay.root / _images_of(base)))
    seen = set()
    for r in runs:
        if r.eval and r.method not in seen:
            seen.add(r.method)
            columns.append((f"{r.method} @{r.eval['step']}", lay.root / r.eval["images"]))
    if not columns:
        return []
    rows = read_scores(columns[0][1].parent / "scores.jsonl") or []
    if backbone_spec(params.model.backbone).video:
        return clip_grid(columns, [x for x in rows if x["index"] < 1], out)
    picked = [x for x in rows if x["index"] < per_style]
    images, captions = [], []
    for x in picked:
        for title, root in columns:
            images.append(load_image(image_path(root, x["style"], x["index"])))
            captions.append(x["prompt"] if title == columns[0][0] else "")
    grid = image_grid(torch.stack(images), captions, ncols=len(columns), scale=6,
                      col_titles=[t for t, _ in columns], caption_width=40)
    save_png(grid, out)
    return [t for t, _ in columns]


def clip_grid(columns: Sequence[tuple[str, Path]], picked: Sequence[dict[str, Any]], out: Path) -> list[str]:
    """Clips as frame strips: one row per (test prompt, column), the evaluation's saved strip of that clip captioned
    with the column and the prompt (:func:`jagg_core.evaluation.clip_layout.strips_grid`, bounded like the image
    grids)."""
    rows = [(strip_path(root, x["style"], x["index"]), f"{title}: {x['prompt']}")
            for x in picked for title, root in columns]
    save_png(strips_grid([p for p, _ in rows], [c for _, c in rows]), out)
    return [t for t, _ in columns]


def base_model_grid(lay: Layout, out: Path, *, per_style: int = 4, metric: str = "toy_fidelity") -> Path:
    """The evaluated base model's first test images of each style, captioned with prompt and ``metric`` (a PNG)."""
    import torch

    card = lay.eval_dir("base") / "metrics.json"
    if not card.exists():
        raise FileNotFoundError(f"{card} does not exist; evaluate the base model first (`jagg evaluate --run base`).")
    root = lay.root / _images_of(card)
    rows = read_scores(root.parent / "scores.jsonl") or []
    picked = [x for x in rows if x["index"] < per_style]
    images = torch.stack([load_image(image_path(root, x["style"], x["index"])) for x in picked])
    captions = [f"{x['prompt']} [{metric} {x[metric]:.2f}]" if metric in x else x["prompt"] for x in picked]
    grid = image_grid(images, captions, ncols=per_style, scale=5, caption_width=24)
    save_png(grid, Path(out))
    return Path(out)


def plot_per_second(runs: Sequence[Any], metric: str, base: dict[str, float] | None,
                    seconds_per_iteration: dict[str, dict[str, Any]], images_per_iteration: int, path: Path, *,
                    subset: int | None = None) -> bool:
    """The primary held-out score against images seen (left) and training seconds (right): every method's mean over
    seeds with its ± sd band. Seconds at iteration k are k times the method's seconds per iteration
    (jagg_core/pipeline/report_stats.py: from one machine state where the `speed` stage ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method = _method_curves(runs, f"eval/{metric}", base_point=(base or {}).get(metric), from_eval=True, smooth=1)
    if not by_method or not seconds_per_iteration:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 3.8), dpi=120)
    sources = {v["source"] for v in seconds_per_iteration.values()}
    for ax, scale, label in ((axes[0], lambda m: images_per_iteration, "images seen"),
                             (axes[1], lambda m: seconds_per_iteration.get(m, {}).get("seconds", float("nan")),
                              f"training seconds (seconds per iteration: {' / '.join(sorted(sources))})")):
        scaled = {m: [{x * scale(m): y for x, y in c.items()} for c in curves] for m, curves in by_method.items()}
        _draw_curves(ax, scaled, markers=True)
        ax.set_xlabel(label, fontsize=9)
        ax.set_title(f"{_split_label(subset)}: {metric}", fontsize=10)
    _save_panels(fig, axes, path)
    return True
