"""Evaluation: scoring generated test-set images with the reward models and summarising them by benchmark protocol."""

from . import benchmark as _benchmark
from .benchmark import *  # noqa: F401,F403  (benchmark's __all__ is the package's)

__all__ = list(_benchmark.__all__)
