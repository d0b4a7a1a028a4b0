"""The trainer's one small logging interface, and the TSV curve every run writes.

The trainer emits namespaced metrics (``reward/…``, ``train/…``, ``time/…``, ``jagg/…``) per iteration through a
:class:`MetricLogger`; the pipeline binds it to MLflow, and :class:`TsvCurve` always writes ``curve.tsv`` (one row per
iteration, one column per metric) for DVC plots and the report.
"""

from __future__ import annotations

import csv
import io
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

_UMASK = os.umask(0o022)
os.umask(_UMASK)

__all__ = ["MetricLogger", "NullLogger", "MultiLogger", "TsvCurve", "atomic_write_text", "atomic_write_bytes"]


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; the result should look like any written file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


class MetricLogger(Protocol):
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_image(self, image: Any, key: str, step: int) -> None: ...


class NullLogger:
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_image(self, image: Any, key: str, step: int) -> None:
        pass


class MultiLogger:
    def __init__(self, loggers: Sequence[MetricLogger]):
        self.loggers = list(loggers)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, step)

    def log_image(self, image: Any, key: str, step: int) -> None:
        for lg in self.loggers:
            lg.log_image(image, key, step)


class TsvCurve:
    """``iteration`` plus one column per metric; rewritten atomically on every row so it is never half-written.

    On resume, rows after the resumed iteration are dropped (they belong to the interrupted attempt).
    """

    def __init__(self, path: str | os.PathLike, *, resume_from: int | None = None):
        self.path = Path(path)
        self.rows: list[dict[str, float]] = []
        if resume_from is not None and self.path.exists():
            reader = csv.DictReader(io.StringIO(self.path.read_text()), delimiter="\t")
            for row in reader:
                parsed = {k: float(v) for k, v in row.items() if v not in ("", None)}
                if parsed.get("iteration", math.inf) <= resume_from:
                    self.rows.append(parsed)

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


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:.8g}"
