"""Fault injection at named points of the trainer, for the reliability tests (inactive unless ``JAGG_FAULT`` is set).

``JAGG_FAULT="<point>@<iteration>:<action>"`` (several separated by ``,``): at ``point`` of iteration ``iteration``
(1-based) do ``action``. The points: the trainer's ``rollout``, ``reward``, ``update`` and ``checkpoint``, and the
launcher's ``run_created`` (``tasks/train.py``, iteration 0: once the MLflow run exists, before any worker starts).
The actions: ``kill`` (SIGKILL this process), ``oserror`` (raise ENOSPC, as a full disk), ``eacces`` (raise
PermissionError, as a read-only folder), ``term`` (SIGTERM this process), ``nan`` (the caller poisons its value with NaN),
``hold`` (wait there while the file ``$JAGG_FAULT_HOLD`` exists: a test holds a run at a point, e.g. to kill it there,
however fast the machine).

The training recipe's points are hooks (:data:`TRAINER_FAULTS`, called by ``jagg_core/trainer/loop.py`` at its named
points), so that what a fault does to the recipe's values is written here, not in the recipe.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch

__all__ = ["TRAINER_FAULTS", "TrainerFaults", "fault"]


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
        if action == "eacces":
            raise PermissionError(errno.EACCES, "Permission denied (injected)")
        if action == "hold":
            hold = os.environ.get("JAGG_FAULT_HOLD")
            while hold and os.path.exists(hold):
                time.sleep(0.1)
        return action
    return None


class TrainerFaults:
    """The training recipe's fault points: each hook does nothing unless ``JAGG_FAULT`` plans a fault at its point."""

    def before_rollout(self, iteration: int) -> None:
        """``rollout``: before the iteration's sampling (``kill``, ``term``, ``oserror``)."""
        fault("rollout", iteration)

    def rewards(self, rewards: torch.Tensor, info: dict, names: Iterable[str],
                iteration: int) -> tuple[torch.Tensor, dict]:
        """``reward``, on the rollout's scores: ``nan`` is a reward model that returns NaN for one image (the first
        image's total and its score under the first of the configured reward ``names``, on copies)."""
        if fault("reward", iteration) != "nan":
            return rewards, info
        first = f"reward/{next(iter(names))}"
        rewards, info = rewards.clone(), {**info, first: info[first].clone()}
        rewards[0] = info[first][0] = float("nan")
        return rewards, info

    def after_backward(self, trainable: Iterable[torch.nn.Parameter], iteration: int) -> None:
        """``update``, after an optimizer step's backward (also a kill point): ``nan`` is a NaN in the first gradient."""
        if fault("update", iteration) == "nan":
            next(p.grad for p in trainable if p.grad is not None).view(-1)[0] = float("nan")


TRAINER_FAULTS = TrainerFaults()
