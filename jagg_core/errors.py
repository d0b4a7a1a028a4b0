"""The base of every error whose message is written for the user: entry points print it as one sentence, exit 1."""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(Exception):
    """An error the user can fix; its message is one sentence naming what is wrong and the fix. No traceback."""
