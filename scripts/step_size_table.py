"""The step-size study's tables (docs/frontier.md, "Every method at its own learning rate"), from a finished `jagg run
--profile toy-lr` (or its confirmation with --set): its report's summary.json and its runs' update sizes.

    python scripts/step_size_table.py [--root .] [--outputs toy-lr] [--metric toy_fidelity]

Prints, per method and rate (a method ``<name>-x<rate>`` is ``<name>`` at ``lr_scale`` <rate>, ``_`` for the
point): the mean score over its seeds with its Student-t interval, its difference from the exact baseline at train.lr
paired by seed, and AdamW's update against that baseline's at the same seed and iteration (train.update_size_every):
the ratio of ‖Δθ‖ (mean over the measured iterations and seeds) and the cosine at the first iteration, where both
start from the same weights and rollout (later iterations start from different weights). Then each method's rate
with the highest mean score: the choice the screen makes (on the validation split, never on the test split).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def t_interval(xs: list[float]) -> tuple[float, float, float]:
    """Mean and Student-t 95% interval: the report's own (summary.json's intervals over seeds)."""
    from jagg_core.pipeline.report_stats import t_interval as report_interval

    t = report_interval(xs)
    return t["mean"], t["lo"], t["hi"]


def split(method: str) -> tuple[str, float]:
    base, _, rate = method.partition("-x")
    return base, float(rate.replace("_", ".")) if rate else 1.0


@functools.lru_cache(maxsize=None)  # the baseline's of a seed is read for every method
def update_sizes(runs: Path, run: str) -> dict[int, float]:
    """``train/update_norm`` by iteration, where the run measured it."""
    with open(runs / run / "curve.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return {int(r["iteration"]): float(r["train/update_norm"]) for r in rows
            if r.get("train/update_norm") not in (None, "", "nan")}


@functools.lru_cache(maxsize=None)
def first_update(runs: Path, run: str) -> "torch.Tensor":  # noqa: F821
    """The run's first kept update (train.update_size_every), flat, in float64."""
    import torch
    from safetensors.torch import load_file

    t = load_file(runs / run / "updates" / "update-000001.safetensors")
    return torch.cat([v.flatten().double() for _, v in sorted(t.items())])


def first_update_cos(runs: Path, a: str, b: str) -> float:
    x, y = first_update(runs, a), first_update(runs, b)
    return float(x @ y / (x.norm() * y.norm()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT))
    ap.add_argument("--outputs", default="toy-lr")
    ap.add_argument("--metric", default="toy_fidelity")
    args = ap.parse_args(argv)
    root, metric = Path(args.root), args.metric
    summary = json.loads((root / "reports" / args.outputs / "summary.json").read_text())
    runs = root / "runs" / args.outputs
    scores: dict[str, dict[int, float]] = {}
    for r in summary["runs"]:
        scores.setdefault(r["method"], {})[r["seed"]] = r["final"][metric]
    print(f"| method | rate | {metric}, mean [95% CI over seeds] | − baseline × 1, paired by seed | ‖Δθ‖ / baseline's "
          f"(same seed, iteration) | cos(Δθ, baseline's) at iteration 1 |")
    print("|---|---|---|---|---|---|")
    best: dict[str, tuple[float, float]] = {}
    for method, by_seed in scores.items():
        name, rate = split(method)
        seeds = sorted(by_seed)
        mean, lo, hi = t_interval([by_seed[s] for s in seeds])
        if name not in best or mean > best[name][1]:
            best[name] = (rate, mean)
        base = scores.get("baseline", {})
        paired = [by_seed[s] - base[s] for s in seeds if s in base]
        pm, plo, phi = t_interval(paired) if paired and method != "baseline" else (float("nan"),) * 3
        ratios, coss = [], []
        for s in seeds:
            mine, ref = f"{method}-s{s}", f"baseline-s{s}"
            try:
                a, b = update_sizes(runs, mine), update_sizes(runs, ref)
                ratios += [a[i] / b[i] for i in a if i in b and b[i] > 0]
                coss.append(first_update_cos(runs, ref, mine))
            except (OSError, KeyError):
                continue
        ratio = f"{statistics.fmean(ratios):.3f}" if ratios else "–"
        cos = f"{statistics.fmean(coss):.3f} ({min(coss):.3f}–{max(coss):.3f})" if coss else "–"
        diff = f"{pm:+.4f} [{plo:+.4f}, {phi:+.4f}]" if pm == pm else "–"
        print(f"| {name} | × {rate:g} | {mean:.4f} [{lo:.4f}, {hi:.4f}] (n = {len(seeds)}) | {diff} | {ratio} | {cos} |")
    print()
    for name, (rate, mean) in best.items():
        print(f"{name}: chosen rate × {rate:g} (mean {metric} {mean:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
