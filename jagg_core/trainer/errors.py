"""The trainer's own user-facing error."""

from __future__ import annotations

from ..errors import UserError

__all__ = ["TrainingError"]


class TrainingError(UserError, RuntimeError):
    """Training cannot continue; the message is for the user."""
