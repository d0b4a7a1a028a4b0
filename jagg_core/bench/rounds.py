"""The timed rounds of a `jagg bench` that has not finished, kept on disk as each ends, so that a rerun continues.

``<out>/rounds/<model>/`` holds ``settings.json`` (what the rounds were timed with: the timing settings, the model, the
machine) and one ``round-NNN.json`` per finished round (every cell's seconds, its backward seconds and counts, the
primitives, the rollout and the optimizer step), each written atomically the moment its round ends. A rerun whose
settings are the same continues after the last kept round; other settings start fresh, said in one line. The folder
is deleted once the model's result JSON is saved (:func:`discard_rounds`): a finished bench starts afresh.

The number of rounds (``--repeats``), the memory probes and the communication counts are not part of the settings:
they do not change what a round times, so ``--repeats 9`` after a bench of 7 stopped at round 5 keeps the 5.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..setup.json_read import read_json
from ..setup.storage import FolderLock, atomic_write_text
from .models import BenchError

__all__ = ["RoundStore", "discard_rounds", "settings_difference", "SETTINGS_FILE"]

SETTINGS_FILE = "settings.json"
_ROUND = re.compile(r"round-(\d{3,})\.json")
# What a round records per cell and for the whole round (see `timing._CellTimer.timed_rounds`).
ROUND_KEYS = ("seconds", "backward_seconds", "totals", "primitives")


def settings_difference(old: Any, new: Any, where: str = "") -> str | None:
    """The first setting that differs between two settings trees, as ``"config.steps 16, now 8"``; None if equal."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for k in sorted(set(old) | set(new), key=str):
            diff = settings_difference(old.get(k), new.get(k), f"{where}.{k}" if where else str(k))
            if diff:
                return diff
        return None
    if old != new:
        return f"{where or 'settings'} {json.dumps(old)}, now {json.dumps(new)}"
    return None


class RoundStore:
    """One model's kept rounds (see the module docstring); holds ``<folder>/.lock`` from :meth:`open` to
    :meth:`close`, so two benches writing the same ``--out`` do not mix their rounds."""

    def __init__(self, folder: str | Path, settings: Mapping[str, Any], *, name: str,
                 say: Callable[[str], None] | None = None):
        self.folder, self.settings, self.name = Path(folder), json.loads(json.dumps(settings)), name
        self.say = say or (lambda msg: None)
        self._lock = FolderLock(self.folder, f"the bench rounds of {name} ({self.folder})")

    def _files(self) -> list[Path]:
        return sorted((p for p in self.folder.glob("round-*.json") if _ROUND.fullmatch(p.name)),
                      key=lambda p: int(_ROUND.fullmatch(p.name).group(1)))

    def open(self, cells: Sequence[str], primitives: Sequence[str]) -> list[dict]:
        """Lock the folder and return the rounds kept for these settings, in order (the first ``n`` of them, numbered
        1..n without a gap, each with every cell of ``cells`` and every one of ``primitives``); rounds of other
        settings, or after a damaged one, are deleted and said in one line."""
        self._lock.acquire()
        try:
            return self._open(cells, primitives)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, cells: Sequence[str], primitives: Sequence[str]) -> list[dict]:
        for tmp in self.folder.glob(".round-*.tmp"):  # a write a kill cut short (never renamed into place)
            tmp.unlink(missing_ok=True)
        files = self._files()
        kept_settings = self._read(self.folder / SETTINGS_FILE) if (self.folder / SETTINGS_FILE).exists() else None
        created = kept_settings.get("created") if isinstance(kept_settings, dict) else None
        old = kept_settings.get("settings") if isinstance(kept_settings, dict) else None
        if files and old != self.settings:
            why = (settings_difference(old, self.settings) if isinstance(old, dict)
                   else f"{SETTINGS_FILE} is missing or damaged")
            self.say(f"{self.name}: the {len(files)} round(s) kept in {self.folder} were timed with other settings "
                     f"({why}); starting fresh")
            self._drop(files)
            files, created = [], None
        rounds: list[dict] = []
        for n, path in enumerate(files, 1):
            data = self._read(path)
            problem = _round_problem(data, n, path, cells, primitives)
            if problem:
                self.say(f"{self.name}: {problem}; timing round {n} and after again")
                self._drop(files[n - 1:])
                break
            rounds.append(data)
        if rounds:
            self.say(f"{self.name}: continuing from the {len(rounds)} round(s) kept in {self.folder}"
                     + (f" (started {created})" if created else ""))
        if not rounds or created is None:
            import datetime as _dt

            created = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        atomic_write_text(self.folder / SETTINGS_FILE,
                          json.dumps({"created": created, "settings": self.settings}, indent=1) + "\n")
        return rounds

    def save(self, number: int, data: Mapping[str, Any]) -> Path:
        """``round-NNN.json`` of round ``number`` (1-based), written atomically."""
        path = self.folder / f"round-{number:03d}.json"
        atomic_write_text(path, json.dumps({"round": number, **data}, allow_nan=False) + "\n")
        return path

    def close(self) -> None:
        self._lock.release()

    def _read(self, path: Path) -> Any:
        try:
            return read_json(path, BenchError, limit=64 << 20)
        except BenchError:  # not there, not a file, not UTF-8, not JSON, not finite or too deep: as if not kept
            return None

    def _drop(self, files: Sequence[Path]) -> None:
        for p in files:
            p.unlink(missing_ok=True)


def _round_problem(data: Any, n: int, path: Path, cells: Sequence[str], primitives: Sequence[str]) -> str | None:
    """Why ``data`` is not round ``n`` of these cells, in words; None if it is."""
    if not isinstance(data, dict) or data.get("round") != n or not all(isinstance(data.get(k), dict)
                                                                       for k in ROUND_KEYS):
        return f"{path.name} is not round {n} (damaged, or a gap before it)"
    if any(set(data[k]) != set(cells) for k in ("seconds", "backward_seconds", "totals")) or \
            set(data["primitives"]) != set(primitives):
        return f"{path.name} has other cells than this bench times"
    numbers = [*data["seconds"].values(), *data["backward_seconds"].values(), *data["primitives"].values()]
    if not all(type(x) in (int, float) and x >= 0 for x in numbers):
        return f"{path.name} holds a time that is not a non-negative number"
    return None


def discard_rounds(folder: str | Path) -> None:
    """Delete a model's kept rounds once its result is saved (and ``rounds/`` above it if nothing else is there)."""
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.parent.rmdir()
    except OSError:  # other models' rounds, or already gone
        pass
