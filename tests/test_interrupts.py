"""Interrupting the launchers: `jagg run` stopped by Ctrl-C, SIGTERM and SIGKILL, and what it hands Prefect.

One training run of `jagg run` (its own temporary Prefect server, a live MLflow server reached through a credentialed
URI) is stopped three times, once by each signal, each right after a new checkpoint, then finished by a fourth start.
The three signal tests and the secrets test read that one scenario (computed once per module), so the four cost what
one did. Each signal's resume is judged by the checkpoint the next start writes after resuming from it: it must equal,
bit for bit, the same iteration of the shared ``uninterrupted`` reference (`jagg train --worker` in a process of its
own: the trainers of `jagg run` train with the same torch threads, see ``tasks.launch.worker_threads``).

`jagg train` SIGKILLed (its trainer goes with it) and stopped by SIGTERM (its workers, its 0600 context file, its
MLflow run, its secrets) have tests of their own at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_module
from fault_helpers import _MlflowServer, _ckpts, _files_holding, _own_processes
from jagg_core.trainer import latest_checkpoint
from jagg_core.trainer.checkpoint import load_tensors

SECRET = "s3cret-4f1c"
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)


@dataclass
class Stop:
    """One start of `jagg run` stopped by a signal."""

    sig: signal.Signals
    at: int  # the newest checkpoint when the process was gone
    rc: int
    took: float  # seconds from the signal to the exit
    left: list = field(default_factory=list)  # command lines of the run's processes still alive after it
    sweeps: list = field(default_factory=list)  # (status, reaped_by) of the MLflow sweep runs once it was gone


@dataclass
class Scenario:
    root: Path
    stops: dict
    final: subprocess.CompletedProcess
    logs: Path

    def run_dir(self) -> Path:
        (run_dir,) = self.root.glob("checkpoints/ci-*/jagg-s0")
        return run_dir

    def weights(self, iteration: int) -> dict:
        return load_tensors(self.run_dir() / f"checkpoint-{iteration:06d}" / "trainable.safetensors")


def _reached(root: Path) -> int:
    last = [latest_checkpoint(d) for d in root.glob("checkpoints/ci-*/jagg-s0")]
    return max((c.iteration for c in last if c is not None), default=0)


def _sweep_runs(url: str) -> list[tuple[str, str]]:
    """(status, ``jagg.reaped_by``) of every MLflow sweep run of the ci experiment at ``url``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url)
    exp = client.get_experiment_by_name("jagg-ci")
    runs = client.search_runs([exp.experiment_id], "tags.`jagg.kind` = 'sweep'") if exp else []
    return [(r.info.status, r.data.tags.get("jagg.reaped_by", "")) for r in runs]


def _start_and_stop(root: Path, args: list[str], env: dict, sig: signal.Signals, log: Path, url: str) -> Stop:
    before = _reached(root)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.run", *args], cwd=root, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while _reached(root) == before:
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"`jagg run` wrote no new checkpoint before {sig.name}: {log.read_text()[-3000:]}")
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    took = time.monotonic() - t0
    for _ in range(100):  # after SIGKILL the kernel signals the children (PR_SET_PDEATHSIG); they take a moment
        if not _own_processes(root):
            break
        time.sleep(0.1)
    left = [p.cmdline() for p in _own_processes(root)]
    for p in _own_processes(root):  # so that one failure does not spoil the next start
        p.kill()
    return Stop(sig, _reached(root), rc, took, left, _sweep_runs(url))


@pytest.fixture(scope="module")
def interrupted(ci_base, tmp_path_factory) -> Scenario:
    work = tmp_path_factory.mktemp("jagg-run")
    root = work / "project"
    shutil.copytree(ci_base, root)
    server = _MlflowServer(root)
    server.start()
    args = ["--profile", "ci", "--set", "run.methods=[jagg]", "--set", "reward.weights={toy_background: 1.0}",
            "--set", "train.iterations=4", "--set", f"tracking.mlflow_uri=http://user:{SECRET}@127.0.0.1:{server.port}/"]
    # The environment of the `uninterrupted` reference (OMP_NUM_THREADS as it is), the project's own Prefect home.
    env = dict(os.environ, JAGG_ROOT=str(root), PYTHONPATH=str(REPO), PREFECT_HOME=str(root / ".prefect"))
    env.pop("PREFECT_API_URL", None)
    try:
        stops = {sig: _start_and_stop(root, args, env, sig, work / f"{sig.name}.log", server.url) for sig in SIGNALS}
        final = run_module("flows.run", *args, root=root, env={"PREFECT_HOME": str(root / ".prefect")})
        (work / "final.log").write_text(final.stdout + final.stderr)
    finally:
        server.stop()
    for stop in stops.values():
        print(f"jagg run: {stop.sig.name} at iteration {stop.at}, exit status {stop.rc} after {stop.took:.1f} s")
    return Scenario(root, stops, final, work)


@pytest.mark.slow  # the scenario: four starts of `jagg run` with live servers (~200 s)
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_jagg_run_stopped_by_a_signal_leaves_nothing_and_resumes_bit_identically(interrupted, uninterrupted, sig):
    """Ctrl-C / SIGTERM / SIGKILL to `jagg run`: no process of its own stays alive (the temporary server dies with it
    even after SIGKILL), Ctrl-C and SIGTERM exit within 10 s with 130 / 143, and the start after it resumes to the
    bits of an uninterrupted run (it used to take ~156 s for Ctrl-C, leave the server listening after SIGTERM or
    SIGKILL, and the resumed weights differed from the reference by 6e-8: `accelerate launch` trained with one
    thread where a process of its own uses every core)."""
    stop = interrupted.stops[sig]
    assert not stop.left, stop.left
    # The sweep's MLflow run is ended as soon as `jagg run` is gone, KILLED, before any later start: after SIGKILL by
    # its watcher (jagg_core/pipeline/sweep_watch.py; it stayed RUNNING until the next sweep opened the store).
    assert stop.sweeps and all(status == "KILLED" for status, _ in stop.sweeps), stop.sweeps
    assert any(by.startswith("the watcher of ") for _, by in stop.sweeps) == (sig == signal.SIGKILL), stop.sweeps
    assert stop.rc == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig)
    if sig != signal.SIGKILL:
        assert stop.took < 10, f"{sig.name}: exited after {stop.took:.1f} s"
    assert stop.at < 4, "the run finished before the signal: the test proves nothing"
    assert interrupted.final.returncode == 0, interrupted.final.stderr[-3000:]
    reference = uninterrupted("jagg")  # builds the roots below
    ref = uninterrupted.roots["jagg"] / "checkpoints/ci/jagg-s0"
    resumed = stop.at + 1  # written by the next start, which resumed from this signal's checkpoint
    expected = load_tensors(ref / f"checkpoint-{resumed:06d}" / "trainable.safetensors") if resumed < 4 else reference
    got = interrupted.weights(resumed)
    assert expected.keys() == got.keys()
    diff = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected), f"iteration {resumed} differs by {diff:.1e}"
    curve = (interrupted.root / "runs" / interrupted.run_dir().parent.name / "jagg-s0" / "curve.tsv").read_text()
    assert [line.split("\t")[0] for line in curve.splitlines()[1:]] == ["1", "2", "3", "4"]  # every iteration once


@pytest.mark.slow  # the scenario: four starts of `jagg run` with live servers (~200 s)
def test_jagg_run_hands_prefect_no_secret(interrupted):
    """The same four starts of `jagg run`, with ``tracking.mlflow_uri=http://user:<password>@…``: the password is in
    no file of the project — the temporary Prefect server's database (flow-run parameters, states, logs) included —
    and in nothing printed. (Prefect stored the flow run's parameters as given.)"""
    db = interrupted.root / ".prefect" / "prefect.db"
    assert db.exists() and db.stat().st_size > 0  # the grep below reads the server's records
    assert _files_holding(interrupted.root, SECRET.encode()) == [], "the password reached the project's files"
    assert _files_holding(interrupted.logs, SECRET.encode()) == [], "the password reached the output"


def test_withheld_overrides_reach_the_flow_and_the_trainers_real():
    """What `jagg run` hands Prefect is redacted; the flow gets the real values back, in this process or from
    JAGG_SECRET_OVERRIDES (a deployment's worker); a value that is not the redaction of a withheld one stays."""
    import json

    from flows import secrets
    from flows.reproduce import flow_params

    uri = f"http://user:{SECRET}@127.0.0.1:1/"
    shown = secrets.withhold({"tracking.mlflow_uri": uri, "train.iterations": 1})
    assert shown == {"tracking.mlflow_uri": "http://user:***@127.0.0.1:1/", "train.iterations": 1}
    assert flow_params("ci", str(REPO / "params.yaml"), shown).tracking.mlflow_uri == uri
    secrets._withheld.clear()
    env = {secrets.ENV: json.dumps({"tracking.mlflow_uri": uri})}
    assert secrets.restore(shown, env)["tracking.mlflow_uri"] == uri
    other = {"tracking.mlflow_uri": "http://user:***@elsewhere:1/"}
    assert secrets.restore(other, env) == other


@pytest.mark.parametrize("action,sig", [("ui", signal.SIGTERM), ("up", signal.SIGINT)], ids=["ui-SIGTERM", "up-Ctrl-C"])
def test_services_stopped_by_a_signal_leave_no_server(tmp_path, action, sig):
    """`jagg ui` (the MLflow UI in the foreground) gets SIGTERM once it answers; `jagg services up` gets Ctrl-C while
    its Prefect server starts: each exits 128 + signal within 10 s and leaves no process of its own (`up` left the
    server it had started running; `jagg ui`, an `exec` of mlflow, exited 0 as if it had ended on its own)."""
    import urllib.request

    from tasks.common import free_port

    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    port = free_port()
    args = ["ui", "--mlflow-port", str(port)] if action == "ui" else ["up", "--prefect-port", str(port),
                                                                     "--mlflow-port", "0"]
    env = dict(os.environ, JAGG_ROOT=str(root), PYTHONPATH=str(REPO))
    env.pop("PREFECT_API_URL", None)
    log = tmp_path / "services.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tasks.services", *args], cwd=root, env=env, stdout=out,
                                stderr=subprocess.STDOUT)

    def started() -> bool:
        if action == "up":  # the server is spawned (its pid recorded), not yet answering
            return (root / ".services" / "pids.json").exists()
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
        except OSError:
            return False

    deadline = time.time() + 180
    while not started():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)
    t0 = time.monotonic()
    proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    took = time.monotonic() - t0
    for _ in range(50):
        if not _own_processes(root):
            break
        time.sleep(0.1)
    left = [p.cmdline() for p in _own_processes(root)]
    for p in _own_processes(root):
        p.kill()
    print(f"jagg services {action}: {sig.name}, exit status {rc} after {took:.1f} s")
    assert not left, left
    assert rc == 128 + sig and took < 10, (rc, took, log.read_text()[-2000:])
    assert not (root / ".services" / "pids.json").exists()  # `jagg services status` shows nothing running


# --- `jagg train` killed or stopped: its trainer goes with it, its secrets nowhere ---------------------------------


@pytest.mark.slow  # launched training runs beside live servers (20-50 s)
def test_a_killed_launcher_takes_its_trainer_with_it(ci_project):
    """SIGKILL to the process that launched training (a crashed flow, a killed `jagg train`): the trainer it started
    (accelerate and its worker) stops too, instead of writing on as an orphan; the next start resumes."""
    import signal
    import time

    import psutil

    args = ["--profile", "ci", "--method", "jagg", "--set", "reward.weights={jpeg_compressibility: 1.0}"]
    env = dict(os.environ, JAGG_ROOT=str(ci_project), PYTHONPATH=str(REPO))
    launcher = subprocess.Popen([sys.executable, "-m", "tasks.train", *args, "--set", "train.iterations=200"],
                                cwd=ci_project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = _ckpts(ci_project) / "checkpoint-000001" / "manifest.json"
    deadline = time.time() + 300
    while not first.exists():
        assert launcher.poll() is None and time.time() < deadline, "training did not start"
        time.sleep(0.1)
    trainer = [p for p in psutil.Process(launcher.pid).children(recursive=True)]
    assert any("--worker-context" in " ".join(p.cmdline()) for p in trainer)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    gone, alive = psutil.wait_procs(trainer, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    out = run_module("tasks.train", *args, "--set", "train.iterations=2", root=ci_project)
    assert out.returncode == 0, out.stderr[-2000:]  # the run's lock is free again; it resumes
    assert latest_checkpoint(_ckpts(ci_project)).iteration >= 2
    assert not list((ci_project / "runs/ci/jagg-s0").glob(".worker-context-*"))  # the dead launcher's file too


@pytest.mark.slow  # launched training runs beside live servers (20-50 s)
def test_sigterm_on_jagg_train_stops_workers_removes_the_context_and_leaks_no_secret(ci_project, tmp_path):
    """SIGTERM to `jagg train` logging to a live MLflow server through a credentialed URI: the workers stop, the 0600
    context file (full params, password included) is removed, the MLflow run is KILLED, and the password is nowhere
    — no file of the project (the MLflow and Prefect databases included), nothing the run printed."""
    import signal
    import time

    import psutil
    from mlflow.tracking import MlflowClient

    server = _MlflowServer(ci_project)
    server.start()
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    try:
        uri = f"http://user:s3cret@127.0.0.1:{server.port}/"
        env = dict(os.environ, JAGG_ROOT=str(ci_project), PYTHONPATH=str(REPO),
                   PREFECT_HOME=str(ci_project / ".prefect"))
        with open(out, "w") as o, open(err, "w") as e:
            launcher = subprocess.Popen(
                [sys.executable, "-m", "tasks.train", "--profile", "ci", "--method", "jagg", "--set",
                 "reward.weights={jpeg_compressibility: 1.0}", "--set", "train.iterations=200", "--set",
                 f"tracking.mlflow_uri={uri}"], cwd=ci_project, env=env, stdout=o, stderr=e)
        first = _ckpts(ci_project) / "checkpoint-000001" / "manifest.json"
        deadline = time.time() + 300
        while not first.exists():
            assert launcher.poll() is None and time.time() < deadline, err.read_text()[-2000:]
            time.sleep(0.1)
        workers = psutil.Process(launcher.pid).children(recursive=True)
        assert list((ci_project / "runs/ci/jagg-s0").glob(".worker-context-*.json"))
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 128 + signal.SIGTERM, err.read_text()[-2000:]
        stopped = time.monotonic() - t0
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive and not _own_processes(ci_project), [p.cmdline() for p in alive]
        assert not list((ci_project / "runs/ci/jagg-s0").glob(".worker-context-*.json"))
        runs = MlflowClient(server.url).search_runs(
            [e.experiment_id for e in MlflowClient(server.url).search_experiments()],
            "tags.`jagg.run` = 'jagg-s0'")
        assert [r.info.status for r in runs] == ["KILLED"], [r.info.status for r in runs]
    finally:
        server.stop()
    print(f"jagg train stopped {stopped:.1f} s after SIGTERM")
    assert stopped < 30
    assert _files_holding(ci_project, b"s3cret") == [], "the password reached the project's files"
    assert b"s3cret" not in out.read_bytes() + err.read_bytes(), "the password reached the output"
    assert b"***" in (ci_project / "runs/ci/jagg-s0/params.json").read_bytes()
