"""A sweep on the work pool (``resources.dispatch: pool``): every training and evaluation a flow run of its own.

One set-up for the module: a real Prefect server and MLflow server (`jagg services up`, whose worker `head` serves the
sweeps' queue only), two process workers `host-a` and `host-b` on the pool's `units` queue, one flow run at a time
each (two "hosts"), and a worker `stray` whose JAGG_ROOT is another folder. The sweeps use the settings of the shared
`uninterrupted` reference (conftest.py), so their final weights are compared bit for bit with an in-process run's.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from conftest import run_module
from tasks.common import free_port
from test_pipeline import BIN, _clone, _run, _with_ci_base

# The `uninterrupted` reference's settings (conftest.WORKER_ARGS): a sweep with them trains its runs to its bits
REF = {"reward.weights": {"toy_background": 1.0}, "train.iterations": 4}
UNITS = ("host-a", "host-b")
METHODS = ("baseline", "jagg")  # the pool sweep's: the exact baseline and JAGG


@dataclass
class Cluster:
    root: Path
    stray: Path
    api: str
    mlflow: str

    def pool(self, **extra) -> dict:
        """Overrides of a pool-dispatched sweep logging to the module's MLflow server."""
        return {"resources.dispatch": "pool", "tracking.mlflow_uri": self.mlflow, **extra}


def _api(api: str, path: str, body: dict | None = None):
    """A call of the Prefect server's REST API; a 503 (its database busy: "retry") is retried, as Prefect's client
    does."""
    data = None if body is None else json.dumps(body).encode()
    for attempt in range(10):
        req = urllib.request.Request(f"{api}/{path}", data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            if e.code != 503 or attempt == 9:
                raise
            time.sleep(1 + attempt)


def _children(api: str, flow_run_id: str) -> list[dict]:
    """The flow runs the Prefect UI shows as children of ``flow_run_id``."""
    return _api(api, "flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}})


def _worker(fr: dict) -> str | None:
    return next((t.removeprefix("worker:") for t in fr["tags"] if t.startswith("worker:")), None)


def _outputs(overrides: dict) -> str:
    """The folder of a sweep point (flows/sweep.py:flow_params): its digest covers what changes results only."""
    from flows.sweep import sweep_digest

    return "ci-" + sweep_digest(overrides)


def _weights(root: Path, outputs: str, run: str, iteration: int = 4) -> dict:
    from jagg_core.trainer.checkpoint import load_tensors

    return load_tensors(root / f"checkpoints/{outputs}/{run}/checkpoint-{iteration:06d}/trainable.safetensors")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _state(api: str, flow_run_id: str) -> dict:
    return _api(api, f"flow_runs/{flow_run_id}")["state"]


def _wait(api: str, flow_run_id: str, timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = _state(api, flow_run_id)
        if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return state
        time.sleep(2)
    raise AssertionError(f"flow run {flow_run_id} did not end within {timeout:.0f} s: {state}")


def _submit(api: str, deployment: str, parameters: dict, queue: str | None = None) -> str:
    dep = _api(api, f"deployments/name/{deployment}")
    body = {"parameters": parameters, **({"work_queue_name": queue} if queue else {})}
    return _api(api, f"deployments/{dep['id']}/create_flow_run", body)["id"]


@pytest.fixture(scope="module")
def cluster(ci_base, tmp_path_factory):
    root = _with_ci_base(_clone(tmp_path_factory.mktemp("pool")), ci_base)  # the ci prompts and base model
    stray = _clone(tmp_path_factory.mktemp("stray"))  # the code, in another folder: another host's view
    port, mlflow_port = free_port(), free_port()
    api = f"http://127.0.0.1:{port}/api"
    jagg = str(BIN / "jagg")
    try:
        up = _run([jagg, "services", "up", "--prefect-port", str(port), "--mlflow-port", str(mlflow_port), "--name",
                   "head", "--queue", "default", "--crash-after", "60", "--cancel-late-after", "20"], root,
                  timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        for name in UNITS:  # a training holds before iteration 2's rollout while the test's hold file exists
            w = _run([jagg, "services", "worker", "--api", api, "--name", name, "--queue", "units", "--limit", "1"],
                     root, timeout=120, JAGG_FAULT="rollout@2:hold", JAGG_FAULT_HOLD=str(root / ".hold"))
            assert w.returncode == 0, w.stdout + w.stderr
        w = _run([jagg, "services", "worker", "--api", api, "--name", "stray", "--queue", "stray"], stray, timeout=120)
        assert w.returncode == 0, w.stdout + w.stderr
        yield Cluster(root, stray, api, f"http://127.0.0.1:{mlflow_port}")
    finally:
        _run([jagg, "services", "down"], stray, timeout=120)
        _run([jagg, "services", "down"], root, timeout=120)


def _one_sentence(message: str) -> str:
    """The error's own text of a failed flow run's state message: one line, one sentence, no traceback."""
    text = re.sub(r"^Flow run encountered an exception: \w+: ", "", message)
    assert "\n" not in text and "Traceback" not in text and text.endswith("."), message
    assert not re.search(r"\.\s+[A-Z]", text), f"more than one sentence: {text}"
    return text


@pytest.mark.slow
def test_a_worker_that_sees_another_project_or_a_sqlite_store_refuses_in_one_sentence(cluster):
    """A unit taken by a worker whose project folder is another (JAGG_ROOT elsewhere), or whose params name a sqlite
    tracking store, fails with one sentence before it trains: no checkpoint, run folder or MLflow run is written."""
    from jagg_core.setup.params_io import load_params
    from tasks.dispatch import remove_sentinel, write_sentinel

    point = cluster.pool(**{"train.iterations": 3})  # a sweep point of its own: its folders must stay absent
    params = load_params(cluster.root / "params.yaml", "ci", point)
    shared = write_sentinel(params, cluster.root, "refusals")  # what a sweep hands its units
    unit = {"profile": "ci", "method": "jagg", "seed": 0, "shared": shared, "sweep": "refusals"}
    on_sqlite = {"resources.dispatch": "pool", "train.iterations": 3}
    try:
        elsewhere = _submit(cluster.api, "jagg-train/pool", {**unit, "overrides": point}, queue="stray")
        sqlite = _submit(cluster.api, "jagg-train/pool", {**unit, "overrides": on_sqlite})
        states = {k: _wait(cluster.api, fid, 300) for k, fid in (("elsewhere", elsewhere), ("sqlite", sqlite))}
    finally:
        remove_sentinel(cluster.root, shared)
    assert states["elsewhere"]["type"] == "FAILED", states
    said = _one_sentence(states["elsewhere"]["message"])
    assert said.startswith(f"worker 'stray' on {socket.gethostname()} does not see the sweep's project folder"), said
    assert states["sqlite"]["type"] == "FAILED", states
    said = _one_sentence(states["sqlite"]["message"])
    assert "resources.dispatch = pool needs tracking.mlflow_uri to be an MLflow server" in said, said
    for root in (cluster.root, cluster.stray):
        written = [root / d / o for d in ("checkpoints", "runs", "eval") for o in (_outputs(point), _outputs(on_sqlite))
                   if (root / d / o).exists()]
        assert not written, written
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cluster.mlflow)
    exp = client.get_experiment_by_name("jagg-ci")
    assert not client.search_runs([exp.experiment_id], "tags.`jagg.sweep` = 'refusals' and tags.`jagg.kind` = 'run'")


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_pool_sweep_runs_each_unit_as_a_child_flow_run_on_both_workers_with_in_process_numbers(
        cluster, uninterrupted, tmp_path):
    """`prefect deployment run 'jagg-reproduce/ci'` with dispatch to the pool: the base evaluation, every training
    and every evaluation is a child flow run of the sweep's, taken by both unit workers, and the runs end with the
    bits of an in-process run; their evaluation has the in-process evaluation's numbers, the report is written.
    (Two of the profile's methods: five units for two workers, each of whom takes some; a third method's training
    and evaluation would be two more units of the same kind.)"""
    overrides = cluster.pool(**REF, **{"run.methods": list(METHODS)})
    run = _run([str(BIN / "prefect"), "deployment", "run", "jagg-reproduce/ci", "-p", f"overrides={json.dumps(overrides)}",
                "-p", "parallel_runs=2", "--watch", "--watch-timeout", "1800"], cluster.root, timeout=1900,
               PREFECT_API_URL=cluster.api, PREFECT_HOME=str(cluster.root / ".services/prefect"))
    assert run.returncode == 0 and "Completed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    sweep = re.search(r"UUID: ([0-9a-f-]{36})", run.stdout).group(1)
    children = _children(cluster.api, sweep)
    runs = [f"{m}-s0" for m in METHODS]
    expected = {"evaluate base", *(f"train {r}" for r in runs), *(f"evaluate {r}" for r in runs)}
    assert sorted(c["name"] for c in children) == sorted(expected)
    assert {c["state"]["type"] for c in children} == {"COMPLETED"}
    took = {c["name"]: _worker(c) for c in children}
    assert set(took.values()) == set(UNITS), took  # both hosts took units; the sweep's own worker took none
    outputs = _outputs(overrides)
    for method in METHODS:
        assert _same(_weights(cluster.root, outputs, f"{method}-s0"), uninterrupted(method)), method
    # The evaluation of the in-process reference run, in a copy of its project: the same numbers as the pool's.
    ref = tmp_path / "ref"
    shutil.copytree(uninterrupted.roots["jagg"], ref)
    sets = [a for k, v in REF.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    out = run_module("tasks.evaluate", "--profile", "ci", "--run", "jagg-s0", *sets, root=ref)
    assert out.returncode == 0, out.stderr[-2000:]
    want = json.loads((ref / "eval/ci/jagg-s0/metrics.json").read_text())
    got = json.loads((cluster.root / f"eval/{outputs}/jagg-s0/metrics.json").read_text())
    assert (got["step"], got["metrics"]) == (want["step"], want["metrics"])
    summary = json.loads((cluster.root / f"reports/{outputs}/summary.json").read_text())
    final = {r["method"]: r["final"] for r in summary["runs"]}
    assert final["jagg"] == {k: v["mean"] for k, v in want["metrics"].items() if k in final["jagg"]}
    assert set(final) == set(METHODS)
    assert (cluster.root / f"runs/{outputs}/speed.json").exists()  # the speed stage ran, in the sweep's flow


def _checkpoints(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("checkpoint-*") if (p / "manifest.json").exists())


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_worker_killed_mid_training_leaves_its_run_crashed_and_another_worker_resumes_it(cluster, uninterrupted):
    """SIGKILL of a unit worker and its training: Prefect marks the child flow run CRASHED (no heartbeats), the sweep
    submits the training again, the other worker resumes it from its last complete checkpoint, and the run ends with
    the bits of an undisturbed run; the sweep completes."""
    overrides = cluster.pool(**REF, **{"run.methods": ["jagg"], "resources.speed_rounds": 0})
    ckpts = cluster.root / f"checkpoints/{_outputs(overrides)}/jagg-s0"
    hold = cluster.root / ".hold"  # the training waits after its first checkpoint (a ci iteration takes < 1 s)
    hold.write_text("")
    started = _run([str(BIN / "prefect"), "deployment", "run", "jagg-reproduce/ci", "-p",
                    f"overrides={json.dumps(overrides)}", "-p", "parallel_runs=2"], cluster.root, timeout=120,
                   PREFECT_API_URL=cluster.api, PREFECT_HOME=str(cluster.root / ".services/prefect"))
    assert started.returncode == 0, started.stdout + started.stderr
    sweep = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)
    deadline = time.time() + 900
    while time.time() < deadline:
        training = [c for c in _children(cluster.api, sweep) if c["name"] == "train jagg-s0"]
        if training and training[0]["state"]["type"] == "RUNNING" and _checkpoints(ckpts) and _worker(training[0]):
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the training never ran past its first checkpoint")
    victim, killed = training[0], _worker(training[0])
    records = json.loads((cluster.root / f".services/workers-{socket.gethostname()}.json").read_text())
    procs = [psutil.Process(records[f"worker-{killed}"]["pid"])]
    flow_process = psutil.Process(int(str(victim["infrastructure_pid"]).rpartition(":")[2]))
    procs += [flow_process, *flow_process.children(recursive=True)]
    for p in procs:  # the worker and its training, at once
        p.send_signal(signal.SIGKILL)
    at = _checkpoints(ckpts)[-1]
    hold.unlink()  # the resumed training goes on
    assert at < 4, "the training ended before the kill: the test proves nothing"
    state = _wait(cluster.api, sweep, 1200)
    assert state["type"] == "COMPLETED", state
    trainings = sorted((c for c in _children(cluster.api, sweep) if c["name"] == "train jagg-s0"),
                       key=lambda c: c["expected_start_time"])
    assert [(c["state"]["type"], _worker(c)) for c in trainings] == [
        ("CRASHED", killed), ("COMPLETED", next(u for u in UNITS if u != killed))], trainings
    logs = _api(cluster.api, "logs/filter", {"logs": {"flow_run_id": {"any_": [trainings[1]["id"]]}}, "limit": 200})
    assert any(re.search(rf"resuming jagg-s0 from .*checkpoint-{at:06d}", rec["message"]) for rec in logs), \
        [rec["message"] for rec in logs][-30:]
    assert _same(_weights(cluster.root, _outputs(overrides), "jagg-s0"), uninterrupted("jagg"))
    curve = (cluster.root / f"runs/{_outputs(overrides)}/jagg-s0/curve.tsv").read_text()
    assert [line.split("\t")[0] for line in curve.splitlines()[1:]] == ["1", "2", "3", "4"]  # every iteration once


@pytest.mark.slow
def test_a_sweep_no_worker_takes_is_cancelled_once_late_naming_the_pool_and_queue(cluster):
    """A sweep sent where no worker listens (here: the `default` queue paused, as with no worker serving it) stayed
    Scheduled / Late for ever, `--watch` showing only Late (issue 71, item 3). Now the automation `jagg services up`
    makes (tasks/services.py:late_automations; --cancel-late-after 20 here, resources.pool_wait_s by default)
    cancels it once Late for that long, its state message naming the pool and the queue, and `--watch` ends."""
    import urllib.parse

    queue = f"work_pools/jagg/queues/{urllib.parse.quote('default')}"
    _patch(cluster.api, queue, {"is_paused": True})
    try:
        t0 = time.monotonic()
        watched = _run([str(BIN / "prefect"), "deployment", "run", "jagg-reproduce/ci", "--watch", "--watch-timeout",
                        "300"], cluster.root, timeout=360, PREFECT_API_URL=cluster.api,
                       PREFECT_HOME=str(cluster.root / ".services/prefect"))
        took = time.monotonic() - t0
    finally:
        _patch(cluster.api, queue, {"is_paused": False})
    assert watched.returncode == 1 and "Cancelled" in watched.stdout, watched.stdout + watched.stderr
    flow_run = re.search(r"UUID: ([0-9a-f-]{36})", watched.stdout).group(1)
    states = _api(cluster.api, f"flow_run_states/?flow_run_id={flow_run}")
    assert "Late" in [st["name"] for st in states], states
    state = _state(cluster.api, flow_run)
    assert state["type"] == "CANCELLED", state
    assert "no worker of pool 'jagg' serves its queue 'default'" in state["message"], state["message"]
    assert took < 240, f"cancelled after {took:.0f} s"


def _patch(api: str, path: str, body: dict) -> None:
    req = urllib.request.Request(f"{api}/{path}", data=json.dumps(body).encode(), method="PATCH",
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).close()


def test_two_starts_of_one_sweep_name_each_keep_their_token(tmp_path):
    """Two sweeps started under one name share one MLflow parent run: each start's units still pass the check (the
    second start overwrote the first's token, and the first's units were refused as if on another store); a token
    the parent run never had is refused in one sentence."""
    from conftest import REPO
    from jagg_core.setup.params_io import load_params
    from tasks.dispatch import DispatchError, check_shared, remove_sentinel, write_sentinel

    params = load_params(REPO / "params.yaml", "ci")
    first, second = (write_sentinel(params, tmp_path, "same") for _ in range(2))
    for shared in (first, second):
        check_shared(params, tmp_path, "same", shared)
    remove_sentinel(tmp_path, first)  # the first sweep ended: its units are refused, the second's are not
    with pytest.raises(DispatchError, match="does not see the sweep's project folder"):
        check_shared(params, tmp_path, "same", first)
    check_shared(params, tmp_path, "same", second)
    forged = {**second, "token": "f" * 32, "file": second["file"].replace(".token", "-forged.token")}
    (tmp_path / forged["file"]).write_text(forged["token"] + "\n")
    with pytest.raises(DispatchError, match=r"it finds sweep 'same' without this start's token; point "
                                            r"tracking\.mlflow_uri at a server"):
        check_shared(params, tmp_path, "same", forged)


# --- The sweep's bookkeeping, fast: run_on_pool against a scripted Prefect client (the scheduling logic alone; the
# tests above run it against a real server and real workers).

class _FakePrefect:
    """``run_deployment`` and the sync client of flows/pool.py, scripted: ``outcome(unit, polls)`` gives the state of
    the flow run of ``unit`` ("train jagg-s0") at its ``polls``-th poll, None for "gone"."""

    def __init__(self, outcome):
        self.outcome, self.runs, self.cancelled, self.removed, self.crashed = outcome, {}, [], [], []

    def run_deployment(self, name, *, parameters, timeout, flow_run_name, tags, idempotency_key):
        import uuid
        from types import SimpleNamespace

        fid = uuid.uuid4()
        self.runs[str(fid)] = {"unit": flow_run_name, "polls": 0, "key": idempotency_key}
        return SimpleNamespace(id=fid)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read_flow_runs(self, flow_run_filter):
        from types import SimpleNamespace

        out = []
        for fid in [str(i) for i in flow_run_filter.id.any_]:
            run = self.runs[fid]
            run["polls"] += 1
            state = self.outcome(run["unit"], run["polls"])
            if state is not None:
                out.append(SimpleNamespace(id=fid, state=state, tags=["worker:w1"]))
        return out

    def set_flow_run_state(self, fid, state, force):
        assert force and state.name in ("Cancelling", "Crashed")
        if state.name == "Cancelling":
            self.cancelled.append(self.runs[str(fid)]["unit"])
        else:
            self.crashed.append(self.runs[str(fid)]["unit"])


def _pool_sweep(monkeypatch, outcome, parallel_runs=3):
    import flows.pool as pool
    from jagg_core.setup.params_io import load_params
    from conftest import REPO

    fake = _FakePrefect(outcome)
    monkeypatch.setattr(pool, "POLL_S", 0.0)
    monkeypatch.setattr(pool, "run_deployment", fake.run_deployment)
    monkeypatch.setattr(pool, "get_client", lambda sync_client: fake)
    monkeypatch.setattr(pool, "write_sentinel", lambda params, root, sweep: {"file": "t"})
    monkeypatch.setattr(pool, "remove_sentinel", lambda root, shared: fake.removed.append(shared["file"]))
    params = load_params(REPO / "params.yaml", "ci", {"run.methods": ["jagg", "baseline"], "run.seeds": [0]})
    kwargs = {"profile": "ci", "parallel_runs": parallel_runs, "sweep": "s", "overrides": None,
              "params_file": None, "restart": False}
    return fake, lambda: pool.run_on_pool(params, **kwargs)


def test_a_failed_unit_cancels_the_units_in_flight_and_names_them_in_one_sentence(monkeypatch):
    from prefect.states import Failed, Running

    from flows.pool import PoolError

    said = ("Flow run encountered an exception: DispatchError: worker 'stray' on h does not see the sweep's project "
            "folder (/p on head); start each worker with JAGG_ROOT set to it (docs/scaling.md).")

    def outcome(unit, polls):
        return Failed(message=said) if unit == "train jagg-s0" else Running()

    fake, sweep = _pool_sweep(monkeypatch, outcome)
    with pytest.raises(PoolError) as e:
        sweep()
    msg = str(e.value)
    assert re.fullmatch(r"train jagg-s0 ended Failed on worker 'w1' \(flow run [0-9a-f-]+\): worker 'stray' on h does "
                        r"not see the sweep's project folder \(/p on head\); start each worker with JAGG_ROOT set to "
                        r"it \(docs/scaling\.md\); the sweep stopped and cancelled the units still in flight "
                        r"\(evaluate base, train baseline-s0\): run it again to resume them\.", msg), msg
    assert sorted(fake.cancelled) == ["evaluate base", "train baseline-s0"] and fake.removed == ["t"]


def test_a_sweep_whose_units_complete_evaluates_each_training_and_cancels_nothing(monkeypatch):
    from prefect.states import Completed, Running

    fake, sweep = _pool_sweep(monkeypatch, lambda unit, polls: Completed() if polls >= 2 else Running(), 2)
    done = sweep()
    assert [(d["kind"], d["run"]) for d in done] == [
        ("evaluate", "base"), ("train", "jagg-s0"), ("evaluate", "jagg-s0"), ("train", "baseline-s0"),
        ("evaluate", "baseline-s0")]
    assert fake.cancelled == [] and fake.removed == ["t"]
    keys = [r["key"] for r in fake.runs.values()]  # one idempotency key per submission, of this start of the sweep
    sweep_key = keys[0].split("/")[0]
    assert keys == [f"{sweep_key}/{u}/0" for u in ("evaluate base", "train jagg-s0", "evaluate jagg-s0",
                                                   "train baseline-s0", "evaluate baseline-s0")]


def test_a_unit_crashed_too_often_or_gone_from_the_server_fails_the_sweep(monkeypatch):
    from prefect.states import Crashed, Running

    from flows.pool import PoolError

    fake, sweep = _pool_sweep(monkeypatch, lambda unit, polls: Crashed(message="no heartbeat")
                              if unit == "evaluate base" else Running())
    with pytest.raises(PoolError, match=r"^evaluate base ended Crashed on worker 'w1' .*: no heartbeat; the sweep "
                                        r"stopped and cancelled the units still in flight \(train jagg-s0, train "
                                        r"baseline-s0\)"):
        sweep()  # an evaluation is submitted again once, then its second crash ends the sweep
    again = [r["key"] for r in fake.runs.values() if r["unit"] == "evaluate base"]
    assert [k.split("/", 1)[1] for k in again] == ["evaluate base/0", "evaluate base/1"]  # another key: a new run

    fake, sweep = _pool_sweep(monkeypatch, lambda unit, polls: None if unit == "train jagg-s0" else Running())
    with pytest.raises(PoolError, match=r"^train jagg-s0: its flow run [0-9a-f-]+ is gone from the Prefect server "
                                        r"\(deleted\?\); the sweep stopped and cancelled"):
        sweep()
    assert sorted(fake.cancelled) == ["evaluate base", "train baseline-s0"]


def test_a_unit_taken_but_never_started_is_crashed_after_a_while_and_submitted_again(monkeypatch):
    """A unit that stays PENDING (a worker took it, then died before its process started: no heartbeat ever comes,
    so Prefect's automation never marks it) waited for ever; after PENDING_S the sweep marks it CRASHED and submits
    it again, as a crash."""
    import flows.pool as pool
    from prefect.states import Pending, Running

    from flows.pool import PoolError

    monkeypatch.setattr(pool, "PENDING_S", 0.0)
    fake, sweep = _pool_sweep(monkeypatch, lambda unit, polls: Pending() if unit == "evaluate base" else Running())
    with pytest.raises(PoolError, match=r"^evaluate base ended Crashed on worker 'w1' \(flow run [0-9a-f-]+\): taken "
                                        r"by worker 'w1' but not started in 0 s: the worker died before it started; "
                                        r"the sweep stopped"):
        sweep()
    assert fake.crashed == ["evaluate base", "evaluate base"]  # crashed, submitted again once, crashed again


def test_services_down_on_a_worker_host_leaves_the_heads_services_and_their_record(tmp_path, monkeypatch, capsys):
    """.services/ is in the shared project folder: `jagg services down` on a GPU host stops that host's workers and
    neither stops nor forgets the head's servers (their pids.json names the head)."""
    import subprocess
    import sys

    import tasks.services as services

    monkeypatch.setattr(services, "STATE", tmp_path)
    head = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        services._write_pids({"server": head.pid})
        record = json.loads((tmp_path / "pids.json").read_text())
        assert record["host"] == socket.gethostname()
        (tmp_path / "pids.json").write_text(json.dumps({**record, "host": "head-node"}))
        services.down()
        assert "run on head-node; `jagg services down` there stops them" in capsys.readouterr().out
        assert head.poll() is None and json.loads((tmp_path / "pids.json").read_text())["host"] == "head-node"
        (tmp_path / "pids.json").write_text(json.dumps(record))  # on the head itself: stopped and forgotten
        services.down()
        assert head.wait(timeout=20) is not None and not (tmp_path / "pids.json").exists()
    finally:
        head.kill()
        head.wait()


def test_a_worker_that_exits_or_stays_silent_as_it_starts_is_one_sentence(tmp_path, monkeypatch):
    """`jagg services worker` returns once its worker has reported to the server (a heartbeat newer than the last one
    of a worker of that name); a worker process that exits at once, or never reports, is one sentence naming its
    log, where it used to be said started."""
    import subprocess
    import sys

    import tasks.services as services

    monkeypatch.setattr(services, "STATE", tmp_path)
    beats = iter([None, None, "2026-12-04T20:00:00Z"])
    monkeypatch.setattr(services, "_heartbeat", lambda api, pool, name: next(beats))
    monkeypatch.setattr(services.time, "sleep", lambda s: None)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        services._wait_worker("http://api", "jagg", "host-a", alive.pid, "worker-host-a.log", None)  # third poll
        monkeypatch.setattr(services, "_heartbeat", lambda api, pool, name: "2026-12-04T19:00:00Z")  # an old one
        monkeypatch.setattr(services, "WORKER_START_S", 0.5)
        with pytest.raises(services.ServiceError, match=r"^worker 'host-a' did not report to the Prefect server at "
                                                          r"http://api within 0 s; see .*worker-host-a\.log\.$"):
            services._wait_worker("http://api", "jagg", "host-a", alive.pid, "worker-host-a.log",
                                  "2026-12-04T19:00:00Z")
    finally:
        alive.kill()
        alive.wait()
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    dead.wait()
    with pytest.raises(services.ServiceError, match=r"^worker 'host-a' of pool 'jagg' exited as it started; see "):
        services._wait_worker("http://api", "jagg", "host-a", dead.pid, "worker-host-a.log", None)
