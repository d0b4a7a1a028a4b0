"""A checkpoint rotated out under a reader (`jagg evaluate` while training goes on), and resuming with fewer
iterations than the checkpoint holds."""

from __future__ import annotations

import logging

import pytest
import torch

from jagg_core.trainer import CheckpointError, latest_checkpoint, list_checkpoints
from jagg_core.trainer import checkpoint as ckpt_module
from jagg_core.trainer.checkpoint import save_checkpoint


def _save(root, iteration):
    return save_checkpoint(root, iteration, trainable={"w": torch.full((4,), float(iteration))}, optimizer=None,
                           state={}, keep=2)


def test_a_checkpoint_rotated_out_under_a_reader_is_not_damaged_and_not_an_errno(tmp_path, monkeypatch, caplog):
    """The training run writes checkpoint 3 (keeping 2) while a reader verifies checkpoint 1, and again while the
    reader is about to load the tensors of one it listed: the first is skipped without a "damaged" warning (it was
    rotated out), the newest complete one is chosen; the second is one sentence naming the rotation, not
    "[Errno 2] No such file or directory"."""
    for i in (1, 2):
        _save(tmp_path, i)
    real = ckpt_module.file_sha256
    rotated = []

    def training_goes_on(path):  # checkpoint 3 is written while the reader hashes checkpoint 1's files
        if "checkpoint-000001" in str(path) and not rotated:
            rotated.append(_save(tmp_path, 3))
        return real(path)

    monkeypatch.setattr(ckpt_module, "file_sha256", training_goes_on)
    with caplog.at_level(logging.WARNING):
        found = list_checkpoints(tmp_path)
    assert rotated and [c.iteration for c in found] == [2]  # listed before 3 was written
    assert not [r for r in caplog.records if "damaged" in r.getMessage()], caplog.text
    monkeypatch.setattr(ckpt_module, "file_sha256", real)

    listed = list_checkpoints(tmp_path)  # what `jagg evaluate` evaluates, one after the other
    _save(tmp_path, 4)  # meanwhile: checkpoint 2 is rotated out
    with pytest.raises(CheckpointError, match=r"checkpoint 2 .* was deleted while it was read: its training run "
                                              r"rotated it out") as e:
        listed[0].tensors()
    assert "Errno" not in str(e.value) and "\n" not in str(e.value)
    assert latest_checkpoint(tmp_path).iteration == 4
    assert not list(tmp_path.glob(".tmp-*"))  # the rotated-out copy is gone too


def test_resuming_with_fewer_iterations_names_the_checkpoints_real_step(ci_project, caplog):
    """A run whose checkpoint is at iteration 2 started with train.iterations = 1: nothing to do, and the message
    says 2 (it said "already trained for 1 iterations", the param, not the checkpoint)."""
    from jagg_core.setup.params_io import load_params
    from jagg_core.trainer import train

    def params(n):
        return load_params(ci_project / "params.yaml", "ci", {"reward.weights": {"toy_background": 1.0},
                                                              "train.iterations": n})

    train(params(2), "jagg", 0, root=ci_project, progress=False)
    with caplog.at_level(logging.INFO, logger="jagg_core"):
        result = train(params(1), "jagg", 0, root=ci_project, progress=False)
    assert result.history == []
    (line,) = [r.getMessage() for r in caplog.records if "already trained" in r.getMessage()]
    assert "already trained for 2 iterations" in line and "train.iterations is 1" in line, line
