"""Round 3 of the toy RL study (docs/toy_rl.md): the pilots' table and curves from the cells'
``scripts/toy_rl_study.py`` records.

    python scripts/toy_rl_round3.py docs/toy_rl/round3.jsonl --out docs/toy_rl/round3.png

Prints one markdown row per cell (seeds pooled: each seed's gain in held-out ``toy_fidelity`` and in
``toy_preference``, their mean) and draws each cell's mean validation curve of both scores by iteration (the records
were taken on the split that was the world's test split then and is its validation split now: docs/toy_world.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="the figure (PNG); none: the table only")
    args = ap.parse_args(argv)
    cells: dict[tuple[str, str], list[dict]] = {}
    for line in args.records.read_text().splitlines():
        r = json.loads(line)
        cells.setdefault((r["name"].rsplit("-s", 1)[0], r["method"]), []).append(r)

    print("| cell | method | seeds | validation `toy_fidelity` by checkpoint (seed by seed) | gain per seed | mean gain |"
          " `toy_preference` change per seed | mean |")
    print("|---|---|---|---|---|---|---|---|")
    for (cell, method), rs in cells.items():
        rs.sort(key=lambda r: r["seed"])
        fid = [r["metrics"]["toy_fidelity"] for r in rs]
        pref = [r["metrics"]["toy_preference"] for r in rs]
        gains = [f["final"] - f["base"] for f in fid]
        dpref = [p["final"] - p["base"] for p in pref]
        curves = "; ".join(" ".join(f"{y:.3f}" for s, y in f["curve"] if s) for f in fid)
        print(f"| {cell} | {method} | {', '.join(str(r['seed']) for r in rs)} | {curves} | "
              f"{' '.join(f'{g:+.3f}' for g in gains)} | {statistics.fmean(gains):+.3f} | "
              f"{' '.join(f'{d:+.3f}' for d in dpref)} | {statistics.fmean(dpref):+.3f} |")

    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), dpi=110)
        for i, ((cell, method), rs) in enumerate(cells.items()):
            for ax, metric in zip(axes, ("toy_fidelity", "toy_preference")):
                by_step: dict[int, list[float]] = {}
                for r in rs:
                    m = r["metrics"][metric]
                    for s, y in [(0, m["base"])] + [(s, y) for s, y in m["curve"] if s]:
                        by_step.setdefault(s, []).append(y)
                xs = sorted(by_step)
                ax.plot(xs, [statistics.fmean(by_step[x]) for x in xs], marker="o", markersize=3,
                        color=f"C{i % 10}", linestyle="-" if i < 10 else "--",
                        label=f"{cell} {method} ({len(rs)} seed{'s' if len(rs) > 1 else ''})")
        for ax, metric in zip(axes, ("toy_fidelity (trained)", "toy_preference (not trained on)")):
            ax.set_title(f"validation split: {metric}, mean over seeds")
            ax.set_xlabel("iteration")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
