"""Fault injection at named points of the trainer, for the reliability tests (inactive unless ``JAGG_FAULT`` is set).

``JAGG_FAULT="<point>@<iteration>:<action>"`` (several separated by ``,``): at ``point`` (``rollout``, ``reward``,
``update``, ``checkpoint``) of iteration ``iteration`` (1-based), do ``action``: ``kill`` (SIGKILL this process),
``oserror`` (raise ENOSPC, as a full disk), ``term`` (SIGTERM this process), ``nan`` (the caller poisons its value with NaN).
"""

from __future__ import annotations

import errno
import os
import signal

__all__ = ["fault"]


def fault(point: str, iteration: int) -> str | None:
    """Perform the fault planned for ``point`` at ``iteration``; returns ``"nan"`` for the caller to act on."""
    spec = os.environ.get("JAGG_FAULT")
    if not spec:
        return None
    for item in spec.split(","):
        where, _, action = item.partition(":")
        name, _, it = where.partition("@")
        if name != point or (it and int(it) != iteration):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "term":  # a real SIGTERM to this process (a launcher's handler turns it into Interrupted)
            os.kill(os.getpid(), signal.SIGTERM)
            return action
        if action == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return action
    return None
