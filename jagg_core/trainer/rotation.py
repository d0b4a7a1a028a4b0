"""Checkpoint rotation that a concurrent reader survives (`jagg evaluate` while the run trains on).

A training run keeps its newest ``train.keep_checkpoints`` checkpoints. The old ones are renamed away in one step
before they are deleted (to ``.tmp-rotated-…``, which the next resume tidies like any interrupted write), so a reader
sees a checkpoint whole or not at all: one that vanishes while it is verified was rotated out, not damaged, and one
that vanishes while its tensors are read is one sentence, never a raw Errno.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

__all__ = ["ROTATED", "check_checkpoint", "rotate", "rotated_out"]

ROTATED = "rotated out"  # check_checkpoint's answer for a checkpoint deleted meanwhile (by identity: `is ROTATED`)


def rotate(root: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints under ``root``, each renamed away first."""
    from .checkpoint import list_checkpoints

    for old in list_checkpoints(root, check=False)[:-keep]:
        gone = old.path.with_name(f".tmp-rotated-{old.path.name}-{os.getpid()}")
        try:
            os.replace(old.path, gone)
        except OSError:  # deleted by someone else already
            continue
        shutil.rmtree(gone, ignore_errors=True)


def check_checkpoint(path: Path, part: tuple[int, int] = (0, 1)) -> str | None:
    """:func:`~jagg_core.trainer.checkpoint.verify_checkpoint`, except that a checkpoint that is gone by the end
    (rotated out by its training run while this process read it) is :data:`ROTATED`, not a problem to warn about,
    and a file unreadable for another reason is a problem, not an exception; ``part`` as for ``verify_checkpoint``."""
    from .checkpoint import verify_checkpoint

    try:
        problem = verify_checkpoint(path, part)
    except OSError as e:
        problem = f"unreadable ({e.strerror or e})"
    if problem and not path.exists():
        return ROTATED
    return problem


def rotated_out(ckpt: "Checkpoint") -> str:
    return (f"checkpoint {ckpt.iteration} ({ckpt.path}) was deleted while it was read: its training run rotated it "
            f"out (it keeps the newest train.keep_checkpoints); run this again to use the newest ones, or once the "
            f"run has finished.")
