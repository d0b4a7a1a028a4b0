"""The base of every error whose message is written for the user: entry points print it as one sentence, exit 1."""

from __future__ import annotations

__all__ = ["UserError", "sentence"]


class UserError(Exception):
    """An error the user can fix; its message is one sentence naming what is wrong and the fix. No traceback.

    A message may quote a value the user gave (``tracking.mlflow_uri``), secrets included: where it is shown it is
    redacted (credentials in URLs, :mod:`jagg_core.setup.redact`) — printed by a stage entry (``tasks.common.cli``),
    handed to Prefect by a stage's task or a flow (``tasks.common.shown_redacted``), logged (every handler's filter).
    The algorithm imports nothing of the application, so this class does not redact its own text."""


def sentence(error: BaseException | str, limit: int = 600) -> str:
    """``error``'s message as one line ending in one full stop: whitespace (newlines of a multi-line message)
    folded, cut at ``limit`` characters with an ellipsis, a trailing full stop not doubled when it is wrapped."""
    text = " ".join(str(error).split())
    if len(text) > limit:
        text = text[: limit - 1].rstrip() + "…"
    return text if text.endswith((".", "…", "?", "!")) else text + "."
