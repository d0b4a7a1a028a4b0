"""The GRPO trainer: rollouts, rewards, the update in any backward mode of ``jagg_core.modes``, checkpoints, the TSV
curve.

The names below are imported on first use (PEP 562), so that importing one light submodule — ``errors``,
``fingerprint`` — does not import torch and the whole trainer (2 s of every launcher process)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the submodule that defines it
_WHERE = {
    "CheckpointError": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "list_checkpoints": "checkpoint",
    "save_checkpoint": "checkpoint",
    "TsvCurve": "curve",
    "TrainingError": "errors",
    "TrainResult": "loop",
    "train": "loop",
    "Trajectory": "rollout",
}
# The rollout function is ``jagg_core.trainer.rollout.rollout``: a lazy package attribute of the same name as its
# submodule would be the module or the function depending on what was imported first.

__all__ = sorted(_WHERE)

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, save_checkpoint
    from .curve import TsvCurve
    from .errors import TrainingError
    from .loop import TrainResult, train
    from .rollout import Trajectory


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
