"""The figures and the cell table of docs/toy_rl.md, from the study's JSON files in docs/toy_rl/.

    python scripts/toy_rl_plots.py          # writes docs/toy_rl/*.png and prints the markdown table of the cells
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "toy_rl"


def _smooth(xs, k=4):
    return [statistics.fmean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def cells() -> list[dict]:
    return [json.loads(line) for line in (DOCS / "runs.jsonl").read_text().splitlines() if line.strip()]


def table(rows: list[dict]) -> str:
    out = ["| cell | changed from the toy recipe | rollout fidelity, train prompts (first → last quarter) | "
           "test fidelity (8/16/24/32) | gain over base |", "|---|---|---|---|---|"]
    for r in rows:
        changed = ", ".join(f"`{k}={json.dumps(v) if isinstance(v, dict) else v}`" for k, v in r["overrides"].items())
        curve = " / ".join(f"{v:.3f}" for _, v in r["test_curve"])
        out.append(f"| {r['name']} | {changed or '–'} | {r['train_reward_first']:.3f} → {r['train_reward_last']:.3f} | "
                   f"{curve} | {r['gain']:+.4f} |")
    return "\n".join(out)


def step_table() -> str:
    """One row per (training reward, direction, r): fidelity and JPEG reward after the step, same and other prompts."""
    out = ["| trained on | direction | r | toy_fidelity, same / other prompts | jpeg_compressibility, same / other |",
           "|---|---|---|---|---|"]
    for path in sorted(DOCS.glob("step-*.json")):
        data = json.loads(path.read_text())
        for row in data["rows"]:
            s, o = row["same_prompts"], row["other_prompts"]
            out.append(f"| {' + '.join(data['reward'])} | {row['direction']} | {row['r']:+g} | "
                       f"{s['toy_fidelity']:.4f} / {o['toy_fidelity']:.4f} | "
                       f"{s['jpeg_compressibility']:.4f} / {o['jpeg_compressibility']:.4f} |")
    return "\n".join(out)


def plot_cells(rows: list[dict]) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=110)
    for i, r in enumerate(rows):
        ys = _smooth(r["train_reward_curve"])
        a.plot(range(1, len(ys) + 1), ys, color=f"C{i % 10}", label=r["name"])
        steps, vals = zip(*([(0, r["base"])] + [tuple(x) for x in r["test_curve"]]))
        b.plot(steps, vals, color=f"C{i % 10}", marker="o", markersize=3)
    a.set_title("training prompts: rollout toy_fidelity (4-iteration mean)")
    a.set_xlabel("iteration")
    b.axhline(rows[0]["base"], color="grey", ls="--", lw=1)
    b.set_title("test split: toy_fidelity (ODE, benchmark protocol)")
    b.set_xlabel("iteration")
    a.legend(fontsize=7, ncol=2)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(DOCS / "cells.png")
    plt.close(fig)


def plot_kl() -> None:
    data = json.loads((DOCS / "kl.json").read_text())
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    steps = data["train_steps"]
    for k, row in enumerate(data["after"][1:], 1):
        ax.semilogy(steps, [max(row["per_step"][str(s)]["approx_kl"], 1e-12) for s in steps], marker="o",
                    label=f"after {k} optimizer step{'s' if k > 1 else ''} (top 1%: {row['top1pct_share']:.0%})")
    ax.set_xlabel("SDE step of the rollout (0 = highest noise)")
    ax.set_ylabel("½·mean(log_ratio²)")
    ax.set_title(f"where approx_kl comes from (lr {data['lr']:g}, 16 prompts × 8)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(DOCS / "kl.png")
    plt.close(fig)


def plot_snr() -> None:
    rows = json.loads((DOCS / "snr.json").read_text())["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for key, marker in (("cos_same_prompts", "o"), ("cos_other_prompts", "s")):
        ax.scatter([r["images"] * (1.03 if marker == "s" else 0.97) for r in rows], [r[key] for r in rows],
                   marker=marker, label=key.replace("_", " "))
    ax.axhline(0, color="grey", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("images per gradient estimate")
    ax.set_ylabel("cos(g_a, g_b)")
    ax.set_title("toy_fidelity: cosine of two independent GRPO gradients")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(DOCS / "snr.png")
    plt.close(fig)


def main() -> int:
    rows = cells()
    plot_cells(rows)
    for name, fn in (("kl.json", plot_kl), ("snr.json", plot_snr)):
        if (DOCS / name).exists():
            fn()
    print(table(rows))
    print()
    print(step_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
