"""Write docs/frontier.md from toy-w's report: where JAGG stops holding as W grows, one point per method.

    python scripts/frontier_page.py --summary docs/frontier/summary.json \
        --cosines docs/frontier/fidelity/methods.json --pilot docs/frontier/pilot.md \
        --wall "2 h 14 min" --cpu "257 min" --date 2026-12-05 --commit c05cf14 \
        --screen docs/frontier/screen/methods.json --alignment docs/frontier/screen/alignment.json \
        --speed docs/frontier/screen/speed.json --extra-summary docs/frontier/unbiased/summary.json \
        --extra-how "with `jagg run … --set 'run.methods=[baseline, jagg-u]'` on …" --out docs/frontier.md

The screen, the alignment and the speed of every screened variant are the unbiased JAGG's section (issue 60); a
confirmation run's summary adds its methods to the table and the figure, each paired with its own run's baseline.

The summary is toy-w's report (``jagg report --profile toy-w --copy-to docs/frontier``): each method's test gain with
its intervals over seeds and over prompts, its paired difference with the exact baseline, its verdict at the
non-inferiority margin and the `speed` stage's side-by-side update times. The cosines are
``scripts/jagg_fidelity_study.py --methods all``'s (cos of each method's whole update gradient with the exact one, on
the same checkpoints and rollouts). The pilot is the hand-written section on how the recipe was chosen. Every figure
the page quotes is read from those files, so the page cannot disagree with them; bad input is one sentence and a
non-zero exit, and nothing is written unless everything could be (the figure and the page are replaced atomically).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jagg_core.errors import UserError  # noqa: E402
from tasks.common import cli  # noqa: E402  (the command line's rules: one sentence, exit 1, no traceback)

FIGURE = "frontier/frontier.png"  # relative to the page's folder
REPORT = "`jagg report --profile toy-w --copy-to docs/frontier`"


class PageError(UserError, ValueError):
    """Bad input: one sentence."""


def _iv(lo: float, hi: float, d: int = 4) -> str:
    if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float))) or math.isnan(lo) or math.isnan(hi):
        return "–"
    return f"[{lo:+.{d}f}, {hi:+.{d}f}]"


def _f(x: Any) -> float:
    """A number of the summary: its null (what summary.json writes for NaN) as NaN."""
    return float("nan") if x is None else float(x)


def _nums(d: dict[str, Any] | None) -> dict[str, Any] | None:
    """An interval's mapping with its nulls as NaN (mean, lo, hi, sd)."""
    return None if d is None else {k: (_f(v) if k in ("mean", "lo", "hi", "sd") else v) for k, v in d.items()}


def _read_json(path: Path, what: str, fix: str) -> dict[str, Any]:
    """A JSON file read bounded (a regular file, whole), or one sentence."""
    from jagg_core.setup.storage import read_regular

    raw = read_regular(path, PageError, fix=fix)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise PageError(f"{path} is not whole JSON ({type(e).__name__}; cut short?); {fix}.") from None
    if not isinstance(data, dict):
        raise PageError(f"{path} is not {what}; {fix}.")
    return data


def rows_of(s: dict[str, Any], cos: dict[str, Any] | None, screen: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per method of the summary: its settings, speedups, gain, paired difference, verdict and cosine (from
    ``cos``, else from the screen's expected one-draw cosine)."""
    fix = f"write it with {REPORT}"
    if s.get("profile") != "toy-w":
        raise PageError(f"the summary is the report of profile {str(s.get('profile'))[:40]!r}; this page describes toy-w's "
                        f"study ({fix}).")
    try:
        prim = s["primary"]
        final = {r["method"]: r for r in s["final"]}
        speed = {r["method"]: r for r in s["speed"]}
        paired = {(p["a"], p["b"]): p for p in s["paired"]}
        verdicts = {v["a"]: v for v in s.get("noninferiority", [])}
    except (KeyError, TypeError):
        raise PageError(f"the summary lacks the report's final scores, speed rows or paired differences; {fix}.") \
            from None
    if "baseline" not in final:
        raise PageError(f"the summary has no exact baseline (methods: {', '.join(final)}); the frontier is drawn "
                        f"against it.")
    per_ks = per_kilosecond(s)
    side = s.get("side_by_side") or {}
    side_rows = {r["method"]: r for r in side.get("table", [])}
    side_methods = side.get("methods", {})
    cos_methods = {**(screen or {}).get("methods", {}), **(cos or {}).get("methods", {})}
    out = []
    for m, f in final.items():
        try:
            gain = _nums(f["intervals"][prim]["gain_seeds"])
            gain_prompts = [_f(x) for x in (f["intervals"][prim].get("gain_prompts") or [None, None])]
        except (KeyError, TypeError):
            raise PageError(f"the summary's final row of {m} has no gain interval of {prim}; {fix}.") from None
        checks = {k: _nums(v.get("gain_seeds")) for k, v in f["intervals"].items()
                  if k != prim and isinstance(v, dict) and isinstance(v.get("gain_seeds"), dict)}
        sp = speed.get(m, {})
        sr = side_rows.get(m)
        row = {"method": m, "mode": sp.get("mode", "?"), "window": sp.get("window"), "anchors": sp.get("anchors"),
               "random_anchor": (s.get("side_by_side") or {}).get("made_from", {}).get("methods", {}).get(m, {})
               .get("random_anchor"),
               "reuse": bool(side_methods.get(m, {}).get("reuse", False)), "seeds": f.get("seeds", 0),
               "gain": gain, "gain_prompts": gain_prompts, "checks": checks}
        if sr:
            row.update(ideal=_f(sr.get("ideal")), measured=_f(sr.get("speedup")), speed_source="side by side")
        else:
            row.update(ideal=_f(sp.get("ideal_update_speedup")), measured=_f(sp.get("update_speedup")),
                       speed_source="the runs' own")
        p = _nums(paired.get((m, "baseline")))
        if p is not None:
            p["prompts_interval"] = [_f(x) for x in (p.get("prompts_interval") or [None, None])]
        row["paired"] = p
        row.update(per_ks.get(m, {}))
        row["verdict"] = "– (the baseline)" if m == "baseline" else (verdicts.get(m, {}).get("verdict") or "–")
        if m == "baseline" or row["mode"] == "exact":
            row["cos"] = "1 (the exact gradient, by construction)"
        elif m in cos_methods:
            c = _nums(cos_methods[m]["cos"])
            hi = min(c["hi"], 1.0) if not math.isnan(c["hi"]) else c["hi"]  # a cosine is at most 1
            row["cos"] = f"{c['mean']:.3f} {_iv(c['lo'], hi, 3).replace('+', '')} ({cos_methods[m]['units']} rollouts)"
            row["cos_mean"] = c["mean"]
            expected = _nums(cos_methods[m].get("cos_mean"))
            if expected is not None and abs(expected["mean"] - c["mean"]) > 1e-6:  # a random draw: not its mean's
                row["stochastic"] = True
                row["cos"] += f"; one draw's, its mean's {expected['mean']:.3f}"
        else:
            row["cos"] = "not measured"
        out.append(row)
    return out


def _t_interval(xs: list[float]) -> dict[str, float]:
    """Mean and Student-t 95% interval of independent values (NaN bounds for fewer than two)."""
    from scipy import stats

    n = len(xs)
    mean = sum(xs) / n if n else float("nan")
    if n < 2:
        return {"mean": mean, "lo": float("nan"), "hi": float("nan"), "n": n}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    h = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "lo": mean - h, "hi": mean + h, "n": n}


def per_kilosecond(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each method's test gain per 1000 s of whole training iterations, per seed, and its paired difference with the
    baseline's (the same seed): gain_s / (iterations × seconds per iteration) × 1000. The seconds per iteration are
    the report's ``seconds_per_iteration`` (the side-by-side stage's rollout + update + the runs' other phases: one
    machine state for every method), so the pairing is over the seeds' gains, the clock being common."""
    prim, base = s.get("primary"), (s.get("base") or {}).get(s.get("primary"))
    spi = {m: _f(v.get("seconds")) for m, v in (s.get("seconds_per_iteration") or {}).items()}
    if base is None or not spi:
        return {}
    rates: dict[str, dict[int, float]] = {}
    for r in s.get("runs", []):
        try:
            sec = spi[r["method"]] * r["step"]
            rates.setdefault(r["method"], {})[int(r["seed"])] = 1000 * (r["final"][prim] - base) / sec
        except (KeyError, TypeError, ZeroDivisionError):
            continue
    out = {}
    b = rates.get("baseline", {})
    for m, by_seed in rates.items():
        seeds = sorted(set(by_seed) & set(b))
        out[m] = {"per_ks": _t_interval(list(by_seed.values())), "seconds_per_iteration": spi[m],
                  "per_ks_paired": None if m == "baseline" else _t_interval([by_seed[k] - b[k] for k in seeds])}
    return out


def merge_confirmation(rows: list[dict[str, Any]], s: dict[str, Any], extra: dict[str, Any],
                       extra_rows: list[dict[str, Any]]) -> str:
    """Add the confirmation run's methods (its baseline aside) to the study's rows, each paired with the baseline of
    its own run (the same seeds), and say how that baseline compares with the study's, seed by seed."""
    prim = s["primary"]
    seen = {r["method"] for r in rows}
    for r in extra_rows:
        if r["method"] != "baseline" and r["method"] not in seen:
            rows.append({**r, "confirmation": True})
    finals = {}
    for summary in (s, extra):
        finals[id(summary)] = {int(r["seed"]): r["final"][prim] for r in summary.get("runs", [])
                               if r.get("method") == "baseline"}
    a, b = finals[id(s)], finals[id(extra)]
    common = sorted(set(a) & set(b))
    if not common:
        return "The confirmation run's baseline shares no seed with the study's."
    d = max(abs(a[k] - b[k]) for k in common)
    same = ("the same scores to the last bit" if d == 0 else
            f"its scores within {d:.4f} of the study's, seed by seed (another machine's float rounding carried through "
            f"the iterations: the base model's own score differs by "
            f"{abs(_f((s.get('base') or {}).get(prim)) - _f((extra.get('base') or {}).get(prim))):.0e})")
    return (f"The confirmation run retrained the exact baseline on seeds {common[0]}–{common[-1]} beside its methods: "
            f"{same}, so each new row is paired with the baseline of its own run, and a comparison with the study's "
            f"rows takes each against its own run's baseline.")


SCREEN_ORDER = ("baseline", "jagg", "jagg-k3", "jagg-k4", "k3at", "jagg-u", "jagg-ui", "jagg-uia", "jagg-uh")


def _screen_rank(m: str) -> tuple[int, str]:
    return next((i for i, p in enumerate(SCREEN_ORDER) if m == p or (p == "k3at" and m.startswith(p))),
                len(SCREEN_ORDER)), m


def screen_table(screen: dict[str, Any], rows: list[dict[str, Any]], speed_table: list[dict] | None = None) -> str:
    """The screen: every variant's expected one-draw cosine and relative MSE against the exact gradient, its bias
    (‖E g − g‖/‖g‖) and cos(E g, g), with the ideal and measured update speedups: the side-by-side ``speed_table``'s
    (one `jagg speed` over every variant) where given, else a run's."""
    speed = {r["method"]: {"ideal": _f(r.get("ideal")), "measured": _f(r.get("speedup"))} for r in speed_table or []} \
        or {r["method"]: r for r in rows}
    head = ("| variant | one draw: cos(g, exact) | one draw: ‖g − exact‖²/‖exact‖² | bias ‖E g − exact‖/‖exact‖ | "
            "cos(E g, exact) | ideal speedup | measured speedup |\n|---|---|---|---|---|---|---|")
    out = [head]
    for m, v in sorted(screen.get("methods", {}).items(), key=lambda kv: _screen_rank(kv[0])):
        if "mse" not in v:
            continue
        ci = lambda d, k=3: f"{_f(d['mean']):.{k}f} [{_f(d['lo']):.{k}f}, {_f(d['hi']):.{k}f}]"  # noqa: E731
        sp = speed.get(m)
        ideal, measured = (f"{sp['ideal']:.2f}×", f"{sp['measured']:.2f}×") if sp else ("–", "–")
        out.append(f"| {m} | {ci(v['cos'])} | {ci(v['mse'])} | {ci(v['bias'])} | {ci(v['cos_mean'])} | "
                   f"{ideal} | {measured} |")
    return "\n".join(out)


def cross_paired(s: dict[str, Any], extra: dict[str, Any], a: str, b: str) -> dict[str, Any] | None:
    """``a`` (a method of the confirmation run) against ``b`` (one of the study's), each against the baseline of its
    own run and paired by seed: (a − baseline)_confirmation − (b − baseline)_study, so what differs between the two
    runs' machines (the baseline's own last digits) cancels out."""
    prim = s["primary"]

    def finals(summary, m):
        return {int(r["seed"]): r["final"][prim] for r in summary.get("runs", []) if r.get("method") == m}

    fa, fb, ba, bb = finals(extra, a), finals(s, b), finals(extra, "baseline"), finals(s, "baseline")
    seeds = sorted(set(fa) & set(fb) & set(ba) & set(bb))
    return _t_interval([(fa[k] - ba[k]) - (fb[k] - bb[k]) for k in seeds]) if seeds else None


def speed_note(table: list[dict] | None) -> str:
    """Where the screen's speed column comes from, and how far apart two variants of one cost came out."""
    if not table:
        return "The speed columns are the runs' own, where a run timed the variant."
    by_ideal: dict[float, list[float]] = {}
    for r in table:
        by_ideal.setdefault(round(_f(r.get("ideal")), 6), []).append(_f(r.get("speedup")))
    spread = max((max(v) / min(v) for v in by_ideal.values() if len(v) > 1), default=1.0)
    return (f"The speed columns are one `jagg speed` of every screened variant side by side "
            f"([speed.json](frontier/screen/speed.json): {len(table)} methods, interleaved rounds on one machine "
            f"state, medians): variants of the same cost (the same ideal) came out up to {100 * (spread - 1):.0f}% "
            f"apart, the rounds' noise on this machine; read a difference smaller than that as none.")


def _flow(text: str) -> str:
    """Paragraphs of prose joined into one line each (wrap() folds them); tables, headings, lists kept as they are."""
    out: list[str] = []
    for line in text.split("\n"):
        plain = line and not line.startswith(("|", "#", "- ", "![", "  "))
        if plain and out and out[-1] and not out[-1].startswith(("|", "#", "![")) and not out[-1].endswith("  "):
            out[-1] += " " + line.strip()
        else:
            out.append(line)
    return "\n".join(out)


def unbiased_section(s: dict[str, Any], rows: list[dict[str, Any]], screen: dict[str, Any] | None,
                     al: dict[str, Any] | None, extra: dict[str, Any] | None, merge_note: str, args,
                     speed_table: list[dict] | None = None) -> str:
    """The unbiased JAGG: the screen of the estimators, the errors' alignment across rollouts, the confirmation."""
    from jagg_core.pipeline.report_stats import NONINFERIORITY_MARGIN as margin

    if not screen:
        return ""
    sm = screen.get("methods", {})
    by = {r["method"]: r for r in rows}

    def v(m: str, k: str) -> float:
        return _f(sm.get(m, {}).get(k, {}).get("mean"))

    place = [m for m in sm if m.startswith("k3at")] + (["jagg-k3"] if "jagg-k3" in sm else [])
    best = max(place, key=lambda m: v(m, "cos")) if place else None
    out = [f"""## A JAGG that holds over 8 steps? The unbiased JAGG

Every deterministic variant above interpolates the Jacobians between anchors, and the interpolation may be wrong the
same way from one iteration to the next: an error that would add up instead of averaging out. The **unbiased JAGG** removes it at the cost of one more graph: besides
the two endpoints, one step r of the group is drawn with probability p_r and its interpolation error is corrected
with weight 1/p_r (`jagg.random_anchor`, jagg_core/jagg.py); still one joint backward, over 3 graphs — K = 3's cost,
24/14 = 1.71× ideal — and on average the exact gradient (a float64 test: the law-weighted mean over every draw is exact
to 1e-12). The price is variance: one draw's error is 1/p_r times one step's. Four variants were screened: (1) the
unbiased JAGG drawn **per group** (`jagg-u`, the issue's randomised anchor); (2) drawn **per image** (each image its own
step, stratified over the images, so one backward averages many draws: the variance-reduced one we expected to win),
with the uniform law (`jagg-ui`) and with **p ∝ α(1 − α)** (`jagg-uia`: where a smooth velocity's interpolation error
is largest); (3) a **half correction** (`jagg-uh`: λ = 0.5, `jagg.random_anchor_weight`: half the bias, a quarter of the
variance: a point between JAGG and the unbiased one); (4) **K = 3 anchors placed where the error is** (`k3atM`: the
third anchor at step M, `jagg.anchor_at`, the position searched over M = 1 … 6 in the screen; M = 4 is the even `jagg-k3`).

### The screen

`scripts/jagg_fidelity_study.py --methods …` ([methods.json](frontier/screen/methods.json)) on the same models and
rollouts as the cosines above ({', '.join(screen.get('models', []))}; {screen.get('meta', {}).get('rollouts', '?')}
rollouts each, {screen.get('meta', {}).get('max_readings', '?')} readings of {screen.get('meta', {}).get('reading', '?')}
images per rollout): for each reading, the exact gradient and each estimator's; a random-anchor method's law enumerated
exactly (every drawn step, weighted by p_r) for its expectation, and, per image, {screen.get('meta', {}).get('draws', '?')}
seeded draws for its one-draw figures. Intervals: Student-t over (model, rollout) units.

{screen_table(screen, rows, speed_table)}

{speed_note(speed_table)}

What it says. JAGG's error is all bias: its one-draw relative squared error {v('jagg', 'mse'):.3f} is its bias squared
({v('jagg', 'bias'):.3f}²). The unbiased JAGG has no bias (cos(E g, exact) = 1 to rounding) but one draw's squared
error is {v('jagg-u', 'mse'):.3f} per group and {v('jagg-ui', 'mse'):.3f} per image — {v('jagg-u', 'mse') / v('jagg', 'mse'):.1f}× JAGG's:
drawing per image does not lower it (stratifying the draws over the images buys nothing here, as if the images' errors
pointed in unrelated directions), nor does p ∝ α(1 − α) ({v('jagg-uia', 'mse'):.3f}). The half correction sits between
(bias {v('jagg-uh', 'bias'):.3f}, squared error {v('jagg-uh', 'mse'):.3f}). Placing K = 3's third anchor by the measured
error moves little: the best placement{f' ({best}, cos {v(best, "cos"):.4f})' if best else ''} against the even one
(jagg-k3, cos {v('jagg-k3', 'cos'):.4f}).
"""]
    if al:
        out.append("### Is JAGG's error a bias that adds up?\n\n" + alignment_note(al) + "\n")
        am = al.get("methods", {})

        def a(m: str, k: str = "across_rollouts") -> float:
            return _f(am.get(m, {}).get(k, {}).get("mean"))

        def kept(name: str) -> str:
            d = am.get(name, {}).get("signal_kept")
            return "–" if not d else f"{_f(d['mean']):.2f} [{_f(d['lo']):.2f}, {_f(d['hi']):.2f}]"

        out.append(f"The exact gradient of one reading repeats nothing measurable of itself from one rollout to the "
                   f"next (cos {a('exact'):+.3f}: a GRPO gradient of {al.get('meta', {}).get('reading', '?')} images is "
                   f"almost all sampling noise), and neither does JAGG's error (cos {a('jagg'):+.3f}) nor the unbiased "
                   f"draw's ({a('jagg-u'):+.3f}). The share of the consistent gradient each estimator keeps — JAGG "
                   f"{kept('jagg')}, the unbiased one {kept('jagg-u')} — has intervals too wide to read: at this "
                   f"resolution the gradient vectors cannot tell a bias that adds up from noise that averages out. "
                   f"The training is the test.\n")
    if extra is not None:
        conf = [r for r in rows if r.get("confirmation")]
        lines = []
        for r in conf:
            p = r["paired"] or {}
            vs_jagg = cross_paired(s, extra, r["method"], "jagg")
            lines.append(f"- **{r['method']}**: gain {_mean_iv(r['gain'])}; − baseline (paired) {_mean_iv(p)} → "
                         f"*{r['verdict']}* at the {margin:g} margin; measured update speedup {r['measured']:.2f}× "
                         f"(ideal {r['ideal']:.2f}×); gain per 1000 s − baseline's "
                         f"{_mean_iv(r['per_ks_paired']) if r.get('per_ks_paired') else '–'}"
                         + (f"; against JAGG W = 8 of the study, each against its own run's baseline (paired by "
                            f"seed) {_mean_iv(vs_jagg)}" if vs_jagg else "")
                         + ".")
        out.append(f"""### The confirmation

Chosen from the screen, not from the test split: the unbiased JAGG drawn per group (`jagg-u`), the purest test of the
question — no bias, the most variance — and, of the two draws with the same squared error, the one with fewer calls
(the per-image probe forwards every middle step on a subset of images: more, smaller calls). Trained on the toy-w recipe,
10 seeds paired with the baseline's, {args.extra_how}. {merge_note}

{chr(10).join(lines)}
""")
        u = next((r for r in conf if r.get("random_anchor") == "group" or r["method"] == "jagg-u"), None)
        if u is not None and u.get("paired"):
            out.append(bias_or_size(s, extra, u, by, sm))
    return _flow("\n".join(out))


def bias_or_size(s: dict[str, Any], extra: dict[str, Any], u: dict[str, Any], by: dict[str, dict[str, Any]],
                 sm: dict[str, Any]) -> str:
    """The answer to the question the unbiased JAGG was built to ask, read from its rows."""
    from jagg_core.pipeline.report_stats import NONINFERIORITY_MARGIN as margin

    p, vs = u["paired"], cross_paired(s, extra, u["method"], "jagg")
    jagg = by.get("jagg", {}).get("paired") or {}
    mse = lambda m: _f(sm.get(m, {}).get("mse", {}).get("mean"))  # noqa: E731
    less = p["hi"] < 0
    same = vs is not None and vs["lo"] <= 0 <= vs["hi"]
    held = u["verdict"] == "non-inferior" and u["measured"] >= 1.5
    verdict = (f"**It holds**: {u['method']} is non-inferior at the {margin:g} margin at {u['measured']:.2f}×."
               if held else f"**No variant at W = 8 reached the target** (non-inferior at the {margin:g} margin with a "
               f"measured update speedup of at least 1.5×): {u['method']} ran at {u['measured']:.2f}× and its paired "
               f"interval {_iv(p['lo'], p['hi'])} reaches below −{margin:g}.")
    return f"""### Bias or size?

{verdict} The unbiased JAGG has no bias, yet it {'learned less than the exact baseline' if less else 'showed no loss against the exact baseline'} ({_mean_iv(p)}), and {'no better than JAGG W = 8 was shown' if same else 'differed from JAGG W = 8'} (each against its own run's baseline: {_mean_iv(vs) if vs else '–'}; JAGG's own: {_mean_iv(jagg) if jagg else '–'}). Removing the bias {'did not measurably give back' if same else 'changed'} the learning JAGG lost, while one draw's squared error grew from {mse('jagg'):.3f} (all of it bias) to {mse(u['method']):.3f} (all of it variance): {mse(u['method']) / mse('jagg'):.1f}×. So the lost learning is not JAGG's bias alone — an error that averages out over iterations cost about as much here as one that does not, and per unit of squared error the bias was the costlier (JAGG's {mse('jagg'):.3f} of bias² cost {_mean_iv(jagg) if jagg else '–'}; the unbiased draw's {mse(u['method']):.3f} of variance cost {_mean_iv(p)}). A JAGG that holds at W = 8 needs an estimator close to the exact gradient draw by draw, not only on average: of everything measured, the smallest error per draw (K = 4 anchors, {mse('jagg-k4'):.3f}) came closest to the baseline, at {by.get('jagg-k4', {}).get('measured', float('nan')):.2f}× — below the 1.5× it would have to pay for itself. What is left to try is a lower-variance unbiased estimator at the same cost: a control variate fitted to the error's shape over the group, or several random anchors sharing one probe forward on a model where a forward of more rows is nearly free (a GPU); on this CPU toy, a forward costs in proportion to its rows.
"""


def alignment_note(al: dict[str, Any] | None) -> str:
    """How alike each estimator's error is from one rollout to the next, against the exact gradient's own repeat."""
    if not al:
        return ""
    m = al.get("methods", {})

    def c(name: str, key: str, digits: int = 3) -> str:
        d = m.get(name, {}).get(key)
        return "–" if not d else f"{_f(d['mean']):+.{digits}f} [{_f(d['lo']):+.{digits}f}, {_f(d['hi']):+.{digits}f}]"

    lines = ["| gradient | cos between two rollouts' (iterations apart, one model) | cos between two readings of one "
             "rollout (other images) | share of the consistent gradient the method keeps |", "|---|---|---|---|"]
    for name in m:
        what = "the exact gradient itself" if name == "exact" else f"{name}'s error (its gradient − exact)"
        lines.append(f"| {what} | {c(name, 'across_rollouts')} | {c(name, 'within_rollout')} | "
                     f"{c(name, 'signal_kept', 2)} |")
    meta = al.get("meta", {})
    return (f"How alike an estimator's error is from one rollout to the next (`scripts/jagg_fidelity_study.py "
            f"--methods … --alignment`, [alignment.json](frontier/screen/alignment.json): models "
            f"{', '.join(meta.get('models', []))}, {meta.get('rollouts', '?')} rollouts each, readings of "
            f"{meta.get('reading', '?')} images; the interval is Student-t over the models, each model's pairs "
            f"averaged first; a random anchor's error is one seeded draw's):\n\n" + "\n".join(lines))


def draw(rows: list[dict[str, Any]], prim: str, path: Path) -> None:
    """The frontier: update speedup (x) against the test gain with its seeds' interval (y), the baseline's band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), dpi=110)
    base = next(r for r in rows if r["method"] == "baseline")
    g = base["gain"]
    if not (math.isnan(g.get("lo", float("nan"))) or math.isnan(g.get("hi", float("nan")))):
        ax.axhspan(g["lo"], g["hi"], color="0.85", label="exact baseline: gain's seeds' 95%")
    ax.axhline(g["mean"], color="0.5", lw=0.8)
    for i, r in enumerate(rows):
        x, y = r["measured"], r["gain"]["mean"]
        lo, hi = r["gain"].get("lo", float("nan")), r["gain"].get("hi", float("nan"))
        err = [[y - lo], [hi - y]] if not (math.isnan(lo) or math.isnan(hi)) else None
        ax.errorbar([x], [y], yerr=err, fmt="o", color=f"C{i % 10}", capsize=4, label=r["method"])
        ax.annotate(r["method"], (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.axvline(1.0, color="0.6", ls=":", lw=0.8)
    ax.set_xlabel(f"update speedup over the exact baseline ({rows[0]['speed_source']}, median)")
    ax.set_ylabel(f"test {prim} gain over the base (mean, seeds' 95%)")
    ax.set_title("toy-w: speed for learning, one point per method", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    _draw_per_ks(ax2, rows, prim)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


def _draw_per_ks(ax, rows: list[dict[str, Any]], prim: str) -> None:
    """The second panel: each method's gain per 1000 s of whole training iterations minus the baseline's, paired by
    seed (mean, seeds' 95%): paired within its own run, so rows from another run's machine compare alike."""
    ax.axhline(0.0, color="0.5", lw=0.8, label="the exact baseline")
    for i, r in enumerate(rows):
        d = r.get("per_ks_paired")
        if not d:
            continue
        x = r["measured"]
        err = None if math.isnan(d["lo"]) else [[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]]
        ax.errorbar([x], [d["mean"]], yerr=err, fmt="s", color=f"C{i % 10}", capsize=4)
        ax.annotate(r["method"], (x, d["mean"]), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("update speedup over the exact baseline (median)")
    ax.set_ylabel(f"test {prim} gain per 1000 s − the baseline's (paired)")
    ax.set_title("what a second of training buys (whole iterations)", fontsize=10)
    ax.grid(alpha=0.3)


def table(rows: list[dict[str, Any]], prim: str) -> str:
    checks = _check_keys(rows)
    head = ("| method | W | K | reuse | ideal speedup | measured speedup | gain: mean [seeds' 95%] [prompts' 95%] | "
            "gain − baseline (paired): mean [seeds' 95%] [prompts' 95%] | verdict at the margin | cos(method, exact) |"
            " gain per 1000 s: mean [seeds' 95%] | − baseline's (paired) |"
            + "".join(f" `{k}` change (not trained on): mean [seeds' 95%] |" for k in checks) + "\n"
            + "|---" * (12 + len(checks)) + "|")
    lines = [head]
    for r in rows:
        g, gp, p = r["gain"], r["gain_prompts"], r["paired"]
        exact = r["mode"] in ("exact", "exact_batched")
        paired = "–" if not p else f"{_mean_iv(p)} {_iv(*p['prompts_interval'])}"
        lines.append(
            f"| {r['method']} | {r['window'] if r['window'] is not None else '–'} | "
            f"{'–' if exact else str(r['anchors']) + (' + 1 drawn' if r.get('random_anchor') else '')} | "
            f"{'yes' if r['reuse'] else 'no'} | {r['ideal']:.2f}× | "
            f"{r['measured']:.2f}× | {_mean_iv(g)} {_iv(*gp)} | {paired} | {r['verdict']} | {r['cos']} |"
            f" {_mean_iv(r['per_ks']) if r.get('per_ks') else '–'} |"
            f" {_mean_iv(r['per_ks_paired']) if r.get('per_ks_paired') else '–'} |"
            + "".join(_check(r.get("checks", {}).get(k)) for k in checks))
    return "\n".join(lines)


def _cos_mean(r: dict[str, Any]) -> float:
    return r.get("cos_mean", float("nan"))


def _spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties share their average rank); NaN when either side is constant."""
    from scipy.stats import spearmanr

    if len(set(a)) < 2 or len(set(b)) < 2:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def _order(rs: list[dict[str, Any]], key) -> str:
    """Methods from low to high by key, ties joined by '='."""
    out: list[list[dict[str, Any]]] = []
    for r in sorted(rs, key=lambda r: (key(r), r["method"])):
        if out and key(out[-1][0]) == key(r):
            out[-1].append(r)
        else:
            out.append([r])
    return " < ".join(" = ".join(r["method"] for r in tie) for tie in out)


def _mean_iv(d: dict[str, Any]) -> str:
    """An interval's mapping as ``mean [lo, hi]``."""
    return f"{d['mean']:+.4f} {_iv(d.get('lo', float('nan')), d.get('hi', float('nan')))}"


def _check_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The scores not trained on (the hacking check) that some row carries."""
    return sorted({k for r in rows for k in r.get("checks", {})})


def _check(c: dict[str, Any] | None) -> str:
    return " – |" if not c else f" {_mean_iv(c)} |"


def advice(rows: list[dict[str, Any]], margin: float) -> str:
    """What the measurements say to a user choosing W, K and reuse: read from the rows, nothing beyond them.

    Each method is placed by its paired interval with the baseline against two lines, 0 and −margin: held at the
    margin (all of it above −margin), shown to lose more than the margin (all of it below), shown to learn less but
    not placed against the margin (all of it below 0, reaching above −margin), or no difference shown (it covers 0)."""
    others = [r for r in rows if r["method"] != "baseline" and r["paired"]]
    held = sorted((r for r in others if r["verdict"] == "non-inferior"), key=lambda r: -r["measured"])
    lost = [r for r in others if r["verdict"] == "inferior"]
    rest = [r for r in others if r["verdict"] not in ("non-inferior", "inferior")]
    less = [r for r in rest if r["paired"]["hi"] < 0]
    open_ = [r for r in rest if not r["paired"]["hi"] < 0]

    def named(rs: list[dict[str, Any]]) -> str:
        return ", ".join(f"{r['method']} ({r['measured']:.2f}×, {_mean_iv(r['paired'])})" for r in rs)

    say = []
    if others and all(r["paired"]["mean"] < 0 for r in others):
        window = next((r["window"] for r in rows if r["method"] == "baseline"), None)
        say.append(f"- **On average every method learned less than the exact baseline**"
                   f"{f' over this {window}-step window' if window else ''}; how much less is below, method by method.")
    if held:
        best = held[0]
        say.append(f"- **Held at the {margin:g} margin:** {named(held)}; the fastest of them is {best['method']} "
                   f"({best['measured']:.2f}× the exact update, {best['ideal']:.2f}× ideal).")
    if lost:
        say.append(f"- **Shown to learn less than the exact baseline by more than {margin:g}:** {named(lost)}.")
    if less:
        say.append(f"- **Shown to learn less than the exact baseline** (the paired interval lies below 0), by an "
                   f"amount {_seeds({r['method']: r['seeds'] for r in less})} cannot place against the "
                   f"{margin:g} margin: {named(less)}.")
    if open_:
        say.append(f"- **No loss shown, none ruled out** (the paired interval covers 0 and reaches below "
                   f"−{margin:g}): {named(open_)}.")
    if not say:
        return "- No method other than the baseline was evaluated."
    paid = [r for r in others if r.get("per_ks_paired") and r["per_ks_paired"]["lo"] > 0]
    cost = [r for r in others if r.get("per_ks_paired") and r["per_ks_paired"]["hi"] < 0]
    if paid or cost:
        def per_s(rs: list[dict[str, Any]]) -> str:
            return ", ".join(f"{r['method']} ({_mean_iv(r['per_ks_paired'])})" for r in rs)

        say.append(f"- **Per second of training** (gain per 1000 s of whole iterations, paired with the baseline's): "
                   + "; ".join(x for x in (f"shown to pay: {per_s(paid)}" if paid else "",
                                            f"shown to cost: {per_s(cost)}" if cost else "") if x)
                   + "; the others not shown either way.")
    # Does the cosine order the methods as the learning does? (The question a user with no toy can ask of their model.)
    # a random-anchor estimator's one-draw cosine is not its expectation's: it is ordered apart (below)
    with_cos = [r for r in others if not math.isnan(_cos_mean(r)) and not r.get("stochastic")]
    if len(with_cos) >= 3:
        rho = _spearman([_cos_mean(r) for r in with_cos], [r["gain"]["mean"] for r in with_cos])
        by_cos, by_gain = _order(with_cos, _cos_mean), _order(with_cos, lambda r: r["gain"]["mean"])
        same = by_cos == by_gain
        say.append(f"- **The cosine orders the methods {'as' if same else 'roughly as' if rho > 0.7 else 'not as'} "
                   f"the test gain does** (Spearman {rho:.2f} over {len(with_cos)} methods): by cosine {by_cos}"
                   f"{'; by gain the same' if same else f'; by gain {by_gain}'}. Each row's gain is over its seeds "
                   f"and its cosine over (model, rollout) units, so the order of two neighbours is not itself shown "
                   f"(their intervals overlap).")
        shown = [r for r in with_cos if r["paired"]["hi"] < 0]  # shown to learn less than the baseline
        clear = [r for r in with_cos if r not in shown]
        if clear and shown and max(map(_cos_mean, shown)) < min(map(_cos_mean, clear)):  # the cosine separates them
            say.append(f"- **Where it stopped holding, by cosine:** every method with a cosine of "
                       f"{max(_cos_mean(r) for r in shown):.3f} or less was shown to learn less than the baseline; "
                       f"{', '.join(r['method'] for r in clear)} (cosine "
                       f"{', '.join(f'{_cos_mean(r):.3f}' for r in clear)}) was not. One toy, one window: a reading "
                       f"of where this model's line lies, not a threshold for yours.")
    jr = {r["method"]: r for r in others}
    for r in others:
        twin = jr.get(r["method"].replace("-reuse", "")) if r["reuse"] else None
        if twin is not None and twin is not r and r["gain"]["mean"] == twin["gain"]["mean"]:
            say.append(f"- **Reuse costs no learning here:** {r['method']} learned what {twin['method']} learned, to "
                       f"the last digit (the same gradient: one optimizer step per rollout, see below), at "
                       f"{r['measured']:.2f}× the exact update instead of {twin['measured']:.2f}×.")
    return "\n".join(say)


CARRY_OVER = """\
**What on the toy would not carry over to Flux or Qwen-Image.**

- *The cost.* The toy's transformer is 2 MB on one CPU thread: per-call overheads are a large share of a step, and
  a backward costs about two forwards. On Flux or Qwen-Image with gradient checkpointing a backward costs about three
  forwards, so the ideal speedups are larger than the toy's (`jagg plan --profile qwenimage` prints them), and the
  measured ones depend on the GPU's memory traffic, not the toy's. Read the speed columns as the cost model's
  ordering, not as a forecast of seconds.
- *The cosine.* How far the velocity is from affine over a span of 8 steps is a property of the model and of the
  noise schedule. A 2 MB model drawing 24-pixel scenes is not a 12 B one drawing 720-pixel images; the toy can only
  say whether the *ordering* of W, K and reuse by cosine matches the ordering by learning. Measure the cosine on your
  own model before choosing W (`train.fidelity_every`'s monitor, or `jagg_frac: auto`).
- *Reuse.* It is free of error here because every iteration takes one optimizer step, so the rollout's velocities
  are the updated policy's. A recipe with several optimizer steps per rollout (`train.optimizer_steps_per_epoch`,
  `train.inner_epochs`, e.g. the qwenimage-dance profile) reuses stale velocities after the first step.
- *The margin.* {margin_share}; a real run's reward has its own scale and its own noise between seeds. A method held
  at this margin on the toy is a candidate, not a result, on a real backbone.
- *Memory.* K anchors keep K graphs alive at once in the joint variant; on a real backbone that is the limit the toy
  never meets (`jagg.variant: sequential` keeps one).
"""


def checks_note(rows: list[dict[str, Any]]) -> str:
    """A sentence on the scores not trained on (the hacking check), read from the rows."""
    out = []
    for k in _check_keys(rows):
        means = [(r["checks"][k]["mean"], r["method"]) for r in rows if k in r.get("checks", {})]
        (lo, lo_m), (hi, hi_m) = min(means), max(means)
        out.append(f" `{k}`, not trained on, is the hacking check (docs/results.md): its change over the base runs "
                   f"from {lo:+.4f} ({lo_m}) to {hi:+.4f} ({hi_m}).")
    return "".join(out)


def margin_share(rows: list[dict[str, Any]], margin: float, prim: str) -> str:
    base = next((r for r in rows if r["method"] == "baseline"), None)
    g = base["gain"]["mean"] if base else float("nan")
    if not g > 0:
        return f"{margin:g} `{prim}` is the toy's margin"
    return f"{margin:g} `{prim}` is {100 * margin / g:.0f}% of the toy baseline's gain here ({g:+.4f})"


def page(s: dict[str, Any], rows: list[dict[str, Any]], cos: dict[str, Any] | None, pilot: str, args,
         unbiased: str = "") -> str:
    from jagg_core.pipeline.report_stats import NONINFERIORITY_MARGIN

    prim = s["primary"]
    base = s.get("base") or {}
    seeds = {r["method"]: r["seeds"] for r in rows}
    runs = sum(seeds.values())
    cos_link = (os.path.relpath(Path(args.cosines).resolve(), Path(args.out).resolve().parent)
                if _inside(args.cosines, args.out) else args.cosines)
    cos_note = (f"The cosines are `scripts/jagg_fidelity_study.py --methods all`'s ([methods.json]"
                f"({cos_link})): "
                f"each method's whole update gradient over the 8 trained steps (its own routing: two groups of 4 are "
                f"one gradient here) against the exact one, on the same models ({', '.join(cos.get('models', []))}) "
                f"and rollouts, {cos.get('meta', {}).get('reading', '?')} images per reading; the interval is "
                f"Student-t over (model, rollout) units.") if cos else (
        "No cosines were given (`--cosines`): the column says so.")
    measured = (f"Measured with `jagg run --profile toy-w --parallel-runs 2` on a clone of main at {args.commit} on "
                f"{args.machine} ({args.date}): **{args.wall}** for everything ({runs} trainings two at a time, one "
                f"thread each, their evaluations, `jagg speed` and the report)"
                f"{f', {args.cpu} of CPU time' if args.cpu else ''}; then `jagg report --profile toy-w --copy-to "
                f"docs/frontier`.")
    return f"""# Beyond the paper: where JAGG stops holding (`toy-w`)

The paper runs JAGG at W = 4. The cost model says a longer group is cheaper — 3W/(W + 4): 1.5× at W = 4, 2× at
W = 8 — while Theorem 1's premise, velocities affine between a group's two endpoints, gets worse over a longer span;
K anchors (piecewise JAGG) and rollout-velocity reuse trade some of it back. This page draws that frontier on the
toy, with the rigour of [results.md](results.md): toy-full's recipe on an SDE window of **8** trained steps, every
method **{_seeds(seeds)}, paired by seed**, the test
split, two intervals on every score (over seeds: Student-t; over prompts: a bootstrap of the test prompts). The methods:
the exact baseline (8 backward passes), JAGG over the 8 (W = 8, one group), JAGG in two groups of W = 4, piecewise
JAGG over the 8 with K = 3 and K = 4 anchors, the endpoint-only ablation at W = 8, and JAGG with rollout-velocity
reuse at W = 8. Only the backward differs between them.

{measured} The numbers below are read from [frontier/summary.json](frontier/summary.json) by
`scripts/frontier_page.py`.

## The frontier

![update speedup against test gain, one point per method](frontier/frontier.png)

The x axis is the update stage's speedup over the exact baseline ({rows[0]['speed_source']}: every method's update
timed in interleaved rounds on one machine state, medians); the y axis the test `{prim}` gain over the base model
({base.get(prim, float('nan')):.4f}) with its seeds' 95% interval; the grey band is the exact baseline's interval.

{table(rows, prim)}

"Ideal" is the cost model's (forward 1, backward 2) from the forwards each method counted: 3·8 over the groups'
summed cost, so two groups of 4 are 1.5×, K anchors 3W/(W + 2K), reuse W/K, a random anchor one anchor more. "Gain
per 1000 s": the test gain over the seconds of the run's whole iterations (the report's seconds per iteration: the
side-by-side stage's rollout and update plus the runs' other phases, one machine state for every method), with its
seeds' interval, and its paired difference with the baseline's, seed by seed. "Verdict": the method against the exact
baseline at a non-inferiority margin of {NONINFERIORITY_MARGIN:g} `{prim}` (jagg_core/pipeline/report_stats.py),
from the paired seeds' interval: *non-inferior* when all of it lies above −{NONINFERIORITY_MARGIN:g}, *inferior* when
all of it lies below, *not shown* otherwise. {cos_note}{checks_note(rows)}

**The report's verdict sentence** (JAGG and the ablation at W = 8): {s.get('verdict') or '–'}

{unbiased}

## Advice for a real run

{advice(rows, NONINFERIORITY_MARGIN)}

{CARRY_OVER.replace("{margin_share}", margin_share(rows, NONINFERIORITY_MARGIN, prim))}
## How the recipe was chosen

{pilot.strip()}
"""


def wrap(text: str, width: int = 120) -> str:
    """Every line of prose longer than ``width`` folded to it (a bullet's continuation indented under its text); table
    rows, headings and images stay one line each."""
    import textwrap

    out = []
    for line in text.split("\n"):
        if len(line) <= width or line.startswith(("|", "#", "![")):
            out.append(line)
            continue
        indent = "  " if line.startswith("- ") else ""
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


def _seeds(seeds: dict[str, int]) -> str:
    lo, hi = (min(seeds.values()), max(seeds.values())) if seeds else (0, 0)
    return f"{lo} seed{'s' if lo != 1 else ''}" if lo == hi else f"{lo}–{hi} seeds"


def _inside(path: str, out: str) -> bool:
    try:
        Path(path).resolve().relative_to(Path(out).resolve().parent)
        return True
    except ValueError:
        return False


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summary", default=str(ROOT / "docs/frontier/summary.json"))
    ap.add_argument("--cosines", default=str(ROOT / "docs/frontier/fidelity/methods.json"))
    ap.add_argument("--pilot", default=str(ROOT / "docs/frontier/pilot.md"))
    ap.add_argument("--wall", required=True, help="what the toy-w run took, e.g. '2 h 10 min'")
    ap.add_argument("--cpu", default="", help="its CPU time, e.g. '250 min' (user + system)")
    ap.add_argument("--machine", default="the project's 2-core CPU machine")
    ap.add_argument("--date", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--out", default=str(ROOT / "docs/frontier.md"))
    ap.add_argument("--screen", default="", help="the screen's methods.json (scripts/jagg_fidelity_study.py --methods)")
    ap.add_argument("--alignment", default="", help="its alignment.json (--alignment)")
    ap.add_argument("--extra-summary", default="", help="a confirmation run's summary.json: its methods are added")
    ap.add_argument("--speed", default="", help="a `jagg speed` speed.json timing every screened variant side by side")
    ap.add_argument("--extra-how", default="", help="how the confirmation run was made (command, commit, time)")
    args = ap.parse_args(argv)
    from jagg_core.setup.storage import atomic_write_text, read_regular

    out = Path(args.out)
    if out.is_dir():
        raise PageError(f"--out {args.out} is a folder; name the page's file, e.g. docs/frontier.md.")
    s = _read_json(Path(args.summary), "a report's summary", f"write it with {REPORT} or pass --summary PATH")
    cos = _read_json(Path(args.cosines), "a methods.json of scripts/jagg_fidelity_study.py --methods",
                     "write it with `scripts/jagg_fidelity_study.py --methods all`") if args.cosines else None
    if cos is not None and not isinstance(cos.get("methods"), dict):
        raise PageError(f"{args.cosines} is not a methods.json of scripts/jagg_fidelity_study.py --methods.")
    raw = read_regular(Path(args.pilot), PageError, fix="it holds the section on how the recipe was chosen")
    try:
        pilot = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PageError(f"{args.pilot} is not UTF-8 text; it holds the section on how the recipe was chosen.") \
            from None
    screen = _read_json(Path(args.screen), "a methods.json", "write it with scripts/jagg_fidelity_study.py "
                        "--methods") if args.screen else None
    al = _read_json(Path(args.alignment), "an alignment.json", "write it with scripts/jagg_fidelity_study.py "
                    "--alignment") if args.alignment else None
    rows = rows_of(s, cos, screen)
    extra, merge_note = None, ""
    if args.extra_summary:
        extra = _read_json(Path(args.extra_summary), "a report's summary", "pass the confirmation run's summary.json")
        merge_note = merge_confirmation(rows, s, extra, rows_of(extra, cos, screen))
    speed_table = (_read_json(Path(args.speed), "a speed.json of `jagg speed`", "write it with `jagg speed`")
                   .get("table") if args.speed else None)
    unbiased = unbiased_section(s, rows, screen, al, extra, merge_note, args, speed_table)
    text = wrap(page(s, rows, cos, pilot, args, unbiased))  # the whole page is built before anything is written
    fig = out.parent / FIGURE
    fig.parent.mkdir(parents=True, exist_ok=True)
    draw(rows, s["primary"], fig)
    atomic_write_text(out, text)
    print(f"wrote {args.out} and {Path(args.out).parent / FIGURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
