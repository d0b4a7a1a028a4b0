"""Write docs/results.md from toy-full's report: the reading of the comparison, the bars it was asked to meet, every
number from ``docs/results/summary.json`` (``jagg report --profile toy-full --copy-to docs/results``), then the report's
own tables and figures.

    python scripts/results_page.py --summary docs/results/summary.json --report reports/toy-full/README.md \
        --wall "61 min 5 s" --date 2026-12-03 --commit abc1234 --out docs/results.md

The prose states what the intervals say and nothing more; the figures it quotes are read from the summary, so the page
cannot disagree with the report it was written from.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jagg_core.errors import UserError  # noqa: E402
from tasks.common import cli  # noqa: E402  (the command line's rules: one sentence, exit 1, no traceback)


class PageError(UserError, ValueError):
    """An input the page cannot be written from."""


def _iv(lo: float, hi: float) -> str:
    return f"[{lo:+.4f}, {hi:+.4f}]"


def _gain(row: dict, metric: str) -> dict:
    return row["intervals"][metric]["gain_seeds"]


def _same_numbers(s: dict) -> str:
    """A sentence where JAGG with rollout-velocity reuse gave JAGG's numbers exactly, and why that is expected."""
    p = next((p for p in s["paired"] if (p["a"], p["b"]) == ("jagg-reuse", "jagg")), None)
    if not p or any(d != 0 for d in p["diffs"]):
        return ""
    return ("\njagg-reuse − jagg is exactly 0 on every seed: with one optimizer step per iteration the update runs "
            "the policy that made the rollout, so the middle steps' velocities it reuses are the ones JAGG recomputes, "
            "bit for bit; reuse only saves their forwards (the speed table below).\n")


def _evaluated(s: dict) -> str:
    """What the evaluations scored: the final checkpoint on the whole test split, the curve's on its subset."""
    n = s.get("curve_prompts_per_style")
    whole = "the final checkpoint on the 512 test prompts"
    return f": {whole}, the curve's checkpoints on the first {n} prompts per style" if n else f": {whole} and so the curve's"


PROFILE = "toy-full"  # the page's prose describes this profile's comparison
REPORT = f"`jagg report --profile {PROFILE} --copy-to docs/results`"
NEEDED = ("baseline", "jagg")  # the methods whose comparison the page reads (the verdict, the bars)


def _read_summary(path: str) -> dict:
    """toy-full's summary.json with what the page reads, or one sentence saying what is wrong with it."""
    from jagg_core.setup.storage import read_regular

    data = read_regular(path, PageError, fix=f"write it with {REPORT} or pass --summary PATH")
    try:
        s = json.loads(data)
    except ValueError as e:
        raise PageError(f"{path} is not whole JSON ({e.msg} at line {e.lineno}; cut short?); write it again with "
                        f"{REPORT}.") from None
    if not isinstance(s, dict) or not isinstance(s.get("final"), list) or not isinstance(s.get("paired"), list):
        raise PageError(f"{path} is not a report's summary.json (no 'final' and 'paired' lists); pass the one "
                        f"{REPORT} writes.")
    if s.get("profile") != PROFILE:
        raise PageError(f"{path} is the summary of profile {str(s.get('profile'))[:40]!r}; this page describes "
                        f"{PROFILE}'s comparison: pass the summary of {REPORT}.")
    methods = [r.get("method") for r in s["final"] if isinstance(r, dict)]
    missing = [m for m in NEEDED if m not in methods]
    pairs = [(p.get("a"), p.get("b")) for p in s["paired"] if isinstance(p, dict)]
    if missing or ("jagg", "baseline") not in pairs:
        raise PageError(f"{path} has no {' and no '.join(missing) or 'paired jagg − baseline'} result (its methods: "
                        f"{', '.join(map(str, methods)) or 'none'}); the page compares jagg with the baseline, so its "
                        f"sweep must train both.")
    return s


def _read_report(path: str, profile: str) -> str:
    """The report's README.md, written for ``profile`` (a README of another profile would make a mixed page)."""
    from jagg_core.setup.storage import read_regular

    data = read_regular(path, PageError, fix=f"pass --report reports/{profile}/README.md, written by `jagg report`")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise PageError(f"{path} is not UTF-8 text; pass the README.md that `jagg report` wrote.") from None
    m = re.match(r"# jagg report — profile `([^`\n]*)`", text)
    if not m:
        raise PageError(f"{path} does not begin as a report's README.md does (\"# jagg report — profile …\"); pass "
                        f"reports/{profile}/README.md.")
    if m.group(1) != profile:
        raise PageError(f"{path} is the report of profile {m.group(1)[:40]!r} but the summary is {profile}'s; pass the "
                        f"README.md written with it (reports/{profile}/README.md), or the page would mix the two.")
    return text


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summary", default=str(ROOT / "docs/results/summary.json"))
    ap.add_argument("--report", default=str(ROOT / "reports/toy-full/README.md"))
    ap.add_argument("--wall", required=True, help="what toy-full took, e.g. '61 min 5 s'")
    ap.add_argument("--cpu", default="", help="its CPU time, e.g. '112 min' (user + system)")
    ap.add_argument("--machine", default="the project's 2-core CPU machine")
    ap.add_argument("--date", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--out", default=str(ROOT / "docs/results.md"))
    ap.add_argument("--note", default="", help="a paragraph on how this run went, printed under the verdict")
    args = ap.parse_args(argv)

    from jagg_core.pipeline.report_stats import NONINFERIORITY_MARGIN
    from jagg_core.setup.storage import atomic_write_text

    if Path(args.out).is_dir():
        raise PageError(f"--out {args.out} is a folder; name the page's file, e.g. docs/results.md.")
    s = _read_summary(args.summary)
    report = _read_report(args.report, s["profile"])
    try:
        page = _page(args, s, report, NONINFERIORITY_MARGIN)
    except (KeyError, TypeError, IndexError, ValueError) as e:  # a summary of another version of the report
        what = f"{type(e).__name__}: {' '.join(str(e).split())[:80]}"
        raise PageError(f"{args.summary} lacks what the page reads ({what}); write it again with {REPORT} at this "
                        f"commit.") from None
    atomic_write_text(args.out, page)  # whole or not at all
    print(f"wrote {args.out}")
    return 0


def _page(args: argparse.Namespace, s: dict, report: str, NONINFERIORITY_MARGIN: float) -> str:  # noqa: N803
    prim, pref = s["primary"], "toy_preference"
    final = {r["method"]: r for r in s["final"]}
    paired = {(p["a"], p["b"]): p for p in s["paired"]}
    base = s["base"]
    seeds = {m: r["seeds"] for m, r in final.items()}
    per_seed = {m: [r["final"][prim] - base[prim] for r in sorted(s["runs"], key=lambda r: r["seed"])
                    if r["method"] == m] for m in final}

    def gain_line(m: str) -> str:
        g = _gain(final[m], prim)
        gp = final[m]["intervals"][prim]["gain_prompts"]
        q = _gain(final[m], pref)
        return (f"| {m} | {seeds[m]} | {' '.join(f'{x:+.3f}' for x in per_seed[m])} | {g['mean']:+.4f} | "
                f"{g['sd']:.4f} | {_iv(g['lo'], g['hi'])} | {_iv(*gp)} | {q['mean']:+.4f} {_iv(q['lo'], q['hi'])} |")

    def pair_line(a: str, b: str) -> str:
        p = paired.get((a, b))
        if not p:
            return ""
        pi = p.get("prompts_interval") or [float("nan")] * 2
        return (f"| {a} − {b} | {p['n']} | {p['mean']:+.4f} | {_iv(p['lo'], p['hi'])} (half-width "
                f"{(p['hi'] - p['lo']) / 2:.4f}) | {_iv(*pi)} |")

    jb = paired[("jagg", "baseline")]
    bars = [
        ("a validation split the studies use; the reported test split never used for a choice",
         "validation = the world's first held-out split (the round-3 pilots chose on it); test = 4 × 128 prompts drawn "
         "after it", "met"),
        ("baseline, jagg, ablate and jagg-reuse with 10 seeds each",
         ", ".join(f"{m} {seeds.get(m, 0)}" for m in ("baseline", "jagg", "ablate", "jagg-reuse")),
         "met" if all(seeds.get(m, 0) >= 10 for m in ("baseline", "jagg", "ablate", "jagg-reuse")) else "not met"),
        ("paired interval of JAGG − baseline with half-width ≤ 0.012",
         f"{_iv(jb['lo'], jb['hi'])}, half-width {(jb['hi'] - jb['lo']) / 2:.4f}",
         "met" if (jb["hi"] - jb["lo"]) / 2 <= 0.012 else "not met"),
    ]
    for m in ("baseline", "jagg"):
        g, q = _gain(final[m], prim), _gain(final[m], pref)
        bars.append((f"{m} learns on the test split: lower end of the seeds' 95% interval of the gain ≥ +0.015",
                     f"{g['lo']:+.4f}", "met" if g["lo"] >= 0.015 else "not met"))
        bars.append((f"{m}: mean `toy_preference` change ≥ −0.03", f"{q['mean']:+.4f}",
                     "met" if q["mean"] >= -0.03 else "not met"))
    bar_rows = "\n".join(f"| {a} | {b} | {c} |" for a, b, c in bars)

    ttt = s.get("time_to_target") or {}
    ps_lines = []
    for m, r in (ttt.get("methods") or {}).items():
        pr = r["paired_gain_per_1000s_vs_baseline"]
        ps = r["paired_seconds_vs_baseline"]
        ps_lines.append(
            f"| {m} | {r['seconds_per_iteration']:.2f} | {r['reached']} of {r['seeds']} | "
            + (f"{r['median_seconds']:.0f}" if r["median_seconds"] is not None else "–") + " | "
            + (f"{ps['mean']:+.0f} s [{ps['lo']:+.0f}, {ps['hi']:+.0f}] ({ps['n']} seeds)" if ps["n"] > 1 and m != "baseline" else "–")
            + f" | {r['gain_per_1000s']['mean']:+.4f} | "
            + (f"{pr['mean']:+.4f} {_iv(pr['lo'], pr['hi'])}" if pr["n"] > 1 and m != "baseline" else "–") + " |")
    side = s.get("side_by_side") or {}
    side_lines = [f"| {r['method']} | {r['update_s']:.3f} [{r['update_q1']:.3f}, {r['update_q3']:.3f}] | "
                  f"{r.get('speedup', float('nan')):.2f}×{' ⚑' if r.get('above_ideal') else ''} | {r['ideal']:.2f}× |"
                  for r in side.get("table", [])]

    report = re.sub(r"\]\(([\w\-.]+\.png)\)", r"](results/\1)", report)
    report = re.sub(r"^# jagg report.*\n", "", report)
    report = re.sub(r"^(#+) ", r"#\1 ", report, flags=re.M)

    page = f"""# The paper's comparison on the embedded default (`toy-full`)

Baseline GRPO (exact per-step backward) against JAGG, the endpoint-only ablation and JAGG with rollout-velocity reuse,
**ten seeds each, paired by seed**, on the embedded default: the toy world, the shipped toy-flux base model
(`assets/toy-base/`, the same bits on every machine), the paper's Flow-GRPO-Fast window — T = 12 steps, SDE (and
training) on steps 0–3, one JAGG group of W = 4, ODE elsewhere (jagg_frac 1.0) — G = 32 images × 4 prompts per
iteration, 32 iterations, lr 1e-4, β = 0, and the toy's alignment reward `toy_fidelity` (its GenEval: counts, colours,
positions, relations). Every method gets the same rollouts' seeds, optimizer and prompts; only the backward differs.
The primary score is `toy_fidelity` on the **test split**: 4 styles × 128 prompts drawn after the validation split
on which the recipe was chosen (docs/toy_world.md, "Splits"; docs/toy_rl.md's pilots), so no choice has seen it.
`toy_preference` (clean, complete pictures), not trained on, is reported beside it: the check that the alignment is
not bought with worse pictures. Every score carries two intervals: over seeds (Student-t, what another seed would
do) and over prompts (a bootstrap of the test prompts, what another draw of the test split would do).

Measured with `jagg run --profile toy-full --parallel-runs 2` (the toy-full deployment's parameters) on a clone of main
at {args.commit} on {args.machine} ({args.date}): **{args.wall}** for everything (prompts, the shipped base, {sum(seeds.values())}
trainings two at a time, one thread each, each run's evaluation beside the next trainings{_evaluated(s)}, `jagg speed`
(every method's update side by side) and the report){f", {args.cpu} of CPU time" if args.cpu else ""}; then
`jagg report --copy-to docs/results`. The tables and figures below are the report's; the numbers in the prose are
read from [results/summary.json](results/summary.json) by `scripts/results_page.py`.

**The verdict.** {s['verdict']}

{args.note}

### What each method learned (test `toy_fidelity` from the base's {base[prim]:.4f}; `toy_preference` from {base[pref]:.4f})

| method | seeds | gain per seed | mean gain | sd over seeds | seeds' 95% | prompts' 95% | `toy_preference` change (seeds' 95%) |
|---|---|---|---|---|---|---|---|
{chr(10).join(gain_line(m) for m in final)}

### Paired by seed (test `toy_fidelity`)

| difference | seeds | mean | seeds' 95% (Student-t) | prompts' 95% (bootstrap) |
|---|---|---|---|---|
{chr(10).join(x for x in (pair_line(a, b) for a, b in (("jagg", "baseline"), ("ablate", "jagg"), ("ablate", "baseline"), ("jagg-reuse", "jagg"))) if x)}
{_same_numbers(s)}
Non-inferiority margin: {NONINFERIORITY_MARGIN:g} `toy_fidelity` (jagg_core/pipeline/report_stats.py), fixed before
these runs: the previous round's bar, "within one seed sd of the baseline".

### Learning per second

Seconds per iteration come from the `speed` stage (rollout and each method's update timed side by side on one machine
state, plus the rest of an iteration pooled over the runs), so no machine load tilts them. The target is the
baseline's mean final gain ({ttt.get('target_gain', float('nan')):+.4f}).

| method | s / iteration | reached the target | median seconds to it | − baseline's (paired, seeds) | final gain per 1000 s | − baseline's (paired 95%) |
|---|---|---|---|---|---|---|
{chr(10).join(ps_lines)}

### Speed, side by side (update stage; {side.get('rounds', '–')} interleaved rounds, one thread, medians [quartiles])

| method | update s | speedup vs exact | ideal (cost model) |
|---|---|---|---|
{chr(10).join(side_lines)}

### Against the bars this comparison was asked to meet

| bar | measured | |
|---|---|---|
{bar_rows}

## The report's tables and figures

{report}"""
    return page


if __name__ == "__main__":
    sys.exit(main())
