"""Reliability, round 6 (issue 47), mechanisms 5–7: ownership that can expire, every entry point refuses bad input in
one sentence, small things a user sees.

Each test is named after its mechanism (``test_m5_…``, ``test_m6_…``, ``test_m7_…``) and failed on the code before its
fix; the rows of docs/reliability.md's "Round 6" section name them. Cheap probes call the library in-process or start
one short command on the ci profile.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_module
from jagg_core.setup.config import ParamsError
from jagg_core.setup.params_io import load_params

PARAMS = REPO / "params.yaml"


def _one_sentence(text: str) -> str:
    text = text.strip()
    assert "\n" not in text and "Traceback" not in text and len(text) < 600, text
    return text


# --- mechanism 6: every entry point refuses bad input in one sentence ------------------------------------------------


def test_m6_a_key_path_1200_deep_is_one_sentence(tmp_path):
    """`--set a.a.…(1200 parts)=1` was a RecursionError traceback (validation recursed through the nested tree)."""
    deep = ".".join(["a"] * 1200)
    with pytest.raises(ParamsError, match="1,200 levels deep"):
        load_params(PARAMS, "ci", {deep: 1})
    out = run_module("tasks.plan", "--profile", "ci", "--params", str(PARAMS), "--set", f"{deep}=1", root=tmp_path)
    assert out.returncode == 1 and _one_sentence(out.stderr).startswith("jagg: error: override a.a."), out.stderr


# --- mechanism 7: small things a user sees ----------------------------------------------------------------------------


def _umask() -> int:
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_m7_checkpoint_folders_have_the_permissions_of_their_files(tmp_path):
    """A checkpoint's folder was 0700 (``mkdtemp``'s) while its files were 0644: another user allowed to read the files
    could not open the folder. Now a folder gets what any folder the process makes gets (0755 under umask 022)."""
    import stat

    import torch

    from jagg_core.trainer.checkpoint import save_checkpoint

    ckpt = save_checkpoint(tmp_path / "ckpts", 1, trainable={"w": torch.zeros(2)}, optimizer=None,
                           state={"run_key": "k"})
    mask = _umask()
    assert stat.S_IMODE(ckpt.path.stat().st_mode) == 0o777 & ~mask
    assert {stat.S_IMODE(f.stat().st_mode) for f in ckpt.path.iterdir()} == {0o666 & ~mask}


def test_m7_the_base_model_folder_has_the_permissions_of_its_files(ci_base):
    """`jagg pretrain`'s models/<profile>/base was 0700 with 0644 files inside (as a checkpoint's)."""
    import stat

    base = ci_base / "models" / "ci" / "base"
    mask = _umask()
    assert stat.S_IMODE(base.stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((base / "card.json").stat().st_mode) == 0o666 & ~mask


def _tracker(root: Path):
    """A real MLflow store (SQLite) under ``root`` and the ci profile's params and layout."""
    from jagg_core.pipeline.tracking import Tracker
    from jagg_core.setup.paths import Layout

    params = load_params(PARAMS, "ci")
    return Tracker(params, root), params, Layout.of(params, root)


def test_m7_a_damaged_pending_buffer_line_is_reported_once(tmp_path, caplog):
    """The launcher's replay of a run's pending buffer read it twice (how many records wait, then sending them) and
    printed "line 2 is not a whole record" twice for one cut line."""
    import logging

    from tasks.train import _replay_pending, pending_file

    tracker, _, lay = _tracker(tmp_path)
    run_id = tracker.child_run("default", "jagg-s0", method="jagg", seed=0, key="k")
    buffer = pending_file(lay, "jagg-s0")
    buffer.parent.mkdir(parents=True, exist_ok=True)
    record = {"kind": "metrics", "run_id": run_id, "step": 1, "time": 1, "metrics": {"reward/mean": 0.5}}
    buffer.write_text(json.dumps(record) + "\n" + json.dumps(record)[:20] + "\n")
    with caplog.at_level(logging.WARNING):
        _replay_pending(tracker, run_id, lay, "jagg-s0", logging.getLogger("jagg.train"))
    said = [r.getMessage() for r in caplog.records if "not a whole record" in r.getMessage()]
    assert len(said) == 1, said
    assert not buffer.exists()
    assert [m.value for m in tracker.client.get_metric_history(run_id, "reward/mean")] == [0.5]
    tracker.finish(run_id)


_ACCELERATE = """
import os, signal, subprocess, sys
# as accelerate's simple_launcher: its one worker (here, one that is SIGKILLed) run with check, the error re-raised
cmd = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "--worker-context",
       "/tmp/x/runs/ci/jagg-s0/.worker-context-1.json"]
process = subprocess.Popen(cmd)
process.wait()
raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)
"""


def test_m7_a_sigkilled_worker_is_one_plain_sentence():
    """A SIGKILLed worker's failure relayed accelerate's last line, "subprocess.CalledProcessError: Command '[…the
    worker's whole command…]' died with <Signals.SIGKILL: 9>.". Now the sentence says which signal, what it usually
    means and what a rerun does; it is still a death (retried), and the command line is not in it."""
    from collections import deque

    from tasks.train import WorkerDied, _failure

    out = subprocess.run([sys.executable, "-c", _ACCELERATE], capture_output=True, text=True, timeout=60)
    tail = deque(out.stderr.splitlines(), maxlen=30)
    assert out.returncode == 1 and "CalledProcessError" in tail[-1], out.stderr  # what accelerate leaves
    failure = _failure("jagg-s0", out.returncode, tail)
    assert isinstance(failure, WorkerDied)
    text = _one_sentence(str(failure))
    assert "SIGKILL" in text and "out of memory" in text and "resumes from its last complete checkpoint" in text, text
    assert "CalledProcessError" not in text and "worker-context" not in text and "Command" not in text, text
    # torchrun's report of several processes, and a worker that exited with a status of its own
    elastic = deque(["  exitcode  : -9 (pid: 4242)", "  error_file: <N/A>",
                     "  traceback : Signal 9 (SIGKILL) received by PID 4242", "=" * 60])
    assert "killed by SIGKILL" in str(_failure("jagg-s0", 1, elastic))
    exited = deque(["subprocess.CalledProcessError: Command '['python', '-m', 'tasks.train']' returned non-zero exit "
                    "status 3."])
    assert "exited with status 3" in str(_failure("jagg-s0", 1, exited))


def test_m7_a_sweep_without_the_baseline_says_why_there_is_no_speedup(tmp_path):
    """`jagg run` of methods without the exact baseline ended with "update speedup vs the exact baseline, every method
    timed side by side: " and nothing after it. Now it says there is no baseline and gives the seconds it has."""
    from flows.run import _speed_line
    from jagg_core.bench.side_by_side import speed_rows
    from jagg_core.setup.paths import Layout

    lay = Layout.of(load_params(PARAMS, "ci"), tmp_path)
    counts = {"grad_forwards": 2, "nograd_forwards": 2, "reused_velocities": 0}
    timed = {"update": {"median": 0.25, "q1": 0.2, "q3": 0.3}, "counts": counts}
    result = {"methods": {"jagg": {**timed, "mode": "jagg"}, "ablate": {**timed, "mode": "ablate"}}}
    lay.speed.parent.mkdir(parents=True, exist_ok=True)
    lay.speed.write_text(json.dumps({"table": speed_rows(result)}))
    line = _one_sentence(_speed_line(lay))
    assert "no exact baseline" in line and "jagg 0.250 s" in line and not line.endswith(": "), line
    result["methods"]["baseline"] = {**timed, "mode": "exact"}
    lay.speed.write_text(json.dumps({"table": speed_rows(result)}))
    assert "jagg 1.00x" in _speed_line(lay)  # with it, the speedups as before
