"""The base of every error whose message is written for the user: entry points print it as one sentence, exit 1."""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(Exception):
    """An error the user can fix; its message is one sentence naming what is wrong and the fix. No traceback.

    Its text is redacted (credentials in URLs, see :mod:`jagg_core.setup.redact`) wherever it goes: printed, logged, or a
    Prefect state message — a message may quote a value the user gave (``tracking.mlflow_uri``), secrets included."""

    def __str__(self) -> str:
        from .setup.redact import redact  # here, not at import: the algorithm imports nothing of the application

        return redact(super().__str__())
