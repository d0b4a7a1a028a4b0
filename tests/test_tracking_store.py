"""The MLflow store (jagg_core/pipeline/tracking.py): one that cannot be used is one sentence before any training;
transient failures are retried; through an outage what a run logs is buffered on disk (mlflow-pending.jsonl) and
replayed, a damaged buffer record skipped with one warning; several processes share a SQLite store; a SQLite store's
artifacts go beside it."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_module
from fault_helpers import PARAMS, _MlflowServer, _one_sentence, _tracker, ci
from jagg_core.setup.params_io import load_params
from jagg_core.setup.paths import Layout
from jagg_core.trainer import train


# --- a store that cannot be used: one sentence before any training -------------------------------------------------


def test_an_unreachable_tracking_store_fails_before_training(ci_project):
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--set",
                     "tracking.mlflow_uri=http://127.0.0.1:9", "--set", "tracking.retries=1", root=ci_project)
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("jagg: error:")]
    assert len(lines) == 1 and "MLflow store http://127.0.0.1:9 cannot" in lines[0]
    assert not Layout(ci_project, "ci").checkpoints("jagg-s0").exists()  # nothing started


@pytest.mark.parametrize("damage", ["corrupt", "folder", "locked"])
def test_a_damaged_tracking_store_is_one_sentence_naming_it_and_the_fix(ci_project, damage):
    """A SQLite store that is garbage, a folder, or held by another process's ``BEGIN EXCLUSIVE``: one sentence
    naming the store and the fix, before any training (it was an 80–186-line SQLAlchemy traceback)."""
    import sqlite3

    db = ci_project / "store.db"
    holder = None
    if damage == "corrupt":
        db.write_bytes(b"this is not a database\n" * 300)
    elif damage == "folder":
        db.mkdir()
    else:
        sqlite3.connect(db).execute("create table t (x)").connection.commit()
        holder = subprocess.Popen([sys.executable, "-c", f"import sqlite3, sys, time\n"
                                   f"c = sqlite3.connect({str(db)!r}, isolation_level=None)\n"
                                   f"c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); time.sleep(120)"],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
    try:
        out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--set",
                         f"tracking.mlflow_uri=sqlite:///{db}", "--set", "tracking.retries=0", root=ci_project,
                         timeout=180)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and "WARNING" not in ln and "retrying" not in ln]
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    fix = {"corrupt": "move it aside", "folder": "move it aside", "locked": "another process holds it locked"}[damage]
    assert lines[0].startswith(f"jagg: error: the MLflow store {db}") and fix in lines[0], lines[0]
    assert not Layout(ci_project, "ci").checkpoints("jagg-s0").exists()  # nothing started


def test_a_held_store_lock_is_one_sentence_after_its_deadline_naming_the_lock_and_its_holder(ci_project):
    """Another process holding ``mlflow.db.lock`` (a stuck stage opening the store): ``jagg evaluate`` waited for ever,
    silently, in ``flock``; now it waits ``tracking.lock_wait_s``, then one sentence naming the lock file and the
    process holding it, rc 1, nothing written."""
    lock = ci_project / "mlflow.db.lock"
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl, os, time\n"
                               f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
                               f"fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = sorted(p.relative_to(ci_project) for p in ci_project.rglob("*"))
        out = run_module("tasks.evaluate", "--profile", "ci", "--run", "base", "--set", "tracking.lock_wait_s=1",
                         root=ci_project, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("jagg: error: the MLflow store") and str(lock) in lines[0], lines[0]
    assert f"process {holder.pid} has held" in lines[0] and f"kill {holder.pid}" in lines[0], lines[0]
    assert sorted(p.relative_to(ci_project) for p in ci_project.rglob("*")) == before  # nothing written


# --- failures while training: retried, buffered on disk, replayed --------------------------------------------------


def test_transient_tracking_failures_are_retried_and_the_curve_stays_complete(ci_project, monkeypatch):
    from jagg_core.pipeline.tracking import Tracker

    params = ci(ci_project, **{"train.iterations": 2, "tracking.retries": 3})
    tracker = Tracker(params, ci_project)
    run_id = tracker.child_run("t", "jagg-s0", method="jagg", seed=0, key="k")
    real = tracker.client.log_batch
    failures = {"n": 0}

    def flaky(*a, **k):
        if failures["n"] < 2:
            failures["n"] += 1
            raise ConnectionError("injected: store busy")
        return real(*a, **k)

    monkeypatch.setattr(tracker.client, "log_batch", flaky)
    train(params, "jagg", 0, root=ci_project, progress=False, logger=tracker.logger(run_id))
    assert failures["n"] == 2
    history = tracker.client.get_metric_history(run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2]
    assert len((Layout(ci_project, "ci").curve("jagg-s0")).read_text().splitlines()) == 3
    # The diagnostics practitioners watch, read back from the store (this run's, no other training): the KL to the
    # reference at beta 0, and per reward the within-group spread and the share of groups with no spread.
    assert params.train.beta == 0 and params.train.kl_ref
    for key in ("train/kl_ref", "reward/jpeg_compressibility/group_std", "reward/jpeg_compressibility/zero_std_frac"):
        values = {m.step: m.value for m in tracker.client.get_metric_history(run_id, key)}
        assert sorted(values) == [1, 2] and all(math.isfinite(v) for v in values.values()), key
    kl = {m.step: m.value for m in tracker.client.get_metric_history(run_id, "train/kl_ref")}
    assert kl[1] <= 1e-12 < kl[2]  # the policy is the reference until its first optimizer step (rounding aside)
    assert all(0 <= m.value <= 1 for m in tracker.client.get_metric_history(
        run_id, "reward/jpeg_compressibility/zero_std_frac"))


@pytest.mark.slow  # launched training runs beside live servers (20-50 s)
def test_a_store_that_goes_down_mid_run_does_not_stop_training_and_gets_everything(ci_project, caplog):
    """A real MLflow server stops after iteration 2 and comes back at iteration 5: training never stops, what it
    logged meanwhile (metrics and images) is buffered on disk and replayed, in order, to the same run."""
    from jagg_core.pipeline.tracking import MlflowLogger, Tracker

    server = _MlflowServer(ci_project)
    server.start()
    try:
        params = ci(ci_project, **{"train.iterations": 6, "tracking.mlflow_uri": server.url, "tracking.retries": 1,
                                   "train.log_images_every": 1})
        tracker = Tracker(params, ci_project)
        run_id = tracker.child_run("outage", "jagg-s0", method="jagg", seed=0, key="k")
        buffer = ci_project / "runs/ci/jagg-s0/mlflow-pending.jsonl"
        logger = MlflowLogger(tracker, run_id, buffer, probe_seconds=0.2)
        seen: dict[str, int] = {}

        class Outage:  # the trainer's logger, with the server switched off and on between iterations
            def log_metrics(self, metrics, step):
                if step == 3 and "down" not in seen:
                    server.stop()
                    seen["down"] = step
                if step == 5 and "up" not in seen:
                    seen["buffered"] = logger.pending()
                    server.start()
                    seen["up"] = step
                logger.log_metrics(metrics, step)

            def log_image(self, image, key, step):
                logger.log_image(image, key, step)

        with caplog.at_level("WARNING", logger="jagg_core.pipeline.tracking"):
            result = train(params, "jagg", 0, root=ci_project, progress=False, logger=Outage())
        assert result.iterations == 6 and seen["buffered"] >= 2  # trained to the end; iterations 3-4 were buffered
        assert logger.pending() == 0 and not buffer.exists()  # all replayed
        history = Tracker(params, ci_project).client.get_metric_history(run_id, "reward/mean")
        assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]
        images = {a.path for a in Tracker(params, ci_project).client.list_artifacts(run_id, "images")}
        assert images  # the buffered image grids arrived too
        assert any("Training goes on" in r.getMessage() for r in caplog.records)
        assert any("the store is back" in r.getMessage() for r in caplog.records)
    finally:
        if server.proc and server.proc.poll() is None:
            server.stop()


def test_c5_a_torn_line_in_the_offline_metrics_buffer_is_skipped_not_a_traceback(tmp_path, caplog):
    """A run killed while appending to `mlflow-pending.jsonl` leaves a torn last line: replaying it was a
    JSONDecodeError traceback that marked the trained run FAILED. The whole records are sent, the torn one is named
    in a warning."""
    import json

    from jagg_core.pipeline.tracking import MlflowLogger, Tracker

    params = load_params(PARAMS, "ci", {"tracking.mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db"})
    tracker = Tracker(params, tmp_path)
    run_id = tracker.child_run("torn", "jagg-s0", method="jagg", seed=0, key="k")
    buffer = tmp_path / "runs" / "mlflow-pending.jsonl"
    buffer.parent.mkdir(parents=True)
    good = {"kind": "metrics", "run_id": run_id, "step": 1, "time": 1, "metrics": {"reward/mean": 0.5}}
    buffer.write_text(json.dumps(good) + "\n" + json.dumps({**good, "step": 2})[:25])
    logger = MlflowLogger(tracker, run_id, buffer)
    assert logger.pending() == 1
    assert logger.flush() == 1
    assert not buffer.exists()
    history = tracker.client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5)]
    assert any("line 2 is not a whole record" in r.getMessage() for r in caplog.records)


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
        logger = tracker.logger(run_id, buffer=buffer, once=True)  # the launcher's, as tasks.train makes it
        _replay_pending(logger, "jagg-s0", logging.getLogger("jagg.train"))
    said = [r.getMessage() for r in caplog.records if "not a whole record" in r.getMessage()]
    assert len(said) == 1, said
    assert not buffer.exists()
    assert [m.value for m in tracker.client.get_metric_history(run_id, "reward/mean")] == [0.5]
    tracker.finish(run_id)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A Tracker on a SQLite store of its own (one per module: creating one costs seconds)."""
    from jagg_core.pipeline.tracking import Tracker

    root = tmp_path_factory.mktemp("r6-store")
    params = load_params(PARAMS, "ci", {"tracking.mlflow_uri": f"sqlite:///{root}/mlflow.db"})
    elsewhere = tmp_path_factory.mktemp("r6-working-folder")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(elsewhere)  # a stage started from another folder: MLflow's default would put ./mlruns here
        tracker = Tracker(params, root)
        tracker.experiment_id
        yield tracker, root
    assert not any(elsewhere.iterdir()), sorted(p.name for p in elsewhere.iterdir())


def _buffer_with_image(store, name: str, file: str) -> tuple:
    """A run and its pending buffer: an image record naming ``file``, then a metrics record."""
    from jagg_core.pipeline.tracking import MlflowLogger

    tracker, root = store
    run_id = tracker.child_run(name, "jagg-s0", method="jagg", seed=0, key=name)
    buffer = root / name / "mlflow-pending.jsonl"
    (buffer.parent / "mlflow-pending-images").mkdir(parents=True)
    image = {"kind": "image", "run_id": run_id, "key": "test/images", "step": 1, "file": file}
    metrics = {"kind": "metrics", "run_id": run_id, "step": 1, "time": 1, "metrics": {"reward/mean": 0.5}}
    buffer.write_text(json.dumps(image) + "\n" + json.dumps(metrics) + "\n")
    return MlflowLogger(tracker, run_id, buffer), run_id, buffer


def _sent_metrics(tracker, run_id) -> list:
    return [(m.step, m.value) for m in tracker.client.get_metric_history(run_id, "reward/mean")]


def test_m2_a_buffered_image_whose_file_is_gone_is_skipped_and_the_records_after_it_are_sent(store, caplog):
    """A pending image record whose file is gone (the images folder cleaned, a copy of the buffer alone) made every
    later flush — every rerun of `train` — fail, stranding the records after it. Now it is skipped with one
    warning, and the rest reach the store."""
    logger, run_id, buffer = _buffer_with_image(store, "gone", "mlflow-pending-images/test_images-000001-1.png")
    assert logger.flush() == 2
    assert not buffer.exists() and _sent_metrics(store[0], run_id) == [(1, 0.5)]
    said = [r.getMessage() for r in caplog.records if "test_images-000001-1.png" in r.getMessage()]
    assert len(said) == 1 and "does not exist" in _one_sentence(said[0]), said


def test_m2_a_buffered_image_file_that_is_not_an_image_is_one_warning(store, caplog):
    """A pending image record whose file is not an image was a PIL traceback (UnidentifiedImageError) on every
    flush. Now one warning naming it; the records after it are sent."""
    logger, run_id, buffer = _buffer_with_image(store, "garbage", "mlflow-pending-images/x.png")
    (buffer.parent / "mlflow-pending-images" / "x.png").write_bytes(b"not a png at all")
    assert logger.flush() == 2
    assert not buffer.exists() and _sent_metrics(store[0], run_id) == [(1, 0.5)]
    said = [r.getMessage() for r in caplog.records if "x.png" in r.getMessage()]
    assert len(said) == 1 and "is not an image" in _one_sentence(said[0]), said


def test_m2_a_buffered_image_outside_its_folder_is_not_uploaded(store, caplog, tmp_path):
    """A pending image record naming an absolute path outside the project (or `../` out of the buffer's images
    folder) uploaded that file to the run. Now only the buffer's own images folder is read: the record is skipped
    with a warning and nothing is uploaded."""
    from PIL import Image

    secret = tmp_path / "secret.png"
    Image.new("RGB", (8, 8), (1, 2, 3)).save(secret)
    for name, file in (("abs", str(secret)), ("dotdot", f"mlflow-pending-images/../../{secret.name}")):
        if name == "dotdot":
            shutil.copy(secret, store[1] / secret.name)
        logger, run_id, buffer = _buffer_with_image(store, name, file)
        assert logger.flush() == 2
        assert _sent_metrics(store[0], run_id) == [(1, 0.5)]
        assert store[0].client.list_artifacts(run_id) == [], name  # no image of the run at all
        said = [r.getMessage() for r in caplog.records if "outside its images folder" in r.getMessage()]
        assert said and _one_sentence(said[-1]), said


def _one_life(logger, steps) -> None:
    """What a training logs per iteration: its metrics, a rollout image, then its timings."""
    from PIL import Image

    for step in steps:
        logger.log_metrics({"reward/mean": step / 10, "train/loss": -step / 100}, step)
        logger.log_image(Image.new("RGB", (8, 8), (step, 0, 0)), "rollout", step)
        logger.log_metrics({"time/iteration": 0.5}, step)


def _steps(tracker, run_id) -> dict[str, list[int]]:
    """Each metric's steps in MLflow's history, and the steps of the run's rollout images."""
    import re

    steps = {k: sorted(m.step for m in tracker.client.get_metric_history(run_id, k))
             for k in ("reward/mean", "train/loss", "time/iteration")}
    steps["rollout images"] = sorted(int(re.search(r"\+step\+(\d+)\+", a.path)[1])
                                     for a in tracker.client.list_artifacts(run_id, "images")
                                     if a.path.endswith(".png"))
    return steps


def test_m5_a_resumed_training_logs_each_step_its_mlflow_run_holds_once(store):
    """A training killed after iteration 3 resumes from its checkpoint of iteration 1 and logs iterations 2 and 3
    again (the same values: it resumes bit-identically) into the same MLflow run: their points were in MLflow's
    history twice (`reward/mean` at step 3 twice, a history longer than the iterations). Now the steps the run holds
    are not logged again — and a point the pending buffer held when the store was down before the kill reaches the
    store once, as does one a kill cut between its replay and the buffer's removal."""
    tracker, root = store
    for case in ("store up", "store down before the kill", "killed in the replay"):
        name = "resumed-" + case.replace(" ", "-")
        run_id = tracker.child_run(name, "jagg-s0", method="jagg", seed=0, key=name)
        buffer = root / name / "mlflow-pending.jsonl"  # where tasks/train.py:pending_file puts a run's
        first = tracker.logger(run_id, buffer, once=True)  # as tasks/train.py:worker makes a training's
        _one_life(first, [1])
        if case != "store up":  # the store unreachable from iteration 2: the logger buffers
            first._offline, first._offline_until = True, float("inf")
        _one_life(first, [2, 3])
        if case == "killed in the replay":  # the replay sent everything, the kill came before the buffer's removal
            kept = buffer.read_bytes(), {p.name: p.read_bytes() for p in (root / name).glob("*-images/*")}
            assert first.flush() == 6
            buffer.write_bytes(kept[0])
            for file, data in kept[1].items():
                (root / name / "mlflow-pending-images").mkdir(exist_ok=True)
                (root / name / "mlflow-pending-images" / file).write_bytes(data)
        assert _steps(tracker, run_id)["reward/mean"] == ([1] if case == "store down before the kill" else [1, 2, 3])
        # killed; resumed from the checkpoint of iteration 1: iterations 2 to 4, with the store up
        _one_life(tracker.logger(run_id, buffer, once=True), [2, 3, 4])
        assert not buffer.exists(), case
        assert _steps(tracker, run_id) == {k: [1, 2, 3, 4] for k in ("reward/mean", "train/loss", "time/iteration",
                                                                     "rollout images")}, case
        values = [(m.step, m.value) for m in tracker.client.get_metric_history(run_id, "reward/mean")]
        assert sorted(values) == [(s, s / 10) for s in (1, 2, 3, 4)], case
        tracker.finish(run_id)


def test_a_workers_record_stream_reaches_its_run_as_it_grows_once_and_in_order(store, caplog):
    """A training's worker imports no MLflow: it appends what it logs (metrics, image grids, a rollout's GIF) to the
    run's record stream, and its launcher sends it (tasks/train.py). The launcher reads the stream as it grows (a line
    being written is read whole next time), sends each record to the run that logged it (a stopped start's stream,
    sent by the next start), each step once where the run holds it already (a resumed training logs its last steps
    again), skips a record naming a file outside the stream's folder with a warning, and removes the stream and its
    files when it closes."""
    from jagg_core.pipeline.tracking import RecordStream, StreamForwarder

    tracker, root = store
    run_id = tracker.child_run("streamed", "jagg-s0", method="jagg", seed=0, key="streamed")
    before = tracker.child_run("streamed-before", "jagg-s0", method="jagg", seed=0, key="streamed-before")
    stream = root / "streamed" / "mlflow-stream.jsonl"
    stream.parent.mkdir()
    RecordStream(stream, before).log_metrics({"reward/mean": 0.7}, 7)  # a stopped start's, for its own run
    worker = RecordStream(stream, run_id)
    forwarder = StreamForwarder(tracker.logger(run_id, root / "streamed" / "mlflow-pending.jsonl", once=True), stream)
    _one_life(worker, [1])
    worker.log_artifact_bytes(b"GIF89a-not-really", "rollout/step_000001.gif")
    with open(stream, "ab") as f:  # a record being written: half of it now
        f.write(b'{"kind": "metrics", "run_id": "' + run_id.encode() + b'", "step": 2, ')
    assert forwarder.forward() == 5
    assert _steps(tracker, run_id)["reward/mean"] == [1] and _sent_metrics(tracker, before) == [(7, 0.7)]
    with open(stream, "ab") as f:  # ... and the rest of it
        f.write(b'"time": 2, "metrics": {"reward/mean": 0.2}}\n')
    _one_life(worker, [1, 2, 3])  # resumed from before step 1: its steps 1 and 2 are held (or sent) already
    with open(stream, "ab") as f:
        f.write(json.dumps({"kind": "image", "run_id": run_id, "key": "rollout", "step": 9,
                            "file": "/etc/hostname"}).encode() + b"\n")
    assert forwarder.close() == 11 and not stream.exists() and not (stream.parent / "mlflow-stream-files").exists()
    assert _steps(tracker, run_id) == {k: [1, 2, 3] for k in ("reward/mean", "train/loss", "time/iteration",
                                                             "rollout images")}
    assert sorted(_sent_metrics(tracker, run_id)) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [a.path for a in tracker.client.list_artifacts(run_id, "rollout")] == ["rollout/step_000001.gif"]
    said = [r.getMessage() for r in caplog.records if "/etc/hostname" in r.getMessage()]
    assert len(said) == 1 and "outside its images folder" in _one_sentence(said[0]), said
    for r in (run_id, before):
        tracker.finish(r)


def test_a_failed_worker_s_records_reach_its_run_and_an_interrupt_leaves_them_for_the_next_start(store):
    """While the launcher waits for its worker, a thread sends the stream every ``poll`` seconds. A worker that fails
    (the block raises an error) still has everything it logged before sent; Ctrl-C or SIGTERM (a KeyboardInterrupt)
    ends the launcher at once, leaving the stream to the next start, which sends it before it trains."""
    from jagg_core.pipeline.tracking import RecordStream, StreamForwarder

    tracker, root = store
    for case, stop in (("failed", ValueError("a worker's own error")), ("interrupted", KeyboardInterrupt())):
        run_id = tracker.child_run(f"stream-{case}", "jagg-s0", method="jagg", seed=0, key=f"stream-{case}")
        stream = root / f"stream-{case}" / "mlflow-stream.jsonl"
        stream.parent.mkdir()
        forwarder = StreamForwarder(tracker.logger(run_id, stream.parent / "mlflow-pending.jsonl", once=True), stream,
                                    poll=3600)  # no poll in the block
        with pytest.raises(type(stop)):
            with forwarder.running():
                _one_life(RecordStream(stream, run_id), [1, 2])
                raise stop
        if case == "failed":
            assert _steps(tracker, run_id)["reward/mean"] == [1, 2] and not stream.exists()
        else:
            assert _steps(tracker, run_id)["reward/mean"] == [] and stream.exists()
            again = StreamForwarder(tracker.logger(run_id, stream.parent / "mlflow-pending.jsonl", once=True), stream)
            assert again.close() == 6 and not stream.exists()
            assert _steps(tracker, run_id)["reward/mean"] == [1, 2]
        tracker.finish(run_id)


# --- one store, several processes; its artifacts beside it ---------------------------------------------------------


def _log_many(args):
    uri, root, k = args
    from jagg_core.setup.params_io import load_params as lp
    from jagg_core.pipeline.tracking import Tracker

    params = lp(Path(root) / "params.yaml", "ci", {"tracking.mlflow_uri": uri, "tracking.retries": 10})
    tr = Tracker(params, root)
    run_id = tr.child_run("concurrent", f"w{k}", method=None, seed=None, key=f"k{k}")
    lg = tr.logger(run_id)
    for step in range(30):
        lg.log_metrics({"x": float(step), "y": float(k)}, step)
    return run_id


@pytest.mark.slow  # launched training runs beside live servers (20-50 s)
def test_several_processes_write_one_sqlite_store_without_losing_metrics(ci_project):
    import multiprocessing as mp

    from jagg_core.pipeline.tracking import Tracker

    uri = f"sqlite:///{ci_project / 'mlflow.db'}"
    params = ci(ci_project, **{"tracking.mlflow_uri": uri})
    # A fresh store: the four processes race to create the database and the experiment.
    with mp.get_context("spawn").Pool(4) as pool:
        ids = pool.map(_log_many, [(uri, str(ci_project), k) for k in range(4)])
    client = Tracker(params, ci_project).client
    for run_id in ids:
        assert len(client.get_metric_history(run_id, "x")) == 30


def test_m1_a_sqlite_stores_artifacts_go_beside_it_not_into_the_working_folder(store, tmp_path):
    tracker, root = store
    run_id = tracker.child_run("artifacts", "jagg-s0", method="jagg", seed=0, key="artifacts")
    (tmp_path / "note.txt").write_text("kept")
    tracker.log_artifact(run_id, tmp_path / "note.txt", "notes")
    kept = list((root / "mlruns").rglob("note.txt"))
    assert [p.read_text() for p in kept] == ["kept"] and kept[0].parent.name == "notes", kept
    location = tracker.client.get_experiment(tracker.experiment_id).artifact_location
    assert location == (root / "mlruns" / "jagg-ci").as_uri(), location
