"""Resuming a run: after a SIGKILL anywhere in an iteration (bit for bit), with other params (never silently: --restart),
once it is trained (no worker launched), and never on a damaged curve."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, WORKER_ARGS, run_module
from fault_helpers import _ckpts, _one_sentence, ci
from jagg_core.setup.paths import Layout
from jagg_core.trainer import CheckpointError, list_checkpoints, train
from jagg_core.trainer.checkpoint import load_tensors


# Where in an iteration a SIGKILL lands, chosen rather than drawn: an iteration of this run is rollout, reward,
# the fidelity monitor (most of its time: fidelity_every 1), the update, logging and the checkpoint. Four points, one
# in each phase that holds state a resume must rebuild — mid-rollout, mid-monitor, mid-update (aimed by the
# reference run's own time/… columns for that iteration, scaled to this run's pace) and mid-checkpoint-write (as soon
# as its temporary folder appears) — cover what the ten random seeds did (most of which landed in the monitor, the
# longest phase) at 40% of their cost; tests/test_trainer.py kills at three injected fault points besides.
KILL_POINTS = {"rollout": ["time/rollout"], "fidelity": ["time/rollout", "time/reward", "time/fidelity"],
               "update": ["time/rollout", "time/reward", "time/fidelity", "time/update"], "checkpoint": None}


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(KILL_POINTS))
def test_random_kills_resume_identically(ci_project, uninterrupted, phase):
    """SIGKILL from outside in iteration 3 of the training loop, aimed at the middle of ``phase`` (on a machine whose
    load changes mid-run the aim is approximate, except for the checkpoint's, which waits for its temporary folder);
    the kill must land (the process still running); a restart finishes the run, equal bit for bit to an
    uninterrupted one."""
    import csv
    import signal
    import time

    args = [*WORKER_ARGS, "--method", "ablate"]
    reference = uninterrupted("ablate")
    ref_curve = uninterrupted.roots["ablate"] / "runs/ci/ablate-s0/curve.tsv"
    ref_rows = list(csv.DictReader(ref_curve.open(), delimiter="\t"))
    env = dict(os.environ, JAGG_ROOT=str(ci_project), PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "tasks.train", *args], cwd=ci_project, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = _ckpts(ci_project, "ablate-s0")
    while not (ckpts / "checkpoint-000002" / "manifest.json").exists():  # iteration 3 starts
        assert proc.poll() is None, "the run ended before its second checkpoint"
        time.sleep(0.01)
    if KILL_POINTS[phase] is None:  # while checkpoint 3 is being written
        while not list(ckpts.glob(".tmp-checkpoint-000003-*")):
            assert proc.poll() is None, "the run ended before writing checkpoint 3"
            time.sleep(0.002)
        at = 0.0
    else:  # the middle of the phase, by the reference run's timing of iteration 3, scaled to this run's own pace
        ref = _ckpts(uninterrupted.roots["ablate"], "ablate-s0")

        def iteration_2(folder):
            return ((folder / "checkpoint-000002/manifest.json").stat().st_mtime
                    - (folder / "checkpoint-000001/manifest.json").stat().st_mtime)

        pace = iteration_2(ckpts) / iteration_2(ref)
        *before, during = (float(ref_rows[2][k]) for k in KILL_POINTS[phase])
        at = pace * (sum(before) + during / 2)
    with pytest.raises(subprocess.TimeoutExpired):  # the kill lands: the run is still going at that moment
        proc.wait(timeout=at or 1e-6)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    done = [c.iteration for c in list_checkpoints(ckpts)]
    assert done[-1] < 4, "the run finished before the kill: the test proves nothing"
    assert run_module("tasks.train", *args, root=ci_project).returncode == 0
    b = load_tensors(ckpts / "checkpoint-000004/trainable.safetensors")
    assert all(torch.equal(reference[k], b[k]) for k in reference), f"differs after a kill in {phase}"
    print(f"{phase}: killed {at:.2f} s into iteration 3 (checkpoints {done}); resumed, identical")


def test_changed_params_stop_unless_restart_and_more_iterations_continue(ci_project):
    params = ci(ci_project, **{"train.iterations": 1})
    train(params, "jagg", 0, root=ci_project, progress=False)
    more = train(ci(ci_project, **{"train.iterations": 2}), "jagg", 0, root=ci_project, progress=False)
    assert [h["iteration"] for h in more.history] == [2]  # continued
    smaller = train(ci(ci_project, **{"train.iterations": 3, "train.micro_batch": 4}), "jagg", 0, root=ci_project,
                    progress=False)
    assert [h["iteration"] for h in smaller.history] == [3]  # a smaller micro-batch (after an OOM) continues too
    changed = ci(ci_project, **{"train.iterations": 2, "train.lr": 1e-3})
    with pytest.raises(CheckpointError, match=r"other params \(train.lr .* → 0.001\); pass --restart"):
        train(changed, "jagg", 0, root=ci_project, progress=False)  # never a silent start-over
    other = train(changed, "jagg", 0, root=ci_project, progress=False, restart=True)
    assert [h["iteration"] for h in other.history] == [1, 2]  # started over, explicitly
    aside = [p.name for p in (ci_project / "checkpoints/ci").iterdir() if ".superseded-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("jagg-s0.superseded-")


def test_a_trained_run_started_again_launches_no_worker_unless_its_last_checkpoint_is_damaged(ci_project,
                                                                                              monkeypatch):
    """`jagg train` (and `dvc repro` after `jagg run`, which runs every train stage once) on a run whose last
    checkpoint is complete, verified and of these params: no `accelerate launch` to find that out; its MLflow run
    ends FINISHED with the checkpoint's tags. A damaged last checkpoint is not "trained": the worker is launched (and
    resumes from the one before it, tests above)."""
    from mlflow.tracking import MlflowClient

    import tasks.train as stage

    params = ci(ci_project, **{"train.iterations": 2, "tracking.mlflow_uri": f"sqlite:///{ci_project}/m.db"})
    train(params, "jagg", 0, root=ci_project, progress=False)  # in this process: the run's two checkpoints
    launched = []
    monkeypatch.setattr(stage, "_launch_workers", lambda *a, **k: launched.append(a[1:4]))
    lay = Layout(ci_project, "ci")
    out = stage.train_run(params, lay, "jagg", 0)
    assert launched == []
    run = MlflowClient(f"sqlite:///{ci_project}/m.db").get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["jagg.checkpoint_iteration"] == "2"
    newest = list_checkpoints(_ckpts(ci_project))[-1].path
    weights = next(f for f in sorted(newest.iterdir()) if f.suffix == ".safetensors")
    weights.write_bytes(weights.read_bytes()[:-8])  # a truncated file: the manifest's digest no longer holds
    stage.train_run(params, lay, "jagg", 0)
    assert launched == [(lay, "jagg", 0)], launched


@pytest.mark.parametrize("damage, says", [
    ("truncate", "lacks iteration(s) 3, 4"),
    ("delete", "does not exist"),
    ("twice", "twice"),
])
def test_a_damaged_curve_refuses_resume_with_one_sentence(damage, says, tmp_path):
    from jagg_core.trainer.curve import TsvCurve
    from jagg_core.trainer.errors import TrainingError

    curve = tmp_path / "curve.tsv"
    rows = "".join(f"{i}\t0.{i}\n" for i in range(1, 5))
    curve.write_text("iteration\treward/mean\n" + {"truncate": "1\t0.1\n2\t0.2\n", "delete": "",
                                                    "twice": rows + "2\t0.2\n"}[damage] if damage != "twice" else
                     "iteration\treward/mean\n1\t0.1\n2\t0.2\n2\t0.2\n3\t0.3\n4\t0.4\n")
    if damage == "delete":
        curve.unlink()
    with pytest.raises(TrainingError) as e:
        TsvCurve(curve, resume_from=4)
    text = _one_sentence(e.value)
    assert says in text and "--restart" in text
    curve.write_text("iteration\treward/mean\n" + rows + "5\t0.5\n")  # rows after the checkpoint: dropped, as before
    assert [r["iteration"] for r in TsvCurve(curve, resume_from=4).rows] == [1, 2, 3, 4]
    assert TsvCurve(tmp_path / "new.tsv", resume_from=0).rows == []  # a fresh run needs none
