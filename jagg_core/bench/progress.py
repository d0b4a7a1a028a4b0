"""The timed rounds' progress: which round, method and window the bench is in, and the time left (tqdm's estimate).

As `jagg train` shows its own: a tqdm bar on a terminal; elsewhere (a log file, Prefect, DVC) a line through the
stage's logger at most every ``interval`` seconds and at the end of each round. Each piece of a round (a cell's
update, the primitives, the rollout, the optimizer step) counts as long as it took in the warm-up, so the estimate
holds inside a round too, where the pieces run in a shuffled order and differ in cost by an order of magnitude.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

__all__ = ["RoundsProgress", "piece_label"]

# Elsewhere than a terminal: what one line says (tqdm's own fields: the estimate is tqdm's).
LOG_FORMAT = "{desc}; {percentage:.0f}% of the timed rounds, {elapsed} so far, about {remaining} left"
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}"


_PIECES = {"primitives": "primitive costs (f0, f, b)", "rollout": "rollout", "optimizer": "optimizer step"}


class _Sink:
    """Where the bar of a run without a terminal goes: nowhere (its lines are logged instead)."""

    def write(self, s: str) -> None:
        pass

    def flush(self) -> None:
        pass


class RoundsProgress:
    """``weights``: each piece's warm-up seconds; ``done``: rounds already kept (their share counts as done)."""

    def __init__(self, name: str, weights: Mapping[str, float], *, repeats: int, done: int, bar: bool,
                 say: Callable[[str], None] | None, interval: float = 30.0):
        from tqdm import tqdm

        self.name, self.repeats, self.say, self.interval = name, repeats, say, interval
        floor = max(1e-6, min(weights.values(), default=1.0))  # a piece timed at 0 s still advances the bar
        self.weights = {k: max(w, floor) for k, w in weights.items()}
        per_round = sum(self.weights.values())
        self.bar_on = bar
        self.bar = tqdm(total=per_round * repeats, initial=per_round * done, desc=f"bench {name}",
                        bar_format=BAR_FORMAT, smoothing=0, dynamic_ncols=True, file=None if bar else _Sink(),
                        mininterval=0.5)
        self._redirect = None
        if bar:  # the stage's log lines (a round's ratio) above the bar, not through it
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
        self.round, self.where, self.last_line = done, "", time.monotonic()

    def piece(self, round_number: int, label: str) -> None:
        """About to time ``label`` (e.g. ``jagg-joint W 8, jagg_frac 1``) in round ``round_number`` (1-based)."""
        self.round, self.where = round_number, f"round {round_number}/{self.repeats}, {label}"
        self.bar.set_description_str(f"bench {self.name}: {self.where}", refresh=False)
        if self.bar_on:
            self.bar.refresh()
        if not self.bar_on and self.say and time.monotonic() - self.last_line >= self.interval:
            self.say(self.line())

    def done(self, key: str) -> None:
        self.bar.update(self.weights[key])

    def line(self) -> str:
        """The progress as one log line (tqdm's estimate of what is left), for a logger that names the bench."""
        from tqdm import tqdm

        self.last_line = time.monotonic()
        return tqdm.format_meter(**{**self.bar.format_dict, "bar_format": LOG_FORMAT, "ncols": None,
                                    "prefix": self.where})

    def remaining(self) -> str:
        """tqdm's estimate of the time left, e.g. ``03:25`` (``?`` before anything is timed)."""
        from tqdm import tqdm

        return tqdm.format_meter(**{**self.bar.format_dict, "bar_format": "{remaining}", "ncols": None})

    def close(self) -> None:
        self.bar.close()
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None


def piece_label(key: str) -> str:
    """A piece of a round in words: ``jagg-joint/W8/frac1`` -> ``jagg-joint W 8, jagg_frac 1``; ``exact`` ->
    ``exact``; ``optimizer`` -> ``optimizer step``."""
    if key in _PIECES:
        return _PIECES[key]
    parts = key.split("/")
    out = parts[0]
    for p in parts[1:]:
        if p.startswith("W"):
            out += f" W {p[1:]}"
        elif p.startswith("frac"):
            out += f", jagg_frac {p[4:]}"
    return out
