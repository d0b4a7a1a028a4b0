"""One writer per run: a second trainer of the same run stops with one sentence; a dead holder's lock is free."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from jagg_core.setup.storage import FolderLock, LockedError


def _holder(folder) -> subprocess.Popen:
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from jagg_core.setup.storage import FolderLock; "
            f"FolderLock({str(folder)!r}, 'x').acquire(); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_told_who_holds_the_lock_and_a_dead_holders_lock_is_taken_over(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(LockedError, match=rf"run r is already being written by pid {proc.pid} on "):
            FolderLock(tmp_path, "run r").acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with FolderLock(tmp_path, "run r"):  # the kernel released the dead process's lock; the stale file is reused
        assert f"pid {os.getpid()}" in (tmp_path / ".lock").read_text()


def test_training_a_run_that_another_process_trains_stops_before_any_work(ci_project):
    from jagg_core.setup.params_io import load_params
    from jagg_core.trainer import train

    params = load_params(ci_project / "params.yaml", "ci", {"tracking.mlflow_uri": "sqlite:///m.db"})
    proc = _holder(ci_project / "runs" / "ci" / "jagg-s0")
    try:
        start = time.time()
        with pytest.raises(LockedError, match="training run jagg-s0 is already being written"):
            train(params, "jagg", 0, root=ci_project, progress=False)
        assert not (ci_project / "checkpoints" / "ci" / "jagg-s0").exists()
        assert not (ci_project / "runs" / "ci" / "jagg-s0" / "curve.tsv").exists()
        assert time.time() - start < 120
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
