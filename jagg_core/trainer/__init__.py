"""The GRPO trainer: rollouts, rewards, the exact / JAGG / ablate update, checkpoints, logging."""

from .checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, save_checkpoint
from .curve import MetricLogger, MultiLogger, NullLogger, TsvCurve
from ..pipeline.storage import read_prompts
from .loop import TrainingError, TrainResult, train
from .rollout import Trajectory, rollout

__all__ = [
    "CheckpointError",
    "MetricLogger",
    "MultiLogger",
    "NullLogger",
    "TrainResult",
    "Trajectory",
    "TrainingError",
    "TsvCurve",
    "latest_checkpoint",
    "list_checkpoints",
    "read_prompts",
    "rollout",
    "save_checkpoint",
    "train",
]
