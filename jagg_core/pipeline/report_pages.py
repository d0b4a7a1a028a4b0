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

__all__ = ["NOT_MEASURED", "fmt", "markdown_table", "page_html", "page_markdown", "said"]


def fmt(x: Any, digits: int = 4) -> str:
    if isinstance(x, float):
        return "–" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def _iv(pair: Any) -> str:
    return f"[{pair[0]:.4f}, {pair[1]:.4f}]" if pair else "–"


def _final_table(summary: dict, metrics: Sequence[str]) -> list[list[str]]:
    """Final scores: mean ± sd over seeds, and the mean's 95% intervals over seeds (Student-t) and over prompts
    (bootstrap: the test split's prompts resampled)."""
    head = ["method", "seeds"] + [f"{m}{h}" for m in metrics for h in ("", ": seeds 95%", ": prompts 95%")]
    rows = [head]
    boot = summary.get("prompt_intervals") or {}
    if summary.get("ground_truth"):
        rows.append(["ground truth (the world's renders)", "–"] +
                    [c for m in metrics for c in (fmt(summary["ground_truth"].get(m, float("nan"))), "–", "–")])
    if summary["base"]:
        rows.append(["base model (step 0)", "–"] +
                    [c for m in metrics for c in (fmt(summary["base"][m]), "–", _iv(boot.get("base", {}).get(m)))])
    for r in summary["final"]:
        cells = []
        for m in metrics:
            iv = r.get("intervals", {}).get(m, {})
            seeds = iv.get("seeds") or {}
            cells += [f"{fmt(r[m][0])} ± {fmt(r[m][1])}" if r.get("seeds", 0) > 1 else fmt(r[m][0]),
                      _iv((seeds["lo"], seeds["hi"])) if seeds.get("n", 0) > 1 else "–", _iv(iv.get("prompts"))]
        rows.append([r["method"], str(r.get("seeds", 0))] + cells)
    return rows


def _gain_rows(summary: dict, metrics: Sequence[str]) -> list[list[str]]:
    """Per method: the mean gain over the base model with its intervals over seeds and over prompts."""
    rows = [["method", "seeds"] + [f"{m}{h}" for m in metrics for h in (" gain", ": seeds 95%", ": prompts 95%")]]
    for r in summary["final"]:
        cells = []
        for m in metrics:
            iv = r.get("intervals", {}).get(m, {})
            g = iv.get("gain_seeds") or {}
            cells += [f"{g['mean']:+.4f}" if g.get("n") else "–",
                      f"[{g['lo']:+.4f}, {g['hi']:+.4f}]" if g.get("n", 0) > 1 else "–",
                      f"[{iv['gain_prompts'][0]:+.4f}, {iv['gain_prompts'][1]:+.4f}]" if iv.get("gain_prompts") else "–"]
        rows.append([r["method"], str(r.get("seeds", 0))] + cells)
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
    rows = [["difference", "seeds", "mean", "seeds 95% (Student-t)", "prompts 95% (bootstrap)", "per seed"]]
    for p in summary["paired"]:
        pi = p.get("prompts_interval")
        rows.append([f"{p['a']} − {p['b']}", str(p["n"]), f"{p['mean']:+.4f}",
                     f"[{p['lo']:+.4f}, {p['hi']:+.4f}]" if p["n"] > 1 else "–",
                     f"[{pi[0]:+.4f}, {pi[1]:+.4f}]" if pi else "–",
                     ", ".join(f"{d:+.4f}" for d in p["diffs"])])
    return rows


def _per_second_rows(summary: dict) -> list[list[str]]:
    """Seconds to reach the baseline's mean final gain, and final gain per 1000 training seconds, per method."""
    ttt = summary.get("time_to_target") or {}
    if not ttt.get("methods"):
        return []
    rows = [["method", "s / iteration", "reached the target", "median seconds (images)",
             "seconds − baseline's (paired)", "final gain per 1000 s", "− baseline's (paired)"]]
    src = summary.get("seconds_per_iteration") or {}
    for method, r in ttt["methods"].items():
        ps, pg, g = r["paired_seconds_vs_baseline"], r["paired_gain_per_1000s_vs_baseline"], r["gain_per_1000s"]
        med = r.get("median_seconds")
        images = sorted(r.get("images") or [])
        rows.append([method, f"{fmt(r['seconds_per_iteration'] or float('nan'), 2)} ({src.get(method, {}).get('source', '–')})",
                     f"{r['reached']} of {r['seeds']} seeds",
                     f"{med:.0f} s ({images[len(images) // 2]:.0f})" if med is not None else "not reached",
                     (f"{ps['mean']:+.0f} s [{ps['lo']:+.0f}, {ps['hi']:+.0f}] ({ps['n']} seeds)" if ps["n"] > 1 else
                      "–") if method != ttt["baseline"] else "–",
                     f"{g['mean']:+.4f} [{g['lo']:+.4f}, {g['hi']:+.4f}]" if g["n"] > 1 else fmt(g["mean"]),
                     (f"{pg['mean']:+.4f} [{pg['lo']:+.4f}, {pg['hi']:+.4f}]" if pg["n"] > 1 else "–")
                     if method != ttt["baseline"] else "–"])
    return rows


def _side_rows(summary: dict) -> list[list[str]]:
    """The `speed` stage's table: every method's update timed side by side; a speedup above the cost model's ideal
    is flagged, not shown as a gain."""
    side = summary.get("side_by_side")
    if not side:
        return []
    rows = [["method", "update s (fastest half [q1, q3])", "speedup vs exact", "vs better exact", "ideal (cost model)",
             "measured / ideal"]]
    for r in side["table"]:
        flag = " ⚑ above ideal: not a gain" if r.get("above_ideal") else ""
        times = (f"{said(r.get('update_s'), 3)} [{said(r.get('update_q1'), 3)}, {said(r.get('update_q3'), 3)}]"
                 if _number(r.get("update_s")) else NOT_MEASURED)
        rows.append([r["method"], times,
                     (said(r["speedup"], 2, "×") + flag) if "speedup" in r else "–",
                     said(r.get("speedup_vs_best_exact"), 2, "×"), said(r.get("ideal"), 2, "×"),
                     said(r.get("measured_over_ideal"), 2) + (" ⚑" if r.get("above_ideal") else "")])
    return rows


# What a side-by-side number that is not one (NaN in speed.json, or its null) shows: a word, not "nan".
NOT_MEASURED = "not measured"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def said(x: Any, digits: int, unit: str = "") -> str:
    """``x`` with ``digits`` decimals and ``unit``, or :data:`NOT_MEASURED` for NaN, an infinity or null."""
    return f"{x:.{digits}f}{unit}" if _number(x) else NOT_MEASURED


def side_note(summary: dict) -> str:
    side = summary.get("side_by_side")
    if not side:
        why = summary.get("side_by_side_note")
        own = "each run's own times, taken at its own time, which a shared machine's load can tilt."
        if why:
            return f"The side-by-side measurement is not shown: {why}. The table below is {own}"
        return f"No side-by-side measurement (`jagg speed`; resources.speed_rounds 0): the table below is {own}"
    return (f"Every method's update stage timed side by side on one stored rollout of the base model "
            f"({side['images']} images, trained steps {side['trained_steps']}, {side['threads']} thread(s)): "
            f"{side['rounds']} rounds, each method and the rollout once per round in a shuffled order, the mean of each "
            f"one's fastest half of the rounds (the least disturbed; rollout's median "
            f"{said(side['rollout'].get('median'), 3, ' s')}). A load that comes and goes hits every method alike. "
            f"{_clock_words(side)}"
            f"⚑ marks a speedup above the cost model's ideal (forward 1, backward 2, from the counted forwards; it counts "
            f"work, not calls, so batching's saving on a small model shows here too): never read as the method's gain. "
            f"The table after it is each run's own times.")


def _clock_words(side: dict) -> str:
    """Which clock the figures are from and the rounds the machine's load disturbed (side_by_side.py)."""
    clock = {"cpu": "the thread's CPU time", "cuda": "CUDA events", "wall": "the wall clock"}.get(side.get("clock"))
    if clock is None:  # a measurement from before the clocks
        return ""
    named = ", ".join(str(d["round"]) for d in side.get("disturbed_rounds") or [])
    return (f"Timed by {clock}, the steadier of the clocks it was timed by; rounds the machine's load disturbed: "
            f"{named or 'none'}. ")


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
                     fmt(r["ideal_update_speedup"], 2) + "×", _flag(r.get("measured_over_ideal", float("nan"))),
                     fmt(r.get("iteration_speedup", float("nan")), 2) + "×"])
    return rows


def _flag(measured_over_ideal: float) -> str:
    """(measured − 1)/(ideal − 1) above 1 is a speedup beyond the cost model: flagged, never read as a gain."""
    text = fmt(measured_over_ideal, 2)
    return text + " ⚑ above ideal" if measured_over_ideal == measured_over_ideal and measured_over_ideal > 1 else text


def markdown_table(rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; the first row is the header (the report's and the benchmark page's one writer)."""
    head = [str(c) for c in rows[0]]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                     ["| " + " | ".join(str(c) for c in r) + " |" for r in rows[1:]]) + "\n"


PER_SECOND_FIGURE = "per_second.png"


def _curve_note(summary: dict) -> str:
    """Where the curves' points come from, when ``eval.curve_subset`` cut them to a subset of the test split."""
    n = summary.get("curve_prompts_per_style")
    return "" if not n else (f" (every curve point, the base model's and the final checkpoint's included, is scored "
                             f"on the same fixed subset of the test split, its first {n} prompts per style; the "
                             f"final scores and gains are the whole split's)")


def _per_second_note(summary: dict) -> str:
    ttt = summary.get("time_to_target") or {}
    if not ttt:
        return ""
    return (f"The target is the baseline's mean final gain in `{ttt['metric']}` ({ttt['target_gain']:+.4f}); a run "
            f"reaches it where its held-out curve (checkpoints, linearly interpolated) first does{_curve_note(summary)}. "
            f"Training seconds "
            f"are iterations × the method's seconds per iteration: with the side-by-side measurement, its rollout and "
            f"the method's update from one machine state plus the rest of an iteration (the same work in every "
            f"method) pooled over the runs; paired intervals are Student-t over the seeds where both reached it.\n")


def page_markdown(params: Params, summary: dict, breakdown: list[list[str]]) -> str:
    """The report's README.md; ``breakdown`` is the iteration-breakdown table."""
    metrics = list(params.eval.metrics)
    figures = [(k, v) for k, v in list(summary["figures"].items())[1:] if v != PER_SECOND_FIGURE]
    per_second = [k for k, v in summary["figures"].items() if v == PER_SECOND_FIGURE]
    parts = [f"# jagg report — profile `{params.profile}`\n",
             "Baseline GRPO (exact per-step backward) against JAGG and the endpoint-only ablation, same seeds, "
             "same rollouts budget.\n",
             *([f"**Verdict.** {summary['verdict']}\n"] if summary.get("verdict") else []),
             f"## Final evaluation (test set, protocol `{params.eval.protocol}`; mean ± std over seeds, the mean's "
             f"95% intervals over seeds and over prompts)\n",
             markdown_table(_final_table(summary, metrics)), *_lead_figure_markdown(summary),
             "## Gains over the base model (the mean's 95% intervals over seeds and over prompts)\n",
             markdown_table(_gain_rows(summary, metrics)),
             evaluation_markdown(summary["evaluation"], markdown_table),
             *[part for m in metrics for part in (f"## Per seed: final `{m}` (gain over the base model)\n",
                                                  markdown_table(_seed_rows(summary, m)))],
             f"## Paired by seed: differences of final `{metrics[0]}` (95% intervals over seeds and over prompts)\n",
             markdown_table(_paired_rows(summary)),
             *([f"## Learning per second\n\n![{per_second[0]}]({PER_SECOND_FIGURE})\n"] if per_second else []),
             *([markdown_table(_per_second_rows(summary)), _per_second_note(summary)]
               if _per_second_rows(summary) else []),
             "## Speed: every method side by side\n", side_note(summary) + "\n",
             *([markdown_table(_side_rows(summary))] if _side_rows(summary) else []),
             "## Speed: each run's own times (per iteration; update = forward + backward on stored experience)\n",
             markdown_table(_speed_rows(summary)),
             "The ideal speedup is the cost model's (forward 1, backward 2) from the counted forwards: 3W/(W+2K) "
             "for a JAGG group of W steps with K anchors and no-grad middle steps (3W/(W+4) at the paper's K = 2), "
             "W/K with rollout-velocity reuse; over several groups, 3 × the trained steps over the groups' summed "
             "cost. 'measured/ideal gain' is "
             "(measured − 1)/(ideal − 1); above 1 it is flagged ⚑: each run timed itself at its own time, and a "
             "speedup beyond the cost model is the machine's load, not the method.\n",
             "## Where an iteration's time goes (seconds, mean per iteration)\n",
             markdown_table(breakdown),
             "Overhead = fidelity monitor + kl_ref reference + logging + checkpoint + other (what is neither rollout, "
             "reward nor the update stage). A phase that runs every N iterations (its column says so) counts 0 in the "
             "others: the mean is its share of the run.\n"]
    for key, name in figures:
        parts.append(f"## {key}\n\n![{key}]({name})\n")
    return "\n".join(parts)


def _lead_figure_markdown(summary: dict) -> list[str]:
    """The first figure (what was learned on the test split, by iteration), shown under the final scores."""
    note = _curve_note(summary)
    return [f"![{key}]({name})\n" + (f"\nThe curves{note}.\n" if note else "")
            for key, name in list(summary["figures"].items())[:1]]


def _html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page_html(params: Params, summary: dict, breakdown: list[list[str]]) -> str:
    """The report's index.html; ``breakdown`` is the iteration-breakdown table."""
    metrics = list(params.eval.metrics)
    shown = [(v, f"<h2>{html.escape(k)}</h2><img src=\"{html.escape(v)}\" alt=\"{html.escape(k)}\">")
             for k, v in summary["figures"].items()]
    lead = shown[0][1] if shown else ""  # the first figure under the final scores
    if lead and _curve_note(summary):
        lead += f"<p>The curves{html.escape(_curve_note(summary))}.</p>"
    figs = "".join(h for v, h in shown[1:] if v != PER_SECOND_FIGURE)
    per_second = "".join(f"<img src=\"{PER_SECOND_FIGURE}\" alt=\"test split by training seconds\">"
                         for v, _ in shown if v == PER_SECOND_FIGURE)
    ps_rows, side_rows = _per_second_rows(summary), _side_rows(summary)
    verdict = f"<p><b>Verdict.</b> {html.escape(summary['verdict'])}</p>" if summary.get("verdict") else ""
    per_seed = "".join(f"<h2>Per seed: final {html.escape(m)} (gain over the base model)</h2>"
                       f"<div class='wide'>{_html_table(_seed_rows(summary, m))}</div>" for m in metrics)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>jagg report — {html.escape(params.profile)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}
th{{background:#f4f4f4}}td:first-child,th:first-child{{text-align:left}}img{{max-width:100%}}
.wide{{overflow-x:auto}}.wide table{{font-size:0.85em}}</style></head>
<body><h1>jagg report — profile <code>{html.escape(params.profile)}</code></h1>
<p>Baseline GRPO (exact per-step backward) against JAGG and the endpoint-only ablation.</p>{verdict}
<h2>Final evaluation (protocol {params.eval.protocol}; mean ± std over seeds, the mean's 95% intervals over seeds and over prompts)</h2><div class="wide">{_html_table(_final_table(summary, metrics))}</div>{lead}
<h2>Gains over the base model (the mean's 95% intervals over seeds and over prompts)</h2><div class="wide">{_html_table(_gain_rows(summary, metrics))}</div>
{evaluation_html(summary["evaluation"], _html_table)}
{per_seed}
<h2>Paired by seed: differences of final {html.escape(metrics[0])} (95% intervals over seeds and over prompts)</h2><div class="wide">{_html_table(_paired_rows(summary))}</div>
<h2>Learning per second</h2>{per_second}{f'<div class="wide">{_html_table(ps_rows)}</div><p>{html.escape(_per_second_note(summary))}</p>' if ps_rows else ""}
<h2>Speed: every method side by side</h2><p>{html.escape(side_note(summary))}</p>{f'<div class="wide">{_html_table(side_rows)}</div>' if side_rows else ""}
<h2>Speed: each run's own times</h2><div class="wide">{_html_table(_speed_rows(summary))}</div>
<p>Ideal = the cost model's update-stage speedup (forward 1, backward 2) from the counted forwards; ⚑ marks a
measurement beyond it (each run timed itself at its own time: the machine's load, not the method).</p>
<h2>Where an iteration's time goes (seconds, mean per iteration)</h2><div class="wide">{_html_table(breakdown)}</div>
<p>Overhead = fidelity monitor + kl_ref reference + logging + checkpoint + other (neither rollout, reward nor the
update stage). A phase that runs every N iterations (its column says so) counts 0 in the others: the mean is its
share of the run.</p>
{figs}
</body></html>
"""
