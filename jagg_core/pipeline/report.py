"""The comparison report: the speed table, the iteration breakdown, paired differences and the pages (summary.json,
README.md, index.html); its figures and image grids are drawn by :mod:`jagg_core.pipeline.report_figures`.

Reads what the stages wrote — ``eval/<profile>/<run>/metrics.json`` and images, ``runs/<profile>/<run>/curve.tsv`` —
and writes ``reports/<profile>/{index.html, README.md, *.png, summary.json}``. Nothing here trains or samples.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .config import Params
from ..cost import ideal_speedup
from .paths import Layout, run_name
from .report_diagnostics import diagnostic_figures
from .report_figures import comparison_grid, mean_std, plot_curves, plot_fidelity, plot_stacked_bars
from .report_protocols import evaluation_html, evaluation_markdown, evaluation_section
from .storage import atomic_write_text

__all__ = ["build_report", "breakdown_rows", "cost_model_speedup", "fidelity_by_position", "iteration_breakdown",
           "markdown_table", "read_curve", "speed_table", "PHASES"]


def read_curve(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    rows = csv.DictReader(io.StringIO(path.read_text()), delimiter="\t")
    return [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in rows]


def cost_model_speedup(*, grad_forwards: float, nograd_forwards: float, reused: float = 0.0) -> float:
    """Ideal update-stage speedup over exact (:func:`jagg_core.cost.ideal_speedup`) from the counted forwards of a
    run: with-grad forwards, no-grad forwards, and velocities reused from the rollout, all counting as steps."""
    return ideal_speedup(steps=grad_forwards + nograd_forwards + reused, grad_forwards=grad_forwards,
                         nograd_forwards=nograd_forwards)


@dataclass
class _Run:
    method: str
    seed: int
    curve: list[dict[str, float]]
    eval: dict[str, Any] | None


def _load_runs(params: Params, lay: Layout) -> list[_Run]:
    runs = []
    for method in params.run.methods:
        for seed in params.run.seeds:
            name = run_name(method, seed)
            mf = lay.eval_dir(name) / "metrics.json"
            runs.append(_Run(method, seed, read_curve(lay.curve(name)),
                             json.loads(mf.read_text()) if mf.exists() else None))
    return runs


def speed_table(params: Params, runs: Sequence[_Run]) -> list[dict[str, Any]]:
    """Per method: mean iteration / update / backward time (first iteration excluded as warm-up), speedups."""
    rows = []
    by_method: dict[str, list[dict[str, float]]] = {}
    for r in runs:
        by_method.setdefault(r.method, []).extend(r.curve[1:] if len(r.curve) > 1 else r.curve)
    base = by_method.get(next((m for m in by_method if params.methods[m].mode == "exact"), ""), [])
    # exact-batched (all W steps of a group in one forward call and one backward): on a small model batching alone
    # may be the win, so speedups are also given against the better of the two exact backwards
    batched = by_method.get(next((m for m in by_method if params.methods[m].mode == "exact_batched"), ""), [])

    def mean(rows_: list[dict[str, float]], key: str) -> float:
        return mean_std([x[key] for x in rows_ if key in x])[0]

    for method, curve in by_method.items():
        m = params.method(method)
        row = {"method": method, "mode": m.mode, "window": m.window, "jagg_frac": m.jagg_frac,
               "anchors": m.anchors, "iterations": len(curve)}
        for key in ("time/iteration", "time/rollout", "time/update", "time/backward"):
            row[key] = mean(curve, key)
        row["backward_calls"] = mean(curve, "train/backward_calls")
        row["ideal_update_speedup"] = cost_model_speedup(
            grad_forwards=mean(curve, "train/grad_forwards"), nograd_forwards=mean(curve, "train/nograd_forwards"),
            reused=mean(curve, "jagg/reused_velocities"),
        )
        if base:
            row["update_speedup"] = mean(base, "time/update") / row["time/update"]
            row["iteration_speedup"] = mean(base, "time/iteration") / row["time/iteration"]
            row["measured_over_ideal"] = (row["update_speedup"] - 1) / (row["ideal_update_speedup"] - 1) if (
                row["ideal_update_speedup"] > 1) else float("nan")
        if base and batched:
            best = min(mean(base, "time/update"), mean(batched, "time/update"))
            row["update_speedup_vs_batched"] = mean(batched, "time/update") / row["time/update"]
            row["update_speedup_vs_best_exact"] = best / row["time/update"]
        rows.append(row)
    return rows


# An iteration's phases, in the order they run: (label, how to get its seconds from a curve row). The update's forward
# is time/update less its backward; what no phase accounts for (advantages, the reward gather) is "other".
PHASES = (
    ("rollout", lambda x: x.get("time/rollout", 0.0)),
    ("reward", lambda x: x.get("time/reward", 0.0)),
    ("update forward", lambda x: x.get("time/update", 0.0) - x.get("time/backward", 0.0)),
    ("update backward", lambda x: x.get("time/backward", 0.0)),
    ("gradient sync", lambda x: x.get("time/sync", 0.0)),
    ("optimizer", lambda x: x.get("time/optimizer", 0.0)),
    ("fidelity monitor", lambda x: x.get("time/fidelity", 0.0)),
    ("kl_ref reference", lambda x: x.get("time/kl_ref", 0.0)),
    ("logging", lambda x: x.get("time/logging", 0.0)),
    ("checkpoint", lambda x: x.get("time/checkpoint", 0.0)),
)
# What a user pays for beyond GRPO itself (rollout, reward and the update stage: forward, backward, sync, optimizer).
OVERHEAD_PHASES = ("fidelity monitor", "kl_ref reference", "logging", "checkpoint", "other")


def iteration_breakdown(runs: Sequence[_Run]) -> list[dict[str, Any]]:
    """Per method: the mean seconds of each phase of an iteration (warm-up iteration excluded; a phase that did not
    run in an iteration counts 0 there), "other" for the rest, and the overhead share of the iteration."""
    by_method: dict[str, list[dict[str, float]]] = {}
    for r in runs:
        rows = [x for x in (r.curve[1:] if len(r.curve) > 1 else r.curve) if "time/iteration" in x]
        by_method.setdefault(r.method, []).extend(rows)
    out = []
    for method, rows in by_method.items():
        if not rows:
            continue
        phases = {name: statistics.fmean(get(x) for x in rows) for name, get in PHASES}
        total = statistics.fmean(x["time/iteration"] for x in rows)
        phases["other"] = max(0.0, total - sum(phases.values()))
        overhead = sum(phases[k] for k in OVERHEAD_PHASES)
        out.append({"method": method, "iterations": len(rows), "iteration_s": total, "phases": phases,
                    "overhead_s": overhead, "overhead_share": overhead / total if total else float("nan")})
    return out


def _plot_breakdown(rows: Sequence[dict[str, Any]], path: Path, title: str) -> bool:
    """One horizontal stacked bar per method: its iteration split into phases (seconds)."""
    return plot_stacked_bars([f"{r['method']}\n{r['overhead_share']:.1%} overhead" for r in rows],
                             [r["phases"] for r in rows], [name for name, _ in PHASES] + ["other"], path,
                             title=title, xlabel="seconds per iteration (mean)")


def breakdown_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The breakdown as a table: seconds per phase, the iteration, and the overhead share."""
    names = [name for name, _ in PHASES] + ["other"]
    table = [["method"] + names + ["iteration s", "overhead"]]
    for r in rows:
        table.append([r["method"]] + [_fmt(r["phases"][n], 3) for n in names] +
                     [_fmt(r["iteration_s"], 3), f"{r['overhead_share']:.1%}"])
    return table


def fidelity_by_position(runs: Sequence[_Run]) -> dict[str, dict[int, tuple[float, float, int]]]:
    """Mean ± std of cos(JAGG, exact) and cos(ablate, exact) per group position over every logged measurement."""
    out: dict[str, dict[int, list[float]]] = {"jagg": {}, "ablate": {}}
    for r in runs:
        for row in r.curve:
            for key, v in row.items():
                for kind in ("jagg", "ablate"):
                    prefix = f"jagg/cos_{kind}/g"
                    if key.startswith(prefix) and v == v:
                        out[kind].setdefault(int(key[len(prefix):]), []).append(v)
    return {k: {g: (*mean_std(vs), len(vs)) for g, vs in sorted(d.items())} for k, d in out.items()}


def _fmt(x: Any, digits: int = 4) -> str:
    if isinstance(x, float):
        return "–" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def build_report(params: Params, lay: Layout) -> dict[str, Any]:
    """Write the report of ``params.profile``; returns its summary (also ``summary.json``)."""
    out = lay.report_dir
    out.mkdir(parents=True, exist_ok=True)
    runs = _load_runs(params, lay)
    base_mf = lay.eval_dir("base") / "metrics.json"
    base = json.loads(base_mf.read_text()) if base_mf.exists() else None
    truth_mf = lay.eval_dir("ground-truth") / "metrics.json"  # the toy's ceiling (evaluate_ground_truth)
    truth = json.loads(truth_mf.read_text()) if truth_mf.exists() else None
    metrics = list(params.eval.metrics)

    # Final evaluation per method: mean ± std over seeds of the benchmark score.
    final = []
    for method in params.run.methods:
        row = {"method": method}
        for m in metrics:
            vals = [r.eval["metrics"][m]["benchmark"] for r in runs if r.method == method and r.eval]
            row[m] = mean_std(vals)
            row["seeds"] = len(vals)
        final.append(row)
    speed = speed_table(params, runs)
    breakdown = iteration_breakdown(runs)

    figures = {}
    if _plot_breakdown(breakdown, out / "iteration.png", "where an iteration's time goes"):
        figures["iteration breakdown"] = "iteration.png"
    if plot_curves(runs, "reward/mean", "training reward (rollouts, 4-iteration mean; ± sd over seeds)",
                    out / "reward.png", smooth=4):
        figures["reward"] = "reward.png"
    for m in metrics:  # each metric that is also a training reward, on the rollouts of the training prompts
        if plot_curves(runs, f"reward/{m}/mean", f"training prompts: {m} of the rollouts (4-iteration mean)",
                        out / f"train-{m}.png", smooth=4):
            figures[f"train/{m}"] = f"train-{m}.png"
    for m in metrics:
        bp = base["metrics"][m]["benchmark"] if base else None
        if plot_curves(runs, f"eval/{m}", f"test split: {m} (± sd over seeds)", out / f"eval-{m}.png", base_point=bp,
                        from_eval=True):
            figures[f"eval/{m}"] = f"eval-{m}.png"
    fid = fidelity_by_position(runs)
    if plot_fidelity(fid, params.jagg.auto_threshold, out / "fidelity.png"):
        figures["fidelity"] = "fidelity.png"
    figures.update(diagnostic_figures(params, runs, out))  # train/kl_ref, per-reward group_std and zero_std_frac
    grid_columns = comparison_grid(params, lay, runs, out / "grid.png")
    if grid_columns:
        figures["grid"] = "grid.png"

    per_run = _per_run(runs, metrics)
    summary = {"profile": params.profile, "primary": metrics[0], "runs": per_run,
               "paired": paired_differences(per_run, metrics[0]),
               "final": final, "speed": speed, "iteration_breakdown": breakdown, "figures": figures,
               "fidelity": {k: {str(g): v for g, v in d.items()} for k, d in fid.items()},
               "base": {m: base["metrics"][m]["benchmark"] for m in metrics} if base else None,
               "ground_truth": {m: truth["metrics"][m]["benchmark"] for m in metrics if m in truth["metrics"]}
               if truth else None,
               "grid_columns": grid_columns, "evaluation": evaluation_section(params, runs, base)}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    atomic_write_text(out / "README.md", _markdown(params, summary))
    atomic_write_text(out / "index.html", _html(params, summary))
    return summary


def _per_run(runs: Sequence[_Run], metrics: Sequence[str]) -> list[dict[str, Any]]:
    """One row per evaluated run: its final test metrics and its mean update time per iteration (warm-up excluded)."""
    rows = []
    for r in runs:
        if not r.eval:
            continue
        curve = r.curve[1:] if len(r.curve) > 1 else r.curve
        rows.append({"method": r.method, "seed": r.seed, "step": r.eval["step"],
                     "final": {m: r.eval["metrics"][m]["benchmark"] for m in metrics if m in r.eval["metrics"]},
                     "update_s_per_iteration": mean_std([x["time/update"] for x in curve if "time/update" in x])[0],
                     "iteration_s": mean_std([x["time/iteration"] for x in curve if "time/iteration" in x])[0]})
    return rows


def paired_interval(diffs: Sequence[float], confidence: float = 0.95) -> dict[str, float]:
    """Mean of paired differences with its Student-t interval (``n − 1`` degrees of freedom)."""
    n = len(diffs)
    mean = statistics.fmean(diffs) if n else float("nan")
    if n < 2:
        return {"n": n, "mean": mean, "sd": float("nan"), "lo": float("nan"), "hi": float("nan")}
    from scipy.stats import t as student_t

    sd = statistics.stdev(diffs)
    half = float(student_t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half}


# The comparisons the paper makes, each paired by seed: (method, against).
PAIRS = (("jagg", "baseline"), ("ablate", "jagg"), ("ablate-matched", "jagg"), ("jagg-reuse", "jagg"),
         ("ablate", "baseline"), ("ablate-matched", "baseline"))


def paired_differences(per_run: Sequence[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """``metric(a) − metric(b)`` per seed for each pair of :data:`PAIRS` that both ran, with a 95% t-interval."""
    final = {(r["method"], r["seed"]): r["final"].get(metric) for r in per_run}
    out = []
    for a, b in PAIRS:
        seeds = sorted(s for (m, s) in final if m == a and (b, s) in final)
        if seeds:
            diffs = [final[(a, s)] - final[(b, s)] for s in seeds]
            out.append({"a": a, "b": b, "metric": metric, "seeds": seeds, "diffs": diffs, **paired_interval(diffs)})
    return out


def _final_table(summary: dict, metrics: Sequence[str]) -> list[list[str]]:
    head = ["method", "seeds"] + metrics
    rows = [head]
    if summary.get("ground_truth"):
        rows.append(["ground truth (the world's renders)", "–"] +
                    [_fmt(summary["ground_truth"].get(m, float("nan"))) for m in metrics])
    if summary["base"]:
        rows.append(["base model (step 0)", "–"] + [_fmt(summary["base"][m]) for m in metrics])
    for r in summary["final"]:
        rows.append([r["method"], str(r.get("seeds", 0))] +
                    [f"{_fmt(r[m][0])} ± {_fmt(r[m][1])}" if r.get("seeds", 0) > 1 else _fmt(r[m][0])
                     for m in metrics])  # one seed has no spread to show
    return rows


def _seed_rows(summary: dict, metric: str) -> list[list[str]]:
    """Per method and seed: the final ``metric`` and its gain over the base model; with a ground truth, the share of
    the base model's gap to it that the mean gain closes."""
    seeds = sorted({r["seed"] for r in summary["runs"]})
    base = (summary["base"] or {}).get(metric)
    gap = (summary.get("ground_truth") or {}).get(metric, float("nan")) - base if base is not None else float("nan")
    rows = [["method"] + [f"seed {s}" for s in seeds] + ["mean gain"] + (["gap closed"] if gap == gap else [])]
    for method in dict.fromkeys(r["method"] for r in summary["runs"]):
        got = {r["seed"]: r["final"].get(metric) for r in summary["runs"] if r["method"] == method}
        cells, gains = [], []
        for s in seeds:
            v = got.get(s)
            if v is None:
                cells.append("–")
            elif base is None:
                cells.append(_fmt(v))
            else:
                gains.append(v - base)
                cells.append(f"{_fmt(v)} ({v - base:+.4f})")
        mean_gain = statistics.fmean(gains) if gains else float("nan")
        rows.append([method] + cells + [f"{mean_gain:+.4f}" if gains else "–"] +
                    ([f"{mean_gain / gap:.0%}" if gains and gap > 0 else "–"] if gap == gap else []))
    return rows


def _paired_rows(summary: dict) -> list[list[str]]:
    rows = [["difference", "seeds", "mean", "95% interval", "per seed"]]
    for p in summary["paired"]:
        rows.append([f"{p['a']} − {p['b']}", str(p["n"]), f"{p['mean']:+.4f}",
                     f"[{p['lo']:+.4f}, {p['hi']:+.4f}]" if p["n"] > 1 else "–",
                     ", ".join(f"{d:+.4f}" for d in p["diffs"])])
    return rows


def _speed_rows(summary: dict) -> list[list[str]]:
    batched = any("update_speedup_vs_batched" in r for r in summary["speed"])
    rows = [["method", "mode", "W", "jagg_frac", "s/iteration", "update s", "backward s", "backward calls",
             "update speedup", *(["vs exact-batched", "vs better exact"] if batched else []), "ideal (cost model)",
             "measured/ideal gain", "iteration speedup"]]
    for r in summary["speed"]:
        extra = [_fmt(r.get(k, float("nan")), 2) + "×" for k in ("update_speedup_vs_batched",
                                                                 "update_speedup_vs_best_exact")] if batched else []
        rows.append([r["method"], r["mode"], str(r["window"]), _fmt(r["jagg_frac"], 2), _fmt(r["time/iteration"], 2),
                     _fmt(r["time/update"], 2), _fmt(r["time/backward"], 2), _fmt(r["backward_calls"], 1),
                     _fmt(r.get("update_speedup", float("nan")), 2) + "×", *extra,
                     _fmt(r["ideal_update_speedup"], 2) + "×", _fmt(r.get("measured_over_ideal", float("nan")), 2),
                     _fmt(r.get("iteration_speedup", float("nan")), 2) + "×"])
    return rows


def markdown_table(rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; the first row is the header (the report's and the benchmark page's one writer)."""
    head = [str(c) for c in rows[0]]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                     ["| " + " | ".join(str(c) for c in r) + " |" for r in rows[1:]]) + "\n"


def _markdown(params: Params, summary: dict) -> str:
    metrics = list(params.eval.metrics)
    parts = [f"# jagg report — profile `{params.profile}`\n",
             "Baseline GRPO (exact per-step backward) against JAGG and the endpoint-only ablation, same seeds, "
             "same rollouts budget.\n",
             f"## Final evaluation (test set, protocol `{params.eval.protocol}`; mean ± std over seeds)\n",
             markdown_table(_final_table(summary, metrics)), evaluation_markdown(summary["evaluation"], markdown_table),
             *[part for m in metrics for part in (f"## Per seed: final `{m}` (gain over the base model)\n",
                                                  markdown_table(_seed_rows(summary, m)))],
             f"## Paired by seed: differences of final `{metrics[0]}` (Student-t 95% interval)\n",
             markdown_table(_paired_rows(summary)),
             "## Speed (per iteration; update = forward + backward on stored experience)\n",
             markdown_table(_speed_rows(summary)),
             "The ideal speedup is the cost model's (forward 1, backward 2) from the counted forwards: 3W/(W+4) "
             "for JAGG with no-grad middle steps, W/2 with rollout-velocity reuse. 'measured/ideal gain' is "
             "(measured − 1)/(ideal − 1).\n",
             "## Where an iteration's time goes (seconds, mean per iteration)\n",
             markdown_table(breakdown_rows(summary.get("iteration_breakdown", []))),
             "Overhead = fidelity monitor + kl_ref reference + logging + checkpoint + other (what is neither rollout, "
             "reward nor the update stage).\n"]
    for key, name in summary["figures"].items():
        parts.append(f"## {key}\n\n![{key}]({name})\n")
    return "\n".join(parts)


def _html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _html(params: Params, summary: dict) -> str:
    metrics = list(params.eval.metrics)
    figs = "".join(f"<h2>{html.escape(k)}</h2><img src=\"{html.escape(v)}\" alt=\"{html.escape(k)}\">"
                   for k, v in summary["figures"].items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>jagg report — {html.escape(params.profile)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}
th{{background:#f4f4f4}}td:first-child,th:first-child{{text-align:left}}img{{max-width:100%}}
.wide{{overflow-x:auto}}.wide table{{font-size:0.85em}}</style></head>
<body><h1>jagg report — profile <code>{html.escape(params.profile)}</code></h1>
<p>Baseline GRPO (exact per-step backward) against JAGG and the endpoint-only ablation.</p>
<h2>Final evaluation (protocol {params.eval.protocol}; mean ± std over seeds)</h2>{_html_table(_final_table(summary, metrics))}{evaluation_html(summary["evaluation"], _html_table)}
{"".join(f"<h2>Per seed: final {html.escape(m)} (gain over the base model)</h2>{_html_table(_seed_rows(summary, m))}" for m in metrics)}
<h2>Paired by seed: differences of final {html.escape(metrics[0])} (Student-t 95% interval)</h2>{_html_table(_paired_rows(summary))}
<h2>Speed per iteration</h2><div class="wide">{_html_table(_speed_rows(summary))}</div>
<p>Ideal = the cost model's update-stage speedup (forward 1, backward 2) from the counted forwards.</p>
<h2>Where an iteration's time goes (seconds, mean per iteration)</h2><div class="wide">{_html_table(breakdown_rows(summary.get("iteration_breakdown", [])))}</div>
<p>Overhead = fidelity monitor + kl_ref reference + logging + checkpoint + other (neither rollout, reward nor the
update stage).</p>
{figs}
</body></html>
"""
