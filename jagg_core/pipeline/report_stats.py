"""The report's statistics beyond the seeds: intervals over prompts, learning per second, and the verdict.

- **Over prompts.** A final score is a mean over the test split's prompts, so it carries the sampling error of those
  prompts beside the seeds'. Each is given a percentile bootstrap interval: the prompts of each style resampled with
  replacement (:data:`BOOTSTRAP` times, a fixed seed), the same resample for every run, so a method's mean over
  seeds, a gain over the base model and a paired difference of methods are resampled together, prompt by prompt.
- **Per second.** Training seconds at iteration k are k times a method's seconds per iteration. With the `speed`
  stage's side-by-side measurement (jagg_core/bench/side_by_side.py) those come from one machine state: its rollout
  and the method's update, plus the rest of an iteration (reward, optimizer, logging, monitors: the same work in every
  method), pooled over every run's own timings; without it, each run's own mean iteration. "Seconds to the baseline's
  gain" is when a run's held-out curve (checkpoints, linearly interpolated) first reaches the baseline's mean final
  gain; a run that never does is counted as not reached, not dropped.
- **The verdict.** JAGG against the exact baseline as a non-inferiority statement at a margin fixed before any result
  (:data:`NONINFERIORITY_MARGIN`), the ablation against both by whether the paired interval excludes 0.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import UserError
from ..setup.paths import Layout
from ..setup.storage import read_score_records

__all__ = ["BOOTSTRAP", "NONINFERIORITY_MARGIN", "ReportError", "noninferiority", "prompt_intervals", "read_scores",
           "seconds_per_iteration", "t_interval", "time_to_target", "verdict"]


class ReportError(UserError, ValueError):
    """What the report reads is damaged or missing; the message is one sentence for the user."""


def read_scores(path: Path) -> list[dict[str, Any]] | None:
    """An evaluation step's per-image scores (``eval/<outputs>/<run>/steps/<step>/scores.jsonl``), None where there
    are none; a file that is not a whole scores file (a FIFO, a link to a device, a folder, cut short) is one
    :class:`ReportError` sentence."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    run = path.parents[2].name if len(path.parents) > 2 else "RUN"
    return read_score_records(path, ReportError, fix=f"run `jagg evaluate --run {run}` again to rewrite it")

BOOTSTRAP = 2000
# JAGG is called non-inferior to the exact backward when the lower end of the paired 95% interval of (JAGG − baseline)
# on the primary score lies above −margin. 0.01 is the bar the previous round held it to ("within one seed sd of the
# baseline", sd ≈ 0.01 over seeds), fixed before this round's runs; about a quarter of the baseline's gain.
NONINFERIORITY_MARGIN = 0.01


def t_interval(xs: Sequence[float], confidence: float = 0.95) -> dict[str, float]:
    """Mean with its Student-t interval over ``xs`` (n − 1 degrees of freedom)."""
    n = len(xs)
    mean = statistics.fmean(xs) if n else float("nan")
    if n < 2:
        return {"n": n, "mean": mean, "sd": float("nan"), "lo": float("nan"), "hi": float("nan")}
    from scipy.stats import t as student_t

    sd = statistics.stdev(xs)
    half = float(student_t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half}


def _read_scores(path: Path, metrics: Sequence[str]) -> dict[str, dict[str, np.ndarray]] | None:
    """metric -> style -> per-prompt scores in prompt order, from an evaluation step's ``scores.jsonl``."""
    records = read_scores(path)
    if records is None:
        return None
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for r in records:
        rows.setdefault(r["style"], {})[r["index"]] = r
    out: dict[str, dict[str, np.ndarray]] = {}
    for m in metrics:
        out[m] = {s: np.array([by[i][m] for i in sorted(by)], dtype=np.float64) for s, by in rows.items()
                  if all(m in by[i] for i in by)}
    return out


def _headline(scores: Mapping[str, np.ndarray], idx: Mapping[str, np.ndarray] | None, protocol: str) -> np.ndarray:
    """The protocol's headline under resamples ``idx`` (style -> (B, n) prompt indices): the mean over styles of each
    style's mean (hpdv2-benchmark: the block means of equal blocks average to it), or the plain mean over all prompts
    (hpdv2-test)."""
    if protocol == "hpdv2-test":
        parts = [scores[s][idx[s]] if idx else scores[s][None, :] for s in sorted(scores)]
        return np.concatenate(parts, axis=1).mean(axis=1)
    return np.mean([(scores[s][idx[s]] if idx else scores[s][None, :]).mean(axis=1) for s in sorted(scores)], axis=0)


def _interval(samples: np.ndarray) -> list[float]:
    return [float(np.percentile(samples, 2.5)), float(np.percentile(samples, 97.5))]


def prompt_intervals(lay: Layout, runs: Sequence[Any], metrics: Sequence[str], protocol: str,
                     pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Bootstrap intervals over prompts: per run (its final score and its gain over the base), per method (the mean
    over seeds of both) and per pair of methods (the mean over seeds of the paired difference of final scores).

    ``runs`` are the report's runs (method, seed, eval); a run without per-prompt scores is left out.
    """
    base = _read_scores(lay.eval_dir("base") / "steps" / f"{0:06d}" / "scores.jsonl", metrics)
    finals = {}
    for r in runs:
        if r.eval:
            got = _read_scores(lay.eval_dir(f"{r.method}-s{r.seed}") / "steps" / f"{r.eval['step']:06d}" /
                               "scores.jsonl", metrics)
            if got:
                finals[(r.method, r.seed)] = got
    if not finals:
        return {}
    some = next(iter(finals.values()))[metrics[0]]
    rng = np.random.default_rng(0)
    idx = {s: rng.integers(0, len(v), size=(BOOTSTRAP, len(v))) for s, v in sorted(some.items())}
    out: dict[str, Any] = {"bootstrap": BOOTSTRAP, "prompts": int(sum(len(v) for v in some.values())),
                           "runs": {}, "methods": {}, "pairs": []}
    for m in metrics:
        base_b = _headline(base[m], idx, protocol) if base and base[m].keys() == some.keys() else None
        if base_b is not None:
            out.setdefault("base", {})[m] = _interval(base_b)
        boot = {}
        for key, sc in finals.items():
            if sc[m].keys() != some.keys() or any(len(sc[m][s]) != len(some[s]) for s in some):
                continue  # another test split (an old evaluation): no common resample
            boot[key] = _headline(sc[m], idx, protocol)
            row = out["runs"].setdefault(f"{key[0]}-s{key[1]}", {})
            row[m] = {"final": _interval(boot[key])}
            if base_b is not None:
                row[m]["gain"] = _interval(boot[key] - base_b)
        for method in dict.fromkeys(k[0] for k in boot):
            mean_b = np.mean([b for k, b in boot.items() if k[0] == method], axis=0)
            entry = out["methods"].setdefault(method, {})
            entry[m] = {"final": _interval(mean_b)}
            if base_b is not None:
                entry[m]["gain"] = _interval(mean_b - base_b)
        if m == metrics[0]:
            for a, b in pairs:
                seeds = sorted(s for (meth, s) in boot if meth == a and (b, s) in boot)
                if seeds:
                    diff = np.mean([boot[(a, s)] - boot[(b, s)] for s in seeds], axis=0)
                    out["pairs"].append({"a": a, "b": b, "metric": m, "seeds": seeds, "prompts": _interval(diff)})
    return out


def _finite(x: Any) -> bool:
    """A number that is one: not None (a null of speed.json), NaN or an infinity."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def seconds_per_iteration(runs: Sequence[Any], side_by_side: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per method: seconds per training iteration and where they come from (module docstring)."""
    def own(rows: Sequence[Mapping[str, float]], key: str) -> list[float]:
        return [x[key] for x in rows if key in x]

    by_method: dict[str, list[Mapping[str, float]]] = {}
    for r in runs:
        by_method.setdefault(r.method, []).extend(r.curve[1:] if len(r.curve) > 1 else r.curve)
    rest = [x["time/iteration"] - x.get("time/rollout", 0.0) - x.get("time/update", 0.0)
            for rows in by_method.values() for x in rows if "time/iteration" in x]
    out = {}
    for method, rows in by_method.items():
        measured = side_by_side and method in side_by_side.get("methods", {}) and all(
            _finite(x) for x in (side_by_side["rollout"].get("median"),
                                 side_by_side["methods"][method]["update"].get("median")))
        if measured and rest:
            s = (side_by_side["rollout"]["median"] + side_by_side["methods"][method]["update"]["median"] +
                 statistics.fmean(rest))
            out[method] = {"seconds": s, "source": "side by side"}
        elif own(rows, "time/iteration"):
            out[method] = {"seconds": statistics.fmean(own(rows, "time/iteration")), "source": "the runs' own"}
    return out


def _first_reach(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first iteration at which the piecewise-linear ``curve`` (iteration, gain) reaches ``target``."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if y0 >= target:
            return x0
        if y1 >= target:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return curve[-1][0] if curve and curve[-1][1] >= target else None


def time_to_target(runs: Sequence[Any], metric: str, base: float, spi: Mapping[str, Mapping[str, Any]],
                   images_per_iteration: int, baseline: str = "baseline") -> dict[str, Any]:
    """Seconds (and images) each run takes to first reach the baseline's mean final gain on the held-out ``metric``;
    per method the count reached, the median and mean over those, and the paired difference with the baseline."""
    key = f"eval/{metric}"
    curves: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in runs:
        if r.eval:
            pts = sorted((float(p["step"]), p[key] - base) for p in r.eval["curve"] if key in p and p["step"] > 0)
            curves[(r.method, r.seed)] = [(0.0, 0.0)] + pts
    finals = [c[-1][1] for (m, _), c in curves.items() if m == baseline]
    if not finals:
        return {}
    target = statistics.fmean(finals)
    out: dict[str, Any] = {"metric": metric, "target_gain": target, "baseline": baseline, "methods": {}}
    if not target > 0:  # the baseline learned nothing on average: no time to reach it that means anything
        return out
    seconds: dict[tuple[str, int], float | None] = {}
    rate: dict[tuple[str, int], float] = {}  # final gain per 1000 training seconds
    for (method, seed), c in curves.items():
        it = _first_reach(c, target)
        s = spi.get(method, {}).get("seconds")
        seconds[(method, seed)] = it * s if it is not None and s else None
        if s and c[-1][0]:
            rate[(method, seed)] = 1000 * c[-1][1] / (c[-1][0] * s)
        row = out["methods"].setdefault(method, {"seeds": 0, "reached": 0, "iterations": [], "seconds": [],
                                                 "images": [], "seconds_per_iteration": s})
        row["seeds"] += 1
        if it is not None:
            row["reached"] += 1
            row["iterations"].append(it)
            row["seconds"].append(seconds[(method, seed)])
            row["images"].append(it * images_per_iteration)

    def paired(values: Mapping[tuple[str, int], float | None], method: str) -> dict[str, Any]:
        both = sorted(sd for (m, sd), v in values.items() if m == method and v is not None
                      and values.get((baseline, sd)) is not None)
        return {**t_interval([values[(method, sd)] - values[(baseline, sd)] for sd in both]), "seeds": both}

    for method, row in out["methods"].items():
        row["median_seconds"] = statistics.median(row["seconds"]) if row["seconds"] else None
        row["gain_per_1000s"] = t_interval([v for (m, _), v in rate.items() if m == method])
        row["paired_seconds_vs_baseline"] = paired(seconds, method)
        row["paired_gain_per_1000s_vs_baseline"] = paired(rate, method)
    return out


def _fmt_interval(p: Mapping[str, float]) -> str:
    return f"{p['mean']:+.4f} [{p['lo']:+.4f}, {p['hi']:+.4f}]"


def noninferiority(p: Mapping[str, Any], margin: float = NONINFERIORITY_MARGIN) -> dict[str, Any]:
    """One method against the exact baseline at ``margin``, from the paired 95% interval of (method − baseline):
    ``non-inferior`` (the whole interval above −margin), ``inferior`` (the whole interval below −margin), or
    ``not shown`` (the interval reaches across −margin, or fewer than 2 seeds)."""
    lo, hi, n = p.get("lo", float("nan")), p.get("hi", float("nan")), p.get("n", 0)
    word = ("non-inferior" if n > 1 and lo > -margin else "inferior" if n > 1 and hi < -margin else "not shown")
    return {"a": p["a"], "b": p["b"], "margin": margin, "n": n, "lo": lo, "hi": hi, "verdict": word}


def verdict(paired: Sequence[Mapping[str, Any]], metric: str, margin: float = NONINFERIORITY_MARGIN) -> str:
    """One sentence that says what the paired 95% intervals say (and nothing they do not)."""
    by = {(p["a"], p["b"]): p for p in paired if p.get("n", 0) > 1}
    parts = []
    jb = by.get(("jagg", "baseline"))
    if jb:
        n = jb["n"]
        if jb["lo"] > -margin:
            parts.append(f"JAGG is non-inferior to the exact baseline at a margin of {margin:g} {metric} "
                         f"(JAGG − baseline {_fmt_interval(jb)} over {n} seeds: the whole interval lies above "
                         f"−{margin:g})")
        else:
            parts.append(f"JAGG is not shown non-inferior to the exact baseline at a margin of {margin:g} {metric} "
                         f"(JAGG − baseline {_fmt_interval(jb)} over {n} seeds reaches below −{margin:g})")
    for a, b, name in (("ablate", "jagg", "JAGG"), ("ablate", "baseline", "the baseline")):
        p = by.get((a, b))
        if not p:
            continue
        if p["hi"] < 0:
            parts.append(f"the endpoint-only ablation learns less than {name} ({a} − {b} {_fmt_interval(p)})")
        elif p["lo"] > 0:
            parts.append(f"the endpoint-only ablation learns more than {name} ({a} − {b} {_fmt_interval(p)})")
        else:
            parts.append(f"no difference between the endpoint-only ablation and {name} is shown ({a} − {b} "
                         f"{_fmt_interval(p)} includes 0)")
    if not parts:
        return ""
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + " (paired by seed, Student-t 95% intervals)."
