"""The comparison report: the speed table, the iteration breakdown, paired differences and summary.json; the pages
(README.md, index.html) are written by :mod:`jagg_core.pipeline.report_pages`, its figures and image grids drawn by
:mod:`jagg_core.pipeline.report_figures`.

Reads what the stages wrote — ``eval/<profile>/<run>/metrics.json`` and images, ``runs/<profile>/<run>/curve.tsv`` —
and writes ``reports/<profile>/{index.html, README.md, *.png, summary.json}``. Nothing here trains or samples.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..setup.config import Params, TrainConfig
from ..cost import ideal_speedup
from ..modes import EXACT_MODES
from ..setup.paths import Layout, run_name
from .report_diagnostics import diagnostic_figures
from .report_figures import (comparison_grid, mean_std, plot_curves, plot_fidelity, plot_learning, plot_per_second,
                             plot_stacked_bars)
from .report_pages import fmt, page_html, page_markdown
from .report_protocols import evaluation_section
from .report_stats import (ReportError, noninferiority, prompt_intervals, seconds_per_iteration, t_interval,
                           time_to_target, verdict)
from ..setup.provenance import fingerprint, speed_made_from
from ..setup.redact import flatten
from ..setup.storage import atomic_write_text, finite_json
from jagg_core.setup.storage import read_regular

__all__ = ["ReportError", "build_report", "read_eval", "breakdown_rows", "cost_model_speedup", "fidelity_by_position",
           "iteration_breakdown", "kl_ref_phase", "read_curve", "read_side_by_side", "report_pairs", "speed_table", "BASELINE",
           "PHASES"]

# What a null of summary.json stands for (JSON has no NaN; the pages say "–" or "not measured").
NULL_NOTE = ("null: not a number (NaN): an interval or a spread over one seed, a ratio with nothing to divide by, a "
             "time that was not measured")




def read_curve(path: Path) -> list[dict[str, float]]:
    """A run's ``curve.tsv``; a damaged one (not UTF-8, a row that is not numbers) is one :class:`ReportError`."""
    if not path.exists() and not path.is_symlink():
        return []
    data = read_regular(path, ReportError, fix="train the run again (or put the file back) before the report")
    try:
        rows = csv.DictReader(io.StringIO(data.decode("utf-8")), delimiter="\t")
        out = []
        for line, r in enumerate(rows, start=2):
            try:
                # a value that is not finite (a skipped update's NaN reward, a damaged inf) was not measured: the
                # statistics see it as missing, as a phase that did not run
                out.append({str(k): x for k, v in r.items() if v not in ("", None)
                            for x in (float(v),) if math.isfinite(x)})
            except (TypeError, ValueError):
                raise ReportError(f"{path} line {line} is not a row of numbers; the curve is damaged: train the run "
                                  f"again (or fix that line) before the report.") from None
        return out
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ReportError(f"{path} cannot be read as a curve ({type(e).__name__}); train the run again (or put the "
                          f"file back) before the report.") from None


def read_eval(path: Path) -> dict[str, Any] | None:
    """An evaluation's ``metrics.json`` (None where there is none); a damaged one is one :class:`ReportError`."""
    if not path.exists() and not path.is_symlink():
        return None
    again = f"run `jagg evaluate --run {path.parent.name}` again to rewrite it"
    data = read_regular(path, ReportError, fix=again)
    try:
        card = json.loads(data.decode("utf-8"))
    except (OSError, ValueError) as e:
        raise ReportError(f"{path} cannot be read as JSON ({type(e).__name__}); {again}.") from None
    metrics = card.get("metrics") if isinstance(card, dict) else None
    good = isinstance(metrics, dict) and all(
        isinstance(v, dict) and isinstance(v.get("benchmark"), (int, float)) and not isinstance(v["benchmark"], bool)
        and math.isfinite(v["benchmark"]) for v in metrics.values())
    if not good:
        raise ReportError(f"{path} does not hold an evaluation's metrics (a mapping of metric -> its finite "
                          f"benchmark score); {again}.")
    curve = card.setdefault("curve", [])  # an evaluation of one checkpoint has no curve over steps
    if not isinstance(curve, list) or not all(isinstance(p, dict) and isinstance(p.get("step"), (int, float))
                                              for p in curve):
        raise ReportError(f"{path} holds a curve that is not a list of steps' scores; {again}.")
    return card


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
            runs.append(_Run(method, seed, read_curve(lay.curve(name)), read_eval(mf)))
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
KL_REF_PHASE = "kl_ref reference"


def kl_ref_phase(train: TrainConfig | None) -> str:
    """The label of train/kl_ref's phase, with the cadence its reference forwards ran at: ``train.kl_ref_every`` at
    β = 0 (the mean counts the other iterations as 0); at β > 0 they are the loss's, inside the update: it is 0."""
    if train is None:
        return KL_REF_PHASE
    if not train.kl_ref:
        return f"{KL_REF_PHASE} (off)"
    if train.beta > 0:
        return f"{KL_REF_PHASE} (β > 0: in the update)"
    return f"{KL_REF_PHASE} (every {train.kl_ref_every} it.)" if train.kl_ref_every > 1 else (
        f"{KL_REF_PHASE} (every it.)")


def iteration_breakdown(runs: Sequence[_Run], train: TrainConfig | None = None) -> list[dict[str, Any]]:
    """Per method: the mean seconds of each phase of an iteration (warm-up iteration excluded; a phase that did not
    run in an iteration counts 0 there), "other" for the rest, and the overhead share of the iteration. With the
    run's ``train`` section the kl_ref phase is labelled with its cadence (:func:`kl_ref_phase`)."""
    label = kl_ref_phase(train)
    rename = {KL_REF_PHASE: label}
    by_method: dict[str, list[dict[str, float]]] = {}
    for r in runs:
        rows = [x for x in (r.curve[1:] if len(r.curve) > 1 else r.curve) if "time/iteration" in x]
        by_method.setdefault(r.method, []).extend(rows)
    out = []
    for method, rows in by_method.items():
        if not rows:
            continue
        phases = {rename.get(name, name): statistics.fmean(get(x) for x in rows) for name, get in PHASES}
        total = statistics.fmean(x["time/iteration"] for x in rows)
        phases["other"] = max(0.0, total - sum(phases.values()))
        overhead = sum(phases[rename.get(k, k)] for k in OVERHEAD_PHASES)
        out.append({"method": method, "iterations": len(rows), "iteration_s": total, "phases": phases,
                    "overhead_s": overhead, "overhead_share": overhead / total if total else float("nan")})
    return out


def _phase_names(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The breakdown's phase labels, in order (the kl_ref phase's as :func:`iteration_breakdown` labelled it)."""
    return list(rows[0]["phases"]) if rows else [name for name, _ in PHASES] + ["other"]


def _plot_breakdown(rows: Sequence[dict[str, Any]], path: Path, title: str) -> bool:
    """One horizontal stacked bar per method: its iteration split into phases (seconds)."""
    return plot_stacked_bars([f"{r['method']}\n{r['overhead_share']:.1%} overhead" for r in rows],
                             [r["phases"] for r in rows], _phase_names(rows), path,
                             title=title, xlabel="seconds per iteration (mean)")


def breakdown_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The breakdown as a table: seconds per phase, the iteration, and the overhead share."""
    names = _phase_names(rows)
    table = [["method"] + names + ["iteration s", "overhead"]]
    for r in rows:
        table.append([r["method"]] + [fmt(r["phases"][n], 3) for n in names] +
                     [fmt(r["iteration_s"], 3), f"{r['overhead_share']:.1%}"])
    return table


def fidelity_by_position(runs: Sequence[_Run], params: Params | None = None
                         ) -> dict[str, dict[int, tuple[float, float, int]]]:
    """Mean ± std of cos(JAGG, exact) and cos(ablate, exact) per group position over every logged measurement.

    Each run's monitor measures its own method's groups (window, anchors); with ``params``, only the runs whose
    method has the jagg section's window and anchors are pooled, so one position means one estimator (toy-w's W = 4
    and K-anchor methods are not mixed into its W = 8 curve)."""
    out: dict[str, dict[int, list[float]]] = {"jagg": {}, "ablate": {}}
    if params is not None:
        same = {m for m in {r.method for r in runs} if m in params.methods and
                (params.method(m).window, params.method(m).anchors) == (params.jagg.window, params.jagg.anchors)}
        runs = [r for r in runs if r.method in same]
    for r in runs:
        for row in r.curve:
            for key, v in row.items():
                for kind in ("jagg", "ablate"):
                    prefix = f"jagg/cos_{kind}/g"
                    if key.startswith(prefix) and v == v:
                        out[kind].setdefault(int(key[len(prefix):]), []).append(v)
    return {k: {g: (*mean_std(vs), len(vs)) for g, vs in sorted(d.items())} for k, d in out.items()}


def _final_rows(methods: Sequence[str], runs: Sequence[Any], metrics: Sequence[str]) -> list[dict[str, Any]]:
    """Final evaluation per method: mean ± std over seeds of each metric's benchmark score, and the seed count."""
    final = []
    for method in methods:
        row = {"method": method}
        for m in metrics:
            vals = [r.eval["metrics"][m]["benchmark"] for r in runs if r.method == method and r.eval]
            row[m] = mean_std(vals)
            row["seeds"] = len(vals)
        final.append(row)
    return final


def _write_summary(summary: dict[str, Any], path: Path) -> None:
    """``summary.json`` as strict JSON (no bare NaN): a null, and beside it in words what a null stands for."""
    written, nulls = finite_json(json.loads(json.dumps(summary, default=str)))
    if nulls:
        written["null"] = NULL_NOTE
    atomic_write_text(path, json.dumps(written, indent=2, allow_nan=False) + "\n")


def build_report(params: Params, lay: Layout) -> dict[str, Any]:
    """Write the report of ``params.profile``; returns its summary (also ``summary.json``)."""
    out = lay.report_dir
    runs = _load_runs(params, lay)
    base_mf = lay.eval_dir("base") / "metrics.json"
    base = read_eval(base_mf)
    truth_mf = lay.eval_dir("ground-truth") / "metrics.json"  # the toy's ceiling (evaluate_ground_truth)
    truth = read_eval(truth_mf)
    if base is None and not any(r.eval for r in runs):  # an empty report, exit 0, would look like a result
        raise ReportError(f"nothing to report: no evaluation under {base_mf.parent.parent} (neither the base model "
                          f"nor a run of run.methods); run `jagg evaluate` first.")
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused report leaves no empty folder behind
    metrics = list(params.eval.metrics)

    final = _final_rows(params.run.methods, runs, metrics)
    speed = speed_table(params, runs)
    breakdown = iteration_breakdown(runs, params.train)

    figures = {}
    # First: what GRPO learned on held-out prompts (the primary metric) and, beside it, the other scores
    base_scores = {m: base["metrics"][m]["benchmark"] for m in metrics if m in base["metrics"]} if base else None
    # The curves' iteration 0 is the base model's curve point: with eval.curve_subset, its subset's score
    curve_base = {m: base["curve"][0].get(f"eval/{m}", base_scores[m]) for m in base_scores} if (
        base_scores and base.get("curve")) else base_scores
    subset = _curve_prompts_per_style(runs, base)
    if plot_learning(runs, metrics, curve_base, out / "learning.png", trained=list(params.reward.weights),
                     subset=subset):
        figures["test split by iteration"] = "learning.png"
    # Beside it, the same curves against images seen and training seconds (one machine state: the `speed` stage)
    side, side_note = read_side_by_side(params, lay)
    spi = seconds_per_iteration(runs, side)
    images = params.sample.group_size * params.sample.prompts_per_iteration
    if plot_per_second(runs, metrics[0], curve_base, spi, images, out / "per_second.png", subset=subset):
        figures["test split by images seen and training seconds"] = "per_second.png"
    if _plot_breakdown(breakdown, out / "iteration.png", "where an iteration's time goes"):
        figures["iteration breakdown"] = "iteration.png"
    if plot_curves(runs, "reward/mean", "training reward (rollouts, 4-iteration mean; ± sd over seeds)",
                    out / "reward.png", smooth=4):
        figures["reward"] = "reward.png"
    for m in metrics:  # each metric that is also a training reward, on the rollouts of the training prompts
        if plot_curves(runs, f"reward/{m}/mean", f"training prompts: {m} of the rollouts (4-iteration mean)",
                        out / f"train-{m}.png", smooth=4):
            figures[f"train/{m}"] = f"train-{m}.png"
    fid = fidelity_by_position(runs, params)
    if plot_fidelity(fid, params.jagg.auto_threshold, out / "fidelity.png"):
        figures["fidelity"] = "fidelity.png"
    figures.update(diagnostic_figures(params, runs, out))  # train/kl_ref, per-reward group_std and zero_std_frac
    grid_columns = comparison_grid(params, lay, runs, out / "grid.png")
    if grid_columns:
        figures["grid"] = "grid.png"

    per_run = _per_run(runs, metrics)
    pairs = report_pairs(params)
    paired = paired_differences(per_run, metrics[0], pairs)
    prompts = prompt_intervals(lay, runs, metrics, params.eval.protocol, pairs)
    _attach_intervals(final, paired, per_run, prompts, base_scores)
    ttt = time_to_target(runs, metrics[0], curve_base[metrics[0]], spi, images) if (
        curve_base and metrics[0] in curve_base) else {}
    summary = {"profile": params.profile, "primary": metrics[0], "runs": per_run,
               "paired": paired, "verdict": verdict(paired, metrics[0]), "prompt_intervals": prompts,
               "noninferiority": [noninferiority(p) for p in paired if p["b"] == BASELINE],
               "seconds_per_iteration": spi, "time_to_target": ttt, "curve_prompts_per_style": subset,
               "side_by_side": _without_samples(side), "side_by_side_note": side_note,
               "final": final, "speed": speed, "iteration_breakdown": breakdown, "figures": figures,
               "fidelity": {k: {str(g): v for g, v in d.items()} for k, d in fid.items()},
               "base": {m: base["metrics"][m]["benchmark"] for m in metrics} if base else None,
               "ground_truth": {m: truth["metrics"][m]["benchmark"] for m in metrics if m in truth["metrics"]}
               if truth else None,
               "grid_columns": grid_columns, "evaluation": evaluation_section(params, runs, base)}
    _write_summary(summary, out / "summary.json")
    breakdown = breakdown_rows(summary.get("iteration_breakdown", []))
    atomic_write_text(out / "README.md", page_markdown(params, summary, breakdown))
    atomic_write_text(out / "index.html", page_html(params, summary, breakdown))
    return summary


def _curve_prompts_per_style(runs: Sequence[_Run], base: dict[str, Any] | None) -> int | None:
    """The prompts per style the evaluations' curves are on (``eval.curve_subset``; None: the whole split). Curves
    on different subsets cannot share a figure: one sentence."""
    found = {ev.get("curve_prompts_per_style") for ev in [base, *(r.eval for r in runs)] if ev}
    if len(found) > 1:
        raise ReportError(f"the evaluations' curves are on different test subsets ({sorted(found, key=str)} prompts "
                          f"per style); evaluate every run again with the same eval.curve_subset.")
    return next(iter(found), None)


def read_side_by_side(params: Params, lay: Layout) -> tuple[dict[str, Any] | None, str | None]:
    """The `speed` stage's measurement (``runs/<outputs>/speed.json``) if it timed every method of ``params`` at
    these params' settings, and otherwise why not, in words (None: there is none). A measurement carries the
    fingerprint of what it timed (:func:`jagg_core.setup.provenance.speed_made_from`): one at another window,
    batch, model or device (`jagg speed --set jagg.window=2`), or one from before fingerprints, is not shown beside
    these runs, whatever ``resources.speed_rounds`` says."""
    if not lay.speed.exists() and not lay.speed.is_symlink():
        return None, None
    again = "run `jagg speed` again to rewrite it"
    data = read_regular(lay.speed, ReportError, limit=64 << 20, fix=again)  # a FIFO there: one sentence, no hang
    try:
        side = json.loads(data.decode("utf-8"))
    except ValueError as e:
        raise ReportError(f"{lay.speed} cannot be read as JSON ({type(e).__name__}); run `jagg speed` again to "
                          f"rewrite it.") from None
    if not isinstance(side, dict) or not isinstance(side.get("methods"), dict) or not isinstance(side.get("table"),
                                                                                                   list):
        raise ReportError(f"{lay.speed} is not a side-by-side measurement; run `jagg speed` again to rewrite it.")
    shown = lay.speed.relative_to(lay.root) if lay.speed.is_relative_to(lay.root) else lay.speed
    missing = [m for m in params.run.methods if m not in side["methods"]]
    if missing:  # measured for other methods: the runs' own times only
        return None, f"{shown} did not time {', '.join(missing)}; run `jagg speed` to time every method side by side"
    mine = speed_made_from(params, params.run.methods)
    made = side.get("made_from")
    if not isinstance(made, dict) or side.get("fingerprint") != fingerprint(made):
        return None, (f"{shown} does not say what it timed (written before measurements carried their settings, or "
                      f"edited); run `jagg speed` again")
    made = {**made, "methods": {m: d for m, d in (made.get("methods") or {}).items() if m in params.run.methods}}
    if made != mine:
        ours, theirs = flatten(mine), flatten(made)
        diff = [f"{k} {theirs.get(k, '–')} (these runs: {ours.get(k, '–')})" for k in sorted(set(ours) | set(theirs))
                if ours.get(k) != theirs.get(k)]
        return None, (f"{shown} was measured at other settings ({'; '.join(diff[:3])}"
                      f"{f'; {len(diff) - 3} more' if len(diff) > 3 else ''}); run `jagg speed` again")
    if side.get("trusted") is False:  # the figures are not shown: the table says why (side_by_side.py)
        return None, f"{shown} cannot be trusted: {side.get('untrusted') or 'its rounds spread too much'}"
    return side, None


def _without_samples(side: dict[str, Any] | None) -> dict[str, Any] | None:
    """The side-by-side measurement for summary.json; its per-round samples stay in speed.json."""
    if not side:
        return None
    methods = {m: {**d, "update": {k: v for k, v in d["update"].items() if k != "samples"}}
               for m, d in side["methods"].items()}
    rollout = {k: v for k, v in side["rollout"].items() if k != "samples"}
    return {**side, "methods": methods, "rollout": rollout}


def _attach_intervals(final: list[dict[str, Any]], paired: list[dict[str, Any]], per_run: list[dict[str, Any]],
                      prompts: dict[str, Any], base: dict[str, float] | None) -> None:
    """Each final score's intervals: over seeds (Student-t, of the mean) and over prompts (bootstrap), for the score
    and for its gain over the base model; each paired difference's interval over prompts beside its seeds' one."""
    for row in final:
        for m in [k for k in row if k not in ("method", "seeds")]:
            vals = [r["final"][m] for r in per_run if r["method"] == row["method"] and m in r["final"]]
            got = prompts.get("methods", {}).get(row["method"], {}).get(m, {})
            row.setdefault("intervals", {})[m] = {
                "seeds": t_interval(vals), "prompts": got.get("final"),
                "gain_seeds": t_interval([v - base[m] for v in vals]) if base and m in base else None,
                "gain_prompts": got.get("gain")}
    by_pair = {(p["a"], p["b"]): p["prompts"] for p in prompts.get("pairs", [])}
    for p in paired:
        p["prompts_interval"] = by_pair.get((p["a"], p["b"]))
    for r in per_run:
        r["prompt_intervals"] = prompts.get("runs", {}).get(f"{r['method']}-s{r['seed']}")


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
    return t_interval(diffs, confidence)


# The comparisons the paper makes, each paired by seed: (method, against).
PAIRS = (("jagg", "baseline"), ("ablate", "jagg"), ("ablate-matched", "jagg"), ("jagg-reuse", "jagg"),
         ("ablate", "baseline"), ("ablate-matched", "baseline"))


# The exact baseline every other method is paired with (time_to_target's target is its gain too).
BASELINE = "baseline"


def report_pairs(params: Params) -> tuple[tuple[str, str], ...]:
    """The paper's :data:`PAIRS`, then every other method of ``run.methods`` that is not an exact backward against
    :data:`BASELINE` (a study's own methods, e.g. toy-w's W and K variants, each get their paired interval)."""
    extra = tuple((m, BASELINE) for m in params.run.methods if m != BASELINE and (m, BASELINE) not in PAIRS
                  and BASELINE in params.run.methods and params.methods[m].mode not in EXACT_MODES)
    return PAIRS + extra


def paired_differences(per_run: Sequence[dict[str, Any]], metric: str,
                       pairs: Sequence[tuple[str, str]] = PAIRS) -> list[dict[str, Any]]:
    """``metric(a) − metric(b)`` per seed for each pair of ``pairs`` that both ran, with a 95% t-interval."""
    final = {(r["method"], r["seed"]): r["final"].get(metric) for r in per_run}
    out = []
    for a, b in pairs:
        seeds = sorted(s for (m, s) in final if m == a and (b, s) in final)
        if seeds:
            diffs = [final[(a, s)] - final[(b, s)] for s in seeds]
            out.append({"a": a, "b": b, "metric": metric, "seeds": seeds, "diffs": diffs, **paired_interval(diffs)})
    return out
