"""Evaluation: scoring generated test-set images with the reward models and summarising them by benchmark protocol.

The names of :mod:`.benchmark` are the package's (``from jagg_core.evaluation import load_hps_benchmark``), imported
on first use, so that the light modules of the package (:mod:`.conventions`, :class:`EvalError`) do not load torch
with it: a stage refuses bad input before torch loads.
"""

from __future__ import annotations

from ..errors import UserError

__all__ = ["EvalError"]


class EvalError(UserError, RuntimeError):
    """Evaluation cannot run; the message is for the user."""


def __getattr__(name: str):
    if name == "benchmark":  # the submodule itself, asked before it is imported: the import system's to find
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import benchmark  # loads torch: on first use of one of its names (module docstring)

    if name not in benchmark.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(benchmark, name)
    globals()[name] = value  # later look-ups skip this function
    return value
