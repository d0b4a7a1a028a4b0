"""The report's pages: README.md and index.html from its summary (tables of final scores, per-seed gains, paired
differences and speed), and the one markdown-table writer that the report, the benchmark page and the smoke test
share."""

from __future__ import annotations

import html
import math
import statistics
from typing import Any, Sequence

from ..setup.config import Params
from .report_protocols import evaluation_html, evaluation_markdown

__all__ = ["fmt", "markdown_table", "page_html", "page_markdown"]


def fmt(x: Any, digits: int = 4) -> str:
    if isinstance(x, float):
        return "–" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def _final_table(summary: dict, metrics: Sequence[str]) -> list[list[str]]:
    head = ["method", "seeds"] + metrics
    rows = [head]
    if summary.get("ground_truth"):
        rows.append(["ground truth (the world's renders)", "–"] +
                    [fmt(summary["ground_truth"].get(m, float("nan"))) for m in metrics])
    if summary["base"]:
        rows.append(["base model (step 0)", "–"] + [fmt(summary["base"][m]) for m in metrics])
    for r in summary["final"]:
        rows.append([r["method"], str(r.get("seeds", 0))] +
                    [f"{fmt(r[m][0])} ± {fmt(r[m][1])}" if r.get("seeds", 0) > 1 else fmt(r[m][0])
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
                cells.append(fmt(v))
            else:
                gains.append(v - base)
                cells.append(f"{fmt(v)} ({v - base:+.4f})")
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
        extra = [fmt(r.get(k, float("nan")), 2) + "×" for k in ("update_speedup_vs_batched",
                                                                 "update_speedup_vs_best_exact")] if batched else []
        rows.append([r["method"], r["mode"], str(r["window"]), fmt(r["jagg_frac"], 2), fmt(r["time/iteration"], 2),
                     fmt(r["time/update"], 2), fmt(r["time/backward"], 2), fmt(r["backward_calls"], 1),
                     fmt(r.get("update_speedup", float("nan")), 2) + "×", *extra,
                     fmt(r["ideal_update_speedup"], 2) + "×", fmt(r.get("measured_over_ideal", float("nan")), 2),
                     fmt(r.get("iteration_speedup", float("nan")), 2) + "×"])
    return rows


def markdown_table(rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; the first row is the header (the report's and the benchmark page's one writer)."""
    head = [str(c) for c in rows[0]]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                     ["| " + " | ".join(str(c) for c in r) + " |" for r in rows[1:]]) + "\n"


def page_markdown(params: Params, summary: dict, breakdown: list[list[str]]) -> str:
    """The report's README.md; ``breakdown`` is the iteration-breakdown table."""
    metrics = list(params.eval.metrics)
    parts = [f"# jagg report — profile `{params.profile}`\n",
             "Baseline GRPO (exact per-step backward) against JAGG and the endpoint-only ablation, same seeds, "
             "same rollouts budget.\n",
             f"## Final evaluation (test set, protocol `{params.eval.protocol}`; mean ± std over seeds)\n",
             markdown_table(_final_table(summary, metrics)), *_lead_figure_markdown(summary),
             evaluation_markdown(summary["evaluation"], markdown_table),
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
             markdown_table(breakdown),
             "Overhead = fidelity monitor + kl_ref reference + logging + checkpoint + other (what is neither rollout, "
             "reward nor the update stage). A phase that runs every N iterations (its column says so) counts 0 in the "
             "others: the mean is its share of the run.\n"]
    for key, name in list(summary["figures"].items())[1:]:
        parts.append(f"## {key}\n\n![{key}]({name})\n")
    return "\n".join(parts)


def _lead_figure_markdown(summary: dict) -> list[str]:
    """The first figure (what was learned on the test split, by iteration), shown under the final scores."""
    return [f"![{key}]({name})\n" for key, name in list(summary["figures"].items())[:1]]


def _html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page_html(params: Params, summary: dict, breakdown: list[list[str]]) -> str:
    """The report's index.html; ``breakdown`` is the iteration-breakdown table."""
    metrics = list(params.eval.metrics)
    shown = [f"<h2>{html.escape(k)}</h2><img src=\"{html.escape(v)}\" alt=\"{html.escape(k)}\">"
             for k, v in summary["figures"].items()]
    lead, figs = "".join(shown[:1]), "".join(shown[1:])  # the first figure under the final scores
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>jagg report — {html.escape(params.profile)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}
th{{background:#f4f4f4}}td:first-child,th:first-child{{text-align:left}}img{{max-width:100%}}
.wide{{overflow-x:auto}}.wide table{{font-size:0.85em}}</style></head>
<body><h1>jagg report — profile <code>{html.escape(params.profile)}</code></h1>
<p>Baseline GRPO (exact per-step backward) against JAGG and the endpoint-only ablation.</p>
<h2>Final evaluation (protocol {params.eval.protocol}; mean ± std over seeds)</h2>{_html_table(_final_table(summary, metrics))}{lead}{evaluation_html(summary["evaluation"], _html_table)}
{"".join(f"<h2>Per seed: final {html.escape(m)} (gain over the base model)</h2>{_html_table(_seed_rows(summary, m))}" for m in metrics)}
<h2>Paired by seed: differences of final {html.escape(metrics[0])} (Student-t 95% interval)</h2>{_html_table(_paired_rows(summary))}
<h2>Speed per iteration</h2><div class="wide">{_html_table(_speed_rows(summary))}</div>
<p>Ideal = the cost model's update-stage speedup (forward 1, backward 2) from the counted forwards.</p>
<h2>Where an iteration's time goes (seconds, mean per iteration)</h2><div class="wide">{_html_table(breakdown)}</div>
<p>Overhead = fidelity monitor + kl_ref reference + logging + checkpoint + other (neither rollout, reward nor the
update stage). A phase that runs every N iterations (its column says so) counts 0 in the others: the mean is its
share of the run.</p>
{figs}
</body></html>
"""
