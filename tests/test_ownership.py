"""Who ends an MLflow run, and in what state: every run a command opens ends whatever ends the command (KILLED on a
signal, FAILED on an error); a stage ends only the runs it owns (a tag naming its process); a run whose owner is gone,
or cannot be checked and has missed its heartbeats, is taken over with one warning."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from fault_helpers import PARAMS, _one_sentence, _tracker
from jagg_core.setup.params_io import load_params


# --- every run a command opens is ended ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its tables and no experiment of ours, made once per module (making one runs
    MLflow's migrations: 5 to 20 s on a busy machine); a test copies it (under a second)."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("empty-store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


def _sqlite_tracker(tmp_path, empty_store: Path):
    """A Tracker of the ci profile on a fresh copy of ``empty_store`` at ``tmp_path/mlflow.db``."""
    import shutil

    from jagg_core.pipeline.tracking import Tracker

    shutil.copy(empty_store, tmp_path / "mlflow.db")
    params = load_params(PARAMS, "ci", {"tracking.mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db"})
    return Tracker(params, tmp_path)


def _statuses(tracker) -> dict[str, str]:
    runs = tracker.client.search_runs([tracker.experiment_id])
    return {r.data.tags.get("jagg.run", r.data.tags.get("jagg.kind")): r.info.status for r in runs}


def test_every_mlflow_run_a_command_opens_ends_whatever_ends_it(tmp_path, monkeypatch, empty_store):
    from jagg_core.pipeline.tracking import Tracker

    from tasks.launch import Interrupted

    tracker = _sqlite_tracker(tmp_path, empty_store)
    for run, exc, status in (("a", Interrupted(15), "KILLED"), ("b", KeyboardInterrupt(), "KILLED"),
                             ("c", RuntimeError("x"), "FAILED")):
        run_id = tracker.child_run("s", run, method=None, seed=None, key=run)
        with pytest.raises(type(exc)):
            with tracker.ending(run_id):
                raise exc
        assert _statuses(tracker)[run] == status
    # a signal while the new run's params are logged, before its id reaches the caller
    monkeypatch.setattr(Tracker, "log_params", lambda self, run_id, tree: (_ for _ in ()).throw(Interrupted(15)))
    with pytest.raises(Interrupted):
        tracker.child_run("s", "d", method=None, seed=None, key="d")
    monkeypatch.undo()
    statuses = _statuses(tracker)
    assert statuses["d"] == "KILLED" and statuses["sweep"] == "FINISHED"  # a sweep's run is never left RUNNING
    # a training run evaluated afterwards keeps its own status when the evaluation fails
    run_id = tracker.child_run("s", "e", method=None, seed=None, key="e")
    tracker.finish(run_id)
    with pytest.raises(ValueError):
        with tracker.ending(run_id, only_running=True):
            raise ValueError("x")
    assert _statuses(tracker)["e"] == "FINISHED"


def test_evaluate_ends_its_run_failed_on_any_error(ci_project, monkeypatch):
    import jagg_core.evaluation.evaluate as ev

    from jagg_core.pipeline.tracking import Tracker
    from tasks.common import layout
    from tasks.evaluate import evaluate

    params = load_params(ci_project / "params.yaml", "ci")
    monkeypatch.setattr(ev, "evaluate_run", lambda *a, **k: (_ for _ in ()).throw(TypeError("after generation")))
    with pytest.raises(TypeError):
        evaluate(params, layout(params, ci_project), "base")
    assert _statuses(Tracker(params, ci_project))["base"] == "FAILED"


@pytest.mark.slow
def test_sigterm_right_after_jagg_train_creates_its_run_marks_it_killed(ci_project):
    """The regression of item 10: a real SIGTERM in the half second after the run is created (a fault point there)."""
    from conftest import run_module

    from jagg_core.pipeline.tracking import Tracker

    env = {"JAGG_FAULT": "run_created:term"}
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--seed", "0", root=ci_project, env=env,
                     timeout=300)
    assert out.returncode == 143, out.stderr[-2000:]
    params = load_params(ci_project / "params.yaml", "ci")
    assert _statuses(Tracker(params, ci_project))["jagg-s0"] == "KILLED"


# --- a stage ends only the runs it owns; an owner gone is reaped ---------------------------------------------------


_HOLDER = """
import sys, time
from pathlib import Path
from jagg_core.setup.params_io import load_params
from jagg_core.setup.paths import Layout
from jagg_core.pipeline.tracking import Tracker
from jagg_core.trainer.fingerprint import run_fingerprint
root = Path(sys.argv[1])
params = load_params(root / "params.yaml", "ci")
lay = Layout.of(params, root)
tracker = Tracker(params, root)
key = run_fingerprint(params, lay, "jagg", 0)
print(tracker.child_run(sys.argv[2], "jagg-s0", method="jagg", seed=0, key=key), flush=True)
time.sleep(600)
"""


def _holder(root: Path, sweep: str = "default") -> tuple[subprocess.Popen, str]:
    """Another process that created the MLflow run of jagg-s0 and holds it RUNNING (as a training launcher does)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root), sweep], cwd=root, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO), "JAGG_ROOT": str(root)})
    run_id = proc.stdout.readline().strip()
    assert run_id, "the holder made no run"
    return proc, run_id


def test_c7_a_stage_ends_only_runs_it_owns_and_reaps_runs_whose_owner_is_gone(ci_project):
    """`jagg evaluate --run jagg-s0` while `jagg train` trains it marked the *training* run FINISHED (or FAILED on an
    error); a second `jagg train` refused by the lock marked the shared run FAILED while the first trained; a
    SIGKILLed `jagg run` left its run RUNNING for ever, even after a complete rerun. Now a stage ends only runs it
    owns (a tag naming its process), a second trainer is refused before it touches the run, and a RUNNING run whose
    owner process is gone is marked KILLED by the next stage that touches a run of that name."""
    import signal

    from jagg_core.pipeline.tracking import Tracker
    from jagg_core.setup.paths import Layout
    from jagg_core.setup.storage import LockedError
    from tasks.evaluate import evaluate
    from tasks.train import train_run

    params = load_params(ci_project / "params.yaml", "ci")
    lay = Layout.of(params, ci_project)
    proc, run_id = _holder(ci_project)
    try:
        tracker = Tracker(params, ci_project)
        status = lambda: tracker.client.get_run(run_id).info.status  # noqa: E731
        tracker.finish(run_id)  # what evaluate did at its end
        with pytest.raises(ValueError):
            with tracker.ending(run_id):  # what any stage's error did
                raise ValueError("an error of this stage")
        assert status() == "RUNNING"
        with pytest.raises(LockedError, match=r"training run jagg-s0 is being trained by process .*:%d" % proc.pid):
            train_run(params, lay, "jagg", 0)  # a second trainer: refused, the run untouched
        assert status() == "RUNNING"
        with pytest.raises(Exception):  # nothing to evaluate yet (no checkpoint): an error of evaluate's own
            evaluate(params, lay, "jagg-s0")
        assert status() == "RUNNING"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert status() == "RUNNING"  # left by a killed process, until a stage touches a run of its name
    other = tracker.child_run("a-later-sweep", "jagg-s0", method="jagg", seed=0, key="another")
    assert status() == "KILLED"
    assert tracker.client.get_run(other).info.status == "RUNNING" and tracker.claim(other)
    tracker.finish(other)
    assert tracker.client.get_run(other).info.status == "FINISHED"


_SWEEPER = """
import sys, time
from pathlib import Path
from jagg_core.setup.params_io import load_params
from jagg_core.pipeline.tracking import Tracker
root = Path(sys.argv[1])
with Tracker(load_params(root / "params.yaml", "ci"), root).sweeping(sys.argv[2]) as run_id:
    print(run_id, flush=True)
    if sys.argv[3] == "hold":
        time.sleep(600)
"""


@pytest.mark.parametrize("end", ["completes", "SIGKILL"])
def test_a_sigkilled_sweeps_run_is_ended_killed_at_once_by_its_watcher(tmp_path, end):
    """A sweep's MLflow run (:meth:`Tracker.sweeping`, what `jagg run` and a deployment's flow run hold) whose process
    is SIGKILLed stayed RUNNING until the next sweep or stage opened the store (issue 71, item 7). Now its watcher
    process (jagg_core/pipeline/sweep_watch.py) marks it KILLED within seconds, tagged ``jagg.reaped_by``; a sweep
    that completes ends its run FINISHED itself and leaves no watcher behind."""
    import signal
    import time

    import psutil
    from mlflow.tracking import MlflowClient

    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAGG_ROOT": str(root)}
    proc = subprocess.Popen([sys.executable, "-c", _SWEEPER, str(root), "s1", "hold" if end == "SIGKILL" else "end"],
                            cwd=root, stdout=subprocess.PIPE, text=True, env=env)
    run_id = proc.stdout.readline().strip()
    assert run_id, "the sweep made no run"
    if end == "SIGKILL":
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == (-signal.SIGKILL if end == "SIGKILL" else 0)
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    deadline = time.monotonic() + 30
    while client.get_run(run_id).info.status == "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.2)
    run = client.get_run(run_id)
    assert run.info.status == ("KILLED" if end == "SIGKILL" else "FINISHED"), run.info.status
    assert run.data.tags.get("jagg.reaped_by", "").startswith("the watcher of ") == (end == "SIGKILL"), run.data.tags
    def watchers() -> list:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if "jagg_core.pipeline.sweep_watch" in (p.info["cmdline"] or []) and \
                        p.environ().get("JAGG_ROOT") == str(root):
                    found.append(p.info["cmdline"])
        return found

    for _ in range(100):  # the watcher exits once it has ended the run (or been told the sweep ended it)
        if not watchers():
            break
        time.sleep(0.1)
    assert not watchers()


# --- ownership that can expire: an owner this machine cannot check, its heartbeat ----------------------------------


ANOTHER_HOST = "a-container-that-restarted:4242:1700000000.00"


def _held_run(root: Path, owner: str, heartbeat_age: float | None = None):
    """jagg-s0's MLflow run in the real store under ``root``, RUNNING, its owner tag ``owner`` (and, given
    ``heartbeat_age``, a heartbeat that many seconds old); returns (tracker, params, layout, run id)."""
    import time

    from jagg_core.pipeline.tracking import OWNER_TAG
    from jagg_core.trainer.fingerprint import run_fingerprint

    tracker, params, lay = _tracker(root)
    run_id = tracker.child_run("default", "jagg-s0", method="jagg", seed=0,
                               key=run_fingerprint(params, lay, "jagg", 0))
    tags = {OWNER_TAG: owner}
    if heartbeat_age is not None:
        tags["jagg.heartbeat"] = f"{time.time() - heartbeat_age:.0f}"
    tracker.set_tags(run_id, tags)
    return tracker, params, lay, run_id


@pytest.mark.parametrize("owner", ["garbage", ANOTHER_HOST])
def test_m5_restart_takes_over_a_run_whose_owner_cannot_be_checked(ci_project, monkeypatch, caplog, owner):
    """A RUNNING run whose owner tag this machine cannot check (garbage, or another host's, as after a container
    restart) refused `jagg train` for good, `--restart` included ("is being trained by process garbage"). Now the
    refusal says how to get out, and `--restart` takes the run over with one warning naming the old owner."""
    import logging

    from jagg_core.pipeline.tracking import OWNER_TAG, owner_id
    from jagg_core.setup.storage import LockedError
    from tasks.train import train_run

    tracker, params, lay, run_id = _held_run(ci_project, owner)
    with pytest.raises(LockedError) as refused:
        train_run(params, lay, "jagg", 0)
    said = _one_sentence(str(refused.value))
    assert "cannot check" in said and "--restart" in said, said
    assert "'garbage'" in said or "a-container-that-restarted:4242 " in said, said
    assert tracker.client.get_run(run_id).info.status == "RUNNING"
    monkeypatch.setenv("JAGG_FAULT", "run_created@0:oserror")  # stop right after the claim: no worker starts
    with caplog.at_level(logging.WARNING), pytest.raises(OSError, match="injected"):
        train_run(params, lay, "jagg", 0, restart=True)
    taken = [r.getMessage() for r in caplog.records if "takes it over" in r.getMessage()]
    assert len(taken) == 1 and run_id in taken[0] and owner.split(":")[0] in taken[0], taken
    run = tracker.client.get_run(run_id)
    assert run.data.tags[OWNER_TAG] == owner_id() and run.info.status == "FAILED"  # ours, ended by the injected error


def test_m5_a_crashed_units_run_is_taken_over_after_two_missed_heartbeats_not_at_once(ci_project, monkeypatch, caplog):
    """A pool-dispatched training submitted again after Prefect saw its flow run crash (`take_over`) took the MLflow
    run over at once, even from an owner on a host cut off from Prefect but not from MLflow, still training. Now it
    waits until the owner has missed two heartbeats: a beat meanwhile keeps the run its owner's (refused, one
    sentence); none, and it takes the run over with one warning."""
    import logging
    import time
    from types import SimpleNamespace

    import jagg_core.pipeline.tracking as tracking
    from jagg_core.pipeline.tracking import CRASHED_OWNER_STALE_SECONDS, OWNER_TAG, owner_id
    from jagg_core.setup.storage import LockedError
    from tasks.train import train_run

    tracker, params, lay, run_id = _held_run(ci_project, ANOTHER_HOST, heartbeat_age=30)
    clock = SimpleNamespace(now=time.time(), slept=[], beat=None)

    def sleep(seconds: float) -> None:
        clock.now += seconds
        clock.slept.append(seconds)
        if clock.beat is not None and len(clock.slept) == clock.beat:  # the owner beats while the unit waits
            tracker.set_tags(run_id, {"jagg.heartbeat": f"{clock.now:.0f}"})

    monkeypatch.setattr(tracking, "time", SimpleNamespace(time=lambda: clock.now, sleep=sleep))
    clock.beat = 2
    with pytest.raises(LockedError, match="a-container-that-restarted:4242"):
        train_run(params, lay, "jagg", 0, take_over=True)
    assert len(clock.slept) == 2 and tracker.client.get_run(run_id).data.tags[OWNER_TAG] == ANOTHER_HOST
    clock.beat, clock.slept = None, []
    started = clock.now
    monkeypatch.setenv("JAGG_FAULT", "run_created@0:oserror")  # stop right after the claim: no worker starts
    with caplog.at_level(logging.WARNING), pytest.raises(OSError, match="injected"):
        train_run(params, lay, "jagg", 0, take_over=True)
    last_beat = float(tracker.client.get_run(run_id).data.tags["jagg.heartbeat"])
    assert clock.now - started >= CRASHED_OWNER_STALE_SECONDS - 30 and len(clock.slept) >= 2  # it waited, then took it
    said = [r.getMessage() for r in caplog.records if "a-container-that-restarted:4242" in r.getMessage()]
    assert len(said) == 1 and "whose flow run crashed" in said[0] and "taking it over" in said[0], said
    run = tracker.client.get_run(run_id)
    assert run.data.tags[OWNER_TAG] == owner_id() and run.info.status == "FAILED" and last_beat >= started


def test_m5_an_owner_without_a_heartbeat_for_the_bound_is_stale(ci_project, monkeypatch, caplog):
    """Another host's owner that has not renewed its heartbeat for longer than OWNER_STALE_SECONDS (10 min; here an
    hour) is gone: `jagg train` (without --restart) marks its run KILLED and takes the run over, with one warning
    naming the old owner; one whose heartbeat is a minute old is still refused. The owner renews its heartbeat while
    it trains (Tracker.heartbeat)."""
    import logging
    import time

    from jagg_core.pipeline.tracking import OWNER_TAG, owner_id
    from jagg_core.setup.storage import LockedError
    from tasks.train import train_run

    tracker, params, lay, run_id = _held_run(ci_project, ANOTHER_HOST, heartbeat_age=60)  # a minute ago: alive
    with pytest.raises(LockedError, match="a-container-that-restarted:4242"):
        train_run(params, lay, "jagg", 0)
    tracker.set_tags(run_id, {"jagg.heartbeat": f"{time.time() - 3600:.0f}"})  # an hour ago: gone
    monkeypatch.setenv("JAGG_FAULT", "run_created@0:oserror")
    with caplog.at_level(logging.WARNING), pytest.raises(OSError, match="injected"):
        train_run(params, lay, "jagg", 0)
    said = [r.getMessage() for r in caplog.records if "a-container-that-restarted:4242" in r.getMessage()]
    assert len(said) == 1 and "no sign of life for 60 min" in said[0], said
    run = tracker.client.get_run(run_id)
    assert run.data.tags[OWNER_TAG] == owner_id() and run.info.status == "FAILED"
    # a live owner's heartbeat: renewed while its block runs
    tracker.set_tags(run_id, {"jagg.heartbeat": "0"})
    with tracker.heartbeat(run_id, every=0.1):
        time.sleep(1.0)
    assert time.time() - float(tracker.client.get_run(run_id).data.tags["jagg.heartbeat"]) < 5


# --- records stay whole after a fault (issue 61, mechanism 5) ------------------------------------------------------


def _dead_owner() -> str:
    """An owner tag naming a process that is gone (this host, this pid, another start time)."""
    import socket

    return f"{socket.gethostname()}:{os.getpid()}:1.00"


def _runs_named(tracker, run: str) -> list:
    return tracker.client.search_runs([tracker.experiment_id], f"tags.`jagg.run` = '{run}'")


def test_m5_a_sweep_run_again_adopts_the_mlflow_run_each_training_already_has(tmp_path, empty_store):
    """Before: after the sweep's own worker was killed and the sweep run again (a new flow run, so a new sweep name),
    baseline-s0 and jagg-s0 each had two MLflow runs (the old one held the curve, the new one the evaluations) and
    there were two base runs: a run was found by its sweep. Now it is found by who it is (profile, outputs folder,
    name, fingerprint): the rerun adopts it, curve and all, and points it to its own sweep."""
    from jagg_core.pipeline.tracking import OWNER_TAG

    tracker = _sqlite_tracker(tmp_path, empty_store)
    names = {"base": (None, None, "base"), "baseline-s0": ("baseline", 0, "fp-b"), "jagg-s0": ("jagg", 0, "fp-j")}
    first = {run: tracker.child_run("flow-run-1", run, method=m, seed=s, key=k) for run, (m, s, k) in names.items()}
    tracker.logger(first["jagg-s0"]).log_metrics({"reward/mean": 0.5}, 1)  # its curve, in the first sweep
    for run_id in first.values():  # the worker killed under them: RUNNING, their owner gone
        tracker.set_tags(run_id, {OWNER_TAG: _dead_owner()})
    again = {run: tracker.child_run("flow-run-2", run, method=m, seed=s, key=k, extra_tags={"prefect_flow_run_id": "2"})
             for run, (m, s, k) in names.items()}
    assert again == first
    parent = tracker.sweep_run("flow-run-2")
    for run, run_id in first.items():
        assert len(_runs_named(tracker, run)) == 1, run
        r = tracker.client.get_run(run_id)
        assert r.data.tags["jagg.sweep"] == "flow-run-2" and r.data.tags["jagg.parent_run"] == parent
        assert r.info.status == "KILLED" and tracker.claim(run_id)  # reaped, then taken by the rerun's training
    assert tracker.metric_points(first["jagg-s0"], "reward/mean") == {(1, 0.5)}
    # another fingerprint (other params in the same folder) is another run
    assert tracker.child_run("flow-run-2", "jagg-s0", method="jagg", seed=0, key="fp-other") != first["jagg-s0"]


def test_m5_two_outputs_folders_are_two_mlflow_runs(tmp_path, empty_store):
    """Before: two runs of one name and params under different `--set outputs=` logged into one MLflow run (14
    `reward/mean` points for 2 steps; its checkpoint tag pointed at the other folder): the outputs folder was no part
    of who a run is. Now it is (`jagg.outputs`); a run from before that tag is adopted by the folder its last
    checkpoint is in."""
    from jagg_core.pipeline.tracking import Tracker

    ci_ = _sqlite_tracker(tmp_path, empty_store)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    lk = Tracker(load_params(PARAMS, "ci", {"tracking.mlflow_uri": uri, "outputs": "lk"}), tmp_path)
    ours, theirs = (t.child_run("default", "jagg-s0", method="jagg", seed=0, key="same-fp") for t in (ci_, lk))
    assert ours != theirs
    for tracker, run_id, value in ((ci_, ours, 1.0), (lk, theirs, 2.0)):
        assert tracker.client.get_run(run_id).data.tags["jagg.outputs"] == tracker.outputs
        tracker.logger(run_id).log_metrics({"reward/mean": value}, 1)
    assert ci_.metric_points(ours, "reward/mean") == {(1, 1.0)}
    assert lk.metric_points(theirs, "reward/mean") == {(1, 2.0)}
    # a run made before `jagg.outputs` (its last checkpoint in lk's folder) is lk's, not the profile's
    legacy = ci_.client.create_run(ci_.experiment_id, tags={
        "jagg.kind": "run", "profile": "ci", "jagg.sweep": "default", "jagg.run": "jagg-s1", "jagg.key": "k1",
        "jagg.checkpoint": "checkpoints/lk/jagg-s1/step_000002"}).info.run_id
    assert ci_.child_run("default", "jagg-s1", method="jagg", seed=1, key="k1") != legacy
    assert lk.child_run("default", "jagg-s1", method="jagg", seed=1, key="k1") == legacy
    assert lk.client.get_run(legacy).data.tags["jagg.outputs"] == "lk"


_SWEEP_HOLDER = """
import sys, time
from pathlib import Path
from jagg_core.setup.params_io import load_params
from jagg_core.pipeline.tracking import Tracker
params = load_params(Path(sys.argv[1]), "ci", {"tracking.mlflow_uri": sys.argv[2]})
with Tracker(params, Path(sys.argv[3])).sweeping("crashed") as run_id:
    print(run_id, flush=True)
    time.sleep(600)
"""


def test_m5_a_sweeps_parent_run_runs_while_it_runs_and_ends_with_its_outcome(tmp_path, monkeypatch, empty_store):
    """Before: a sweep's parent MLflow run was FINISHED from its first seconds, and stayed FINISHED when the sweep
    failed, was cancelled or crashed. Now the flow holds it RUNNING and ends it with its outcome: FINISHED when it
    completes, FAILED with the `jagg.failure` sentence (redacted) when it fails, KILLED when it is cancelled
    (Prefect's TerminationSignal) or interrupted, and a SIGKILLed sweep's run is marked KILLED by the next sweep.
    The flows run here without Prefect (``.fn``), their stages stand-ins that look at the parent run mid-sweep."""
    import signal

    from prefect.exceptions import TerminationSignal

    import flows.reproduce as rp
    from jagg_core.pipeline.tracking import FAILURE_TAG
    from jagg_core.setup.storage import PromptFileError

    tracker = _sqlite_tracker(tmp_path, empty_store)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    overrides = {"tracking.mlflow_uri": uri}  # a neutral override: the profile's own folders

    def sweep(name: str):
        return tracker.client.search_runs([tracker.experiment_id], f"tags.`jagg.sweep` = '{name}' and "
                                          f"tags.`jagg.kind` = 'sweep'")[0]

    def stage(name: str) -> str:
        """What a stage of the sweep sees of its parent run (every stage opens it: ``Tracker.sweep_run``)."""
        return tracker.client.get_run(tracker.sweep_run(name)).info.status

    seen = []
    monkeypatch.setattr(rp, "evaluate_task", lambda params, run, name: seen.append(stage(name)))
    monkeypatch.setattr(rp, "report_task", lambda params, name: seen.append(stage(name)) or {})
    rp.evaluate_only.fn(profile="ci", overrides=overrides, sweep="completes")
    assert set(seen) == {"RUNNING"} and sweep("completes").info.status == "FINISHED"

    secret = "hunter2pw"
    failure = PromptFileError(f"the prompts at http://u:{secret}@h/p cannot be read.")
    cancel = TerminationSignal(signal.SIGTERM)  # what Prefect raises in a flow run it cancels
    for name, error, status in (("fails", failure, "FAILED"), ("cancelled", cancel, "KILLED"),
                                ("interrupted", KeyboardInterrupt(), "KILLED")):
        def prepare(params, name=name, error=error):  # noqa: ANN001
            seen.append(stage(name))
            raise error

        seen.clear()
        monkeypatch.setattr(rp, "prepare_task", prepare)
        with pytest.raises(type(error)):
            rp.reproduce.fn(profile="ci", overrides=overrides, sweep=name)
        run = sweep(name)
        assert seen == ["RUNNING"] and run.info.status == status, (name, seen, run.info.status)
        if status == "FAILED":
            reason = run.data.tags[FAILURE_TAG]
            assert "cannot be read" in reason and secret not in reason, reason
        else:
            assert FAILURE_TAG not in run.data.tags

    # a sweep whose process is SIGKILLed: RUNNING until the next sweep (or stage) opens the store, then KILLED
    proc = subprocess.Popen([sys.executable, "-c", _SWEEP_HOLDER, str(PARAMS), uri, str(tmp_path)], cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        crashed = proc.stdout.readline().strip()
        assert crashed and tracker.client.get_run(crashed).info.status == "RUNNING"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with tracker.sweeping("next"):
        assert tracker.client.get_run(crashed).info.status == "KILLED"
    assert sweep("next").info.status == "FINISHED"


def test_m5_a_trainings_flow_run_tag_names_its_training_not_its_evaluation(ci_project, monkeypatch, empty_store):
    """Before: a training's `prefect_flow_run_id` (and `dvc_stage`) named its evaluation unit, the last flow run to
    tag it (a pool dispatches each as a flow run of its own). Now the training's tags stay its own and the
    evaluation's go under `eval.`; the base model's run, its evaluation's own, holds both."""
    import shutil
    from types import SimpleNamespace

    import prefect.context

    from jagg_core.pipeline.tracking import Tracker
    from jagg_core.setup.paths import Layout
    from tasks.evaluate import evaluate
    from tasks.train import train_run

    shutil.copy(empty_store, ci_project / "mlflow.db")  # the project's default store, its tables made
    params = load_params(ci_project / "params.yaml", "ci")
    lay = Layout.of(params, ci_project)

    def unit(flow_run: str, stage: str) -> None:
        monkeypatch.setattr(prefect.context.FlowRunContext, "get",
                            lambda: SimpleNamespace(flow_run=SimpleNamespace(id=flow_run)))
        monkeypatch.setenv("DVC_STAGE", stage)

    unit("train-unit", "train@jagg-s0")
    monkeypatch.setenv("JAGG_FAULT", "run_created@0:oserror")  # stop right after the run is tagged: no worker
    with pytest.raises(OSError, match="injected"):
        train_run(params, lay, "jagg", 0)
    monkeypatch.delenv("JAGG_FAULT")
    unit("eval-unit", "evaluate@jagg-s0")
    with pytest.raises(Exception):  # nothing to evaluate (no checkpoint): its tags are set before
        evaluate(params, lay, "jagg-s0")
    tracker = Tracker(params, ci_project)
    (run,) = _runs_named(tracker, "jagg-s0")
    assert run.data.tags["prefect_flow_run_id"] == "train-unit" and run.data.tags["dvc_stage"] == "train@jagg-s0"
    assert run.data.tags["eval.prefect_flow_run_id"] == "eval-unit"
    assert run.data.tags["eval.dvc_stage"] == "evaluate@jagg-s0"
    unit("base-unit", "evaluate@base")
    with pytest.raises(Exception):  # stopped after its run is tagged, before any model loads
        monkeypatch.setattr("jagg_core.evaluation.evaluate.evaluate_run",
                            lambda *a, **k: (_ for _ in ()).throw(OSError("stop")))
        evaluate(params, lay, "base")
    (base,) = _runs_named(tracker, "base")
    assert base.data.tags["prefect_flow_run_id"] == base.data.tags["eval.prefect_flow_run_id"] == "base-unit"
