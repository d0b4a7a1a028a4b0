"""The report's evaluation section: the conventions every score depends on and each protocol form of the finals.

Beside the final table (which shows ``eval.protocol``'s headline in each metric's own units) this lists the protocol,
the scorers (model, pretrained weights, scale), resolution, steps, guidance and the per-prompt seed rule, and a table
of every protocol form the evaluation carries (``forms`` of jagg_core/evaluation/protocols.py): the toy's benchmark
run has both, a real profile the one of its protocol. docs/evaluation.md says which paper reports which form.
"""

from __future__ import annotations

import html
import statistics
from typing import Any, Callable, Sequence

__all__ = ["FORM_LABELS", "evaluation_section", "evaluation_markdown", "evaluation_html"]

# (protocol form, value key) -> the column's label
FORM_LABELS = {
    ("hpdv2-benchmark", "raw"): "hpdv2-benchmark (mean of style block means, raw)",
    ("hpdv2-benchmark", "x100"): "hpdv2-benchmark ×100 (hpsv2 leaderboard)",
    ("hpdv2-test", "raw"): "hpdv2-test (plain mean, raw: the paper's tables)",
}


def evaluation_section(params, runs: Sequence[Any], base: dict | None) -> dict[str, Any]:  # noqa: ANN001
    """``{"conventions": {...}, "forms": [{"row", "seeds", "values": {metric: {"<form>/<key>": mean}}}]}`` for the
    base model and each method (the mean over its seeds' final evaluations); the conventions are those the
    evaluations recorded (their ``metrics.json``), the first that has them."""
    metrics = list(params.eval.metrics)

    def values(evals: Sequence[dict]) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for m in metrics:
            cells: dict[str, list[float]] = {}
            for ev in evals:
                for form, vals in ev["metrics"].get(m, {}).get("forms", {}).items():
                    for key in ("raw", "x100"):
                        if key in vals:
                            cells.setdefault(f"{form}/{key}", []).append(vals[key])
            out[m] = {k: statistics.fmean(v) for k, v in cells.items()}
        return out

    rows = []
    if base:
        rows.append({"row": "base model (step 0)", "seeds": 0, "values": values([base])})
    for method in params.run.methods:
        evals = [r.eval for r in runs if r.method == method and r.eval]
        if evals:
            rows.append({"row": method, "seeds": len(evals), "values": values(evals)})
    recorded = [ev.get("conventions") for ev in [base, *(r.eval for r in runs)] if ev and ev.get("conventions")]
    return {"conventions": recorded[0] if recorded else {"eval.protocol": params.eval.protocol}, "forms": rows}


def _form_rows(section: dict[str, Any]) -> list[list[str]]:
    present = {(m, k) for r in section["forms"] for m, vs in r["values"].items() for k in vs}
    metrics = list(dict.fromkeys(m for r in section["forms"] for m in r["values"]))
    cols = [(m, f"{form}/{key}") for m in metrics for form, key in FORM_LABELS if (m, f"{form}/{key}") in present]
    head = ["run", "seeds"] + [f"{m}: {FORM_LABELS[tuple(k.split('/'))]}" for m, k in cols]
    body = [[r["row"], str(r["seeds"]) if r["seeds"] else "–"] +
            [f"{r['values'][m][k]:.{2 if k.endswith('x100') else 4}f}" if k in r["values"].get(m, {}) else "–"
             for m, k in cols] for r in section["forms"]]
    return [head] + body


def _convention_lines(section: dict[str, Any]) -> list[str]:
    return [f"{k}: {v}" for k, v in section["conventions"].items()]


def evaluation_markdown(section: dict[str, Any], table: Callable[[list[list[str]]], str]) -> str:
    """The section in markdown; ``table`` writes a markdown table from rows (the report's writer)."""
    lines = "\n".join(f"- `{line.split(': ', 1)[0]}`: {line.split(': ', 1)[1]}" for line in _convention_lines(section))
    return ("## Evaluation protocol and conventions (every score above and below)\n\n" + lines + "\n\n"
            "### The final scores in each protocol form (mean over seeds; docs/evaluation.md)\n\n" +
            table(_form_rows(section)))


def evaluation_html(section: dict[str, Any], table: Callable[[list[list[str]]], str]) -> str:
    """The section in HTML; ``table`` writes an HTML table from rows (the report's writer)."""
    items = "".join(f"<li><code>{html.escape(line.split(': ', 1)[0])}</code>: "
                    f"{html.escape(line.split(': ', 1)[1])}</li>" for line in _convention_lines(section))
    return (f"<h2>Evaluation protocol and conventions (every score on this page)</h2><ul>{items}</ul>"
            f"<h3>The final scores in each protocol form (mean over seeds; docs/evaluation.md)</h3>"
            f"<div class=\"wide\">{table(_form_rows(section))}</div>")
