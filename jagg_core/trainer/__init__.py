"""The GRPO trainer: rollouts, rewards, the update in any backward mode of ``jagg_core.modes``, checkpoints, the TSV
curve."""

from .checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, save_checkpoint
from .curve import TsvCurve
from .errors import TrainingError
from .loop import TrainResult, train
from .rollout import Trajectory, rollout

__all__ = [
    "CheckpointError",
    "TrainResult",
    "Trajectory",
    "TrainingError",
    "TsvCurve",
    "latest_checkpoint",
    "list_checkpoints",
    "rollout",
    "save_checkpoint",
    "train",
]
