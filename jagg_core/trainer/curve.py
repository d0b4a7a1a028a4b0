"""The TSV curve every training run writes (the logging interface itself is :mod:`jagg_core.setup.metric_logger`).

The trainer emits namespaced metrics (``reward/…``, ``train/…``, ``time/…``, ``jagg/…``) per iteration through a
``MetricLogger``; the pipeline binds it to MLflow, and :class:`TsvCurve` always writes ``curve.tsv`` (one row per
iteration, one column per metric) for DVC plots and the report.
"""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Any, Mapping

from ..setup.storage import atomic_write_text, read_regular
from .errors import TrainingError

__all__ = ["TsvCurve"]


class TsvCurve:
    """``iteration`` plus one column per metric; rewritten atomically on every row so it is never half-written.

    On resume, rows after the resumed iteration are dropped (they belong to the interrupted attempt).
    """

    def __init__(self, path: str | os.PathLike, *, resume_from: int | None = None):
        self.path = Path(path)
        self.rows: list[dict[str, float]] = []
        if resume_from is not None and self.path.exists():
            # bounded and regular (a FIFO there hung `jagg train` after "resuming")
            text = read_regular(self.path, TrainingError, fix="move it aside; the run's MLflow metrics hold the curve")
            reader = csv.DictReader(io.StringIO(text.decode("utf-8", "replace")), delimiter="\t")
            for line, row in enumerate(reader, start=2):
                parsed = self._parse(row, line)
                if parsed.get("iteration", math.inf) <= resume_from:
                    self.rows.append(parsed)
        if resume_from:
            self._check_complete(resume_from)

    def _check_complete(self, resume_from: int) -> None:
        """A resumed curve holds iterations 1..``resume_from``, each once; a truncated or deleted one would be
        continued silently with holes (the report would read a curve of iterations 1 and 3), so it is refused."""
        have = [int(r["iteration"]) for r in self.rows if "iteration" in r]
        if have == list(range(1, resume_from + 1)):
            return
        if not self.path.exists():
            what = "does not exist"
        else:
            missing = sorted(set(range(1, resume_from + 1)) - set(have))
            twice = sorted({i for i in have if have.count(i) > 1})
            what = (f"lacks iteration(s) {_span(missing)}" if missing else f"holds iteration(s) {_span(twice)} twice"
                    if twice else "is out of order")
        raise TrainingError(f"{self.path} {what}, but the run resumes from its checkpoint of iteration "
                            f"{resume_from}: put the curve back from a copy, or pass --restart to train the run "
                            f"again from the start.")

    def _parse(self, row: Mapping[Any, Any], line: int) -> dict[str, float]:
        """One row of numbers; anything else is one sentence naming the file and the line (raised in the worker, it
        stays a user error across the process boundary instead of a "died worker" that Prefect retries)."""
        try:
            return {str(k): float(v) for k, v in row.items() if v not in ("", None)}
        except (TypeError, ValueError):
            raise TrainingError(f"{self.path} line {line} is not a row of numbers; fix or delete that line (the "
                                f"rows up to the resumed checkpoint are kept, later ones are rewritten).") from None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = next((r for r in self.rows if r.get("iteration") == step), None)
        if row is None:
            row = {"iteration": float(step)}
            self.rows.append(row)
        row.update({k: float(v) for k, v in metrics.items()})
        self._write()

    def log_image(self, image: Any, key: str, step: int) -> None:
        pass

    def _write(self) -> None:
        cols = ["iteration"] + sorted({k for r in self.rows for k in r} - {"iteration"})
        buf = io.StringIO()
        w = csv.writer(buf, delimiter="\t", lineterminator="\n")
        w.writerow(cols)
        for r in self.rows:
            w.writerow([_fmt(r[c]) if c in r else "" for c in cols])
        atomic_write_text(self.path, buf.getvalue())


def _span(items: list[int]) -> str:
    shown = ", ".join(map(str, items[:5]))
    return shown + (f" … ({len(items)} in all)" if len(items) > 5 else "")


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:.8g}"
