"""The fault matrix of docs/reliability.md: faults survived, bad inputs refused, nothing lost."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, WORKER_ARGS, run_module
from tasks.common import free_port
from jagg_core.setup.params_io import load_params
from jagg_core.setup.paths import Layout
from jagg_core.trainer import CheckpointError, TrainingError, latest_checkpoint, list_checkpoints, train
from jagg_core.trainer.checkpoint import load_tensors, save_checkpoint

JPEG = {"reward.weights": {"jpeg_compressibility": 1.0}}


def ci(root, **overrides):
    return load_params(root / "params.yaml", "ci", {**JPEG, **overrides})


# --- damaged checkpoints -----------------------------------------------------------------------------------------


def _ckpts(root, run="jagg-s0"):
    return Layout(root, "ci").checkpoints(run)


@pytest.mark.parametrize("damage", ["truncate", "alter", "no-manifest"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(ci_project, damage, caplog):
    params = ci(ci_project, **{"train.iterations": 2, "train.checkpoint_every": 1})
    train(params, "jagg", 0, root=ci_project, progress=False)
    last = _ckpts(ci_project) / "checkpoint-000002"
    f = last / "trainable.safetensors"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "alter":
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    else:
        (last / "manifest.json").unlink()
    with caplog.at_level("WARNING"):
        found = latest_checkpoint(_ckpts(ci_project))
    assert found is not None and found.iteration == 1
    assert "damaged checkpoint" in caplog.text
    # training resumes from the good one and rewrites iteration 2
    res = train(params, "jagg", 0, root=ci_project, progress=False)
    assert [h["iteration"] for h in res.history] == [2]
    assert latest_checkpoint(_ckpts(ci_project)).iteration == 2


def test_a_writer_killed_mid_swap_leaves_nothing_lost_or_stale(ci_project, caplog):
    """A kill between the swap's two renames leaves the only copy of a checkpoint in ``.trash-*``; a kill mid-write
    leaves ``.tmp-*``. The next start puts the copy back, deletes the partial write, and resumes from the former."""
    import os as _os

    params = ci(ci_project, **{"train.iterations": 2, "train.checkpoint_every": 1, "train.keep_checkpoints": 5})
    train(params, "jagg", 0, root=ci_project, progress=False)
    root = _ckpts(ci_project)
    _os.replace(root / "checkpoint-000002", root / ".trash-checkpoint-000002-4242")  # swap killed after rename 1
    partial = root / ".tmp-checkpoint-000003-x1y2"
    partial.mkdir()
    (partial / "trainable.safetensors").write_bytes(b"half")
    spare = root / ".trash-checkpoint-000001-77"  # a finished swap whose trash was never deleted
    shutil.copytree(root / "checkpoint-000001", spare)
    with caplog.at_level("WARNING"):
        res = train(params, "jagg", 0, root=ci_project, progress=False)
    assert not res.history  # already at iteration 2: nothing to redo
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-000001", "checkpoint-000002"]
    assert latest_checkpoint(root).iteration == 2
    assert "restored checkpoint-000002" in caplog.text and "deleted the interrupted write" in caplog.text


def test_no_usable_checkpoint_is_a_clear_error_not_a_silent_restart(ci_project):
    params = ci(ci_project, **{"train.iterations": 1})
    train(params, "jagg", 0, root=ci_project, progress=False)
    (_ckpts(ci_project) / "checkpoint-000001" / "optimizer.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        train(params, "jagg", 0, root=ci_project, progress=False)


# --- numerical faults --------------------------------------------------------------------------------------------


def test_non_finite_rewards_skip_updates_then_stop_the_run(ci_project, monkeypatch):
    params = ci(ci_project, **{"train.iterations": 5, "train.checkpoint_every": 1, "train.max_consecutive_skips": 2})
    monkeypatch.setenv("JAGG_FAULT", "reward@2:nan,reward@4:nan,reward@5:nan")
    with pytest.raises(TrainingError, match="2 consecutive updates were skipped"):
        train(params, "jagg", 0, root=ci_project, progress=False)
    curve = (Layout(ci_project, "ci").curve("jagg-s0")).read_text().splitlines()
    head = curve[0].split("\t")
    skipped = [float(r.split("\t")[head.index("train/skipped_updates")]) for r in curve[1:]]
    assert skipped == [0, 1, 0, 1, 1]
    # iteration 2's update was skipped: its weights equal iteration 1's; no NaN was ever saved
    a = load_tensors(_ckpts(ci_project) / "checkpoint-000001/trainable.safetensors")
    b = load_tensors(_ckpts(ci_project) / "checkpoint-000002/trainable.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    for c in list_checkpoints(_ckpts(ci_project)):
        assert all(torch.isfinite(t).all() for t in c.tensors().values())


def test_a_non_finite_gradient_skips_the_update(ci_project, monkeypatch):
    params = ci(ci_project, **{"train.iterations": 2, "train.checkpoint_every": 1})
    monkeypatch.setenv("JAGG_FAULT", "update@2:nan")  # a NaN in one gradient entry after iteration 2's backward
    res = train(params, "jagg", 0, root=ci_project, progress=False)
    assert [h["train/skipped_updates"] for h in res.history] == [0, 1]  # found by the real isfinite(grad norm)
    one, two = (load_tensors(_ckpts(ci_project) / f"checkpoint-00000{i}/trainable.safetensors") for i in (1, 2))
    assert all(torch.equal(one[k], two[k]) for k in one)  # the step was not taken: no NaN reached the weights


def test_nan_weights_are_never_saved(tmp_path):
    with pytest.raises(CheckpointError, match="not finite"):
        save_checkpoint(tmp_path, 1, trainable={"w": torch.tensor([1.0, float("nan")])}, optimizer=None, state={})
    assert list(tmp_path.iterdir()) == []


# --- disk full ---------------------------------------------------------------------------------------------------


def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(ci_project, monkeypatch):
    params = ci(ci_project, **{"train.iterations": 2, "train.checkpoint_every": 1})
    monkeypatch.setenv("JAGG_FAULT", "checkpoint@2:oserror")
    with pytest.raises(CheckpointError, match="No space left on device.*earlier checkpoints are intact"):
        train(params, "jagg", 0, root=ci_project, progress=False)
    root = _ckpts(ci_project)
    assert [c.iteration for c in list_checkpoints(root)] == [1]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]  # no half-written folder left


@pytest.mark.slow
def test_a_real_full_filesystem(ci_project, tmp_path):
    """A 1 MiB tmpfs as the checkpoint folder (needs root to mount; skipped elsewhere)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a size-limited tmpfs here (not root); the injected ENOSPC test covers the logic")
    try:
        target = _ckpts(ci_project)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(mnt)
        params = ci(ci_project, **{"train.iterations": 1})
        with pytest.raises(CheckpointError, match="No space left on device"):
            train(params, "jagg", 0, root=ci_project, progress=False)
        assert not list(mnt.iterdir())
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


# --- tracking store ----------------------------------------------------------------------------------------------


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



class _MlflowServer:
    """A real `mlflow server` on a sqlite store, that a test can stop and start again on the same port."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import time
        import urllib.request

        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}", "--workers", "1"],
            cwd=self.root, env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise AssertionError("the MLflow server did not start")

    def stop(self) -> None:
        import signal

        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=60)


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


# --- bad inputs --------------------------------------------------------------------------------------------------


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("override,fragment", [
    ("run.methods=[baseline, fast]", "run.methods names 'fast'"),
    ("methods.jagg.mode=fast", "methods.jagg.mode = 'fast' is invalid"),
    ("jagg.jagg_frac=-0.1", "jagg_frac must be a number in [0, 1] or 'auto'"),
    ("jagg.anchors=5", "anchors (5) cannot exceed the window (3)"),
    ("sample.group_size=1", "sample.group_size = 1 is invalid"),
    ("train.lr=-1", "train.lr = -1 is invalid"),
    ("eval.metrics=[fid]", "unknown metric 'fid'"),
    ("model.lora={rank: two}", "model.lora.rank = 'two' is invalid"),
])
def test_bad_params_are_refused_before_any_work(ci_project, override, fragment):
    before = _files(ci_project)
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--set", override, root=ci_project)
    assert out.returncode == 1, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], out.stderr
    assert _files(ci_project) == before


def test_an_unknown_method_or_profile_is_refused(ci_project):
    for args, fragment in ([("--method", "fast"), "unknown method 'fast'"], [("--profile", "nope", "--method", "jagg"),
                                                                             "unknown profile 'nope'"]):
        out = run_module("tasks.train", *(args if args[0] == "--profile" else ("--profile", "ci", *args)),
                         root=ci_project)
        assert out.returncode == 1 and fragment in out.stderr, out.stderr


@pytest.mark.parametrize("content,fragment", [
    ("{not json", "is not valid JSON"),
    ('{"a": 1}', "must hold a non-empty JSON list of prompt strings"),
    ("[]", "must hold a non-empty JSON list of prompt strings"),
    ('["ok", 3]', "must hold a non-empty JSON list of prompt strings"),
])
def test_bad_prompt_files_are_refused_and_nothing_is_written(ci_project, content, fragment):
    (ci_project / "data/ci/prompts/benchmark/single.json").write_text(content)
    out = run_module("tasks.evaluate", "--profile", "ci", "--run", "base", root=ci_project)
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("jagg: error:")]
    assert len(lines) == 1 and fragment in lines[0], out.stderr
    assert not (ci_project / "eval").exists()


def test_style_names_cannot_escape_the_output_folder(tmp_path):
    from jagg_core.evaluation import load_hps_benchmark

    (tmp_path / "benchmark").mkdir()
    for style in ("../evil", "a/b", "..", "UPPER"):
        with pytest.raises(ValueError, match="style name"):
            load_hps_benchmark(tmp_path, styles=[style])


def test_missing_or_incomplete_model_weights_are_one_sentence(ci_project):
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--set", "model.path=/nowhere",
                     root=ci_project)
    assert out.returncode == 1 and "the toy-flux model folder /nowhere does not exist" in out.stderr, out.stderr
    shutil.rmtree(ci_project / "models/ci/base/transformer")
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", root=ci_project)
    assert out.returncode == 1 and "transformer/config.json is missing" in out.stderr, out.stderr
    assert not Layout(ci_project, "ci").checkpoints("jagg-s0").exists()


# --- security ----------------------------------------------------------------------------------------------------


class _Exploit:
    """A pickle that runs code when loaded."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_with_a_malicious_pickle_runs_no_code(ci_project, tmp_path):
    """An optimizer.pt that would run a command when unpickled, with a manifest that matches it: loading refuses
    it (weights_only), no code runs, and the run says which file, in one sentence."""
    import hashlib

    params = ci(ci_project, **{"train.iterations": 1})
    train(params, "jagg", 0, root=ci_project, progress=False)
    ckpt = _ckpts(ci_project) / "checkpoint-000001"
    marker = tmp_path / "pwned"
    torch.save({"state": _Exploit(str(marker))}, ckpt / "optimizer.pt")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["optimizer.pt"] = {"bytes": (ckpt / "optimizer.pt").stat().st_size,
                                "sha256": hashlib.sha256((ckpt / "optimizer.pt").read_bytes()).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--worker", "--set",
                     "train.iterations=2", "--set", "reward.weights={jpeg_compressibility: 1.0}", root=ci_project)
    assert not marker.exists()  # no code ran
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("jagg: error:")]
    assert out.returncode == 1 and len(lines) == 1 and "optimizer.pt" in lines[0], out.stderr[-2000:]


def test_weights_are_loaded_only_with_safetensors_or_weights_only():
    offenders = []
    for path in (REPO / "jagg_core").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"torch\.load\(", line) and "weights_only=True" not in line:
                offenders.append(f"{path.relative_to(REPO)}:{n}")
            if re.search(r"\bpickle\.load|\bnp\.load\(.*allow_pickle=True", line):
                offenders.append(f"{path.relative_to(REPO)}:{n}")
    assert offenders == []


def test_secrets_are_redacted_by_key_and_by_value_everywhere():
    from jagg_core.pipeline.tracking import param_strings

    tree = {"reward": {"options": {"hpsv2.1": {"api_token": "hf_abcdef12", "checkpoint": "x.pt",
                                               "mirror": "https://h/?t=hf_abcdef12"}}},
            "tracking": {"mlflow_uri": "postgresql://admin:s3cret-pw@db:5432/mlflow", "passwd": "p4ssw0rd"},
            "model": {"options": {"tokenizer": "t5", "max_tokens": 77,
                                  "headers": [{"Authorization": "Bearer abcdef"}, "plain"]}},
            "keys": {"private_key": "-----BEGIN", "access_key": "AKIA1234", "auth": "u:p"}}
    flat = param_strings(tree)
    text = repr(flat)
    for secret in ("hf_abcdef12", "s3cret-pw", "p4ssw0rd", "Bearer abcdef", "-----BEGIN", "AKIA1234", "u:p"):
        assert secret not in text, secret
    assert flat["tracking.mlflow_uri"] == "postgresql://admin:***@db:5432/mlflow"
    assert flat["reward.options.hpsv2.1.mirror"] == "https://h/?t=***"  # the token's value, elsewhere too
    assert flat["reward.options.hpsv2.1.checkpoint"] == "x.pt" and flat["model.options.tokenizer"] == "t5"
    assert flat["model.options.max_tokens"] == "77"


@pytest.mark.slow  # launched training runs beside live servers (20-50 s)
def test_a_run_writes_no_secret_to_disk_or_to_its_command_line(ci_project):
    """params.json, every checkpoint's state.json, the MLflow params and the workers' command line: no secret."""
    import sqlite3

    secret = "pw-7d1f0c"
    store = ci_project / "mlflow.db"
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--set", "train.iterations=1",
                     "--set", f"tracking.ui_url=http://admin:{secret}@127.0.0.1:5000", root=ci_project)
    assert out.returncode == 0, out.stderr[-2000:]
    assert secret not in out.stdout + out.stderr  # the launcher logs the worker's command line
    written = [p for p in ci_project.rglob("*.json") if "mlflow" not in p.name]
    assert any(p.name == "state.json" for p in written) and any(p.name == "params.json" for p in written)
    for p in written:
        assert secret not in p.read_text(), p
    with sqlite3.connect(store) as db:
        values = [v for (v,) in db.execute("select value from params")]
    assert values and not any(secret in v for v in values)
    assert not list(ci_project.rglob(".worker-context-*"))  # the launcher's private file is gone


# --- determinism -------------------------------------------------------------------------------------------------


def test_same_seed_same_profile_is_bit_identical_on_cpu(ci_base, tmp_path):
    runs = []
    for name in ("a", "b"):
        root = tmp_path / name
        shutil.copytree(ci_base, root)
        train(ci(root), "jagg", 0, root=root, progress=False)
        runs.append(latest_checkpoint(_ckpts(root)).tensors())
    a, b = runs
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- kills at random points and resume semantics -----------------------------------------------------------------


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


def _own_processes(root: Path) -> list:
    """Every live process started for the project ``root`` (by its JAGG_ROOT), the test's own excepted."""
    import psutil

    mine = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("JAGG_ROOT") == str(root):
                mine.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return mine


def _files_holding(folder: Path, secret: bytes) -> list[str]:
    hits = []
    for f in folder.rglob("*"):
        try:
            if f.is_file() and not f.is_symlink() and secret in f.read_bytes():
                hits.append(str(f.relative_to(folder)))
        except OSError:
            pass
    return hits


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


def test_a_workers_own_errors_are_user_error_sentences_that_are_not_retried(tmp_path):
    """What a worker finds — a garbage ``curve.tsv`` row, a garbage ``state.json`` (its manifest rewritten to match,
    so it verifies) — is a user error with a sentence naming the file, which the worker prints as ``jagg: error:``
    and its launcher raises as a TrainingError, not a WorkerDied that Prefect retries (they were tracebacks: "exit
    status 1; last output: CalledProcessError…", retried twice)."""
    from collections import deque

    from jagg_core.trainer.checkpoint import Checkpoint
    from jagg_core.trainer.curve import TsvCurve
    from tasks.train import WorkerDied, _failure, _retryable

    curve = tmp_path / "curve.tsv"
    curve.write_text("iteration\treward/mean\n1\t0.5\ngarbage\tnot-a-number\n")
    with pytest.raises(TrainingError, match=r"curve.tsv line 3 is not a row of numbers; fix or delete"):
        TsvCurve(curve, resume_from=1)
    ckpt = tmp_path / "checkpoint-000001"
    ckpt.mkdir()
    for garbage, fragment in [(b"\xff{not json", "cannot be read as JSON"), (b"[1]", "holds a list")]:
        (ckpt / "state.json").write_bytes(garbage)
        with pytest.raises(CheckpointError, match=fragment) as e:
            Checkpoint(ckpt, 1).state()
        assert "\n" not in str(e.value)
    failure = _failure("jagg-s0", 1, deque(["Traceback …", f"jagg: error: {e.value}", "CalledProcessError: …"]))
    assert type(failure) is TrainingError and "state.json holds a list" in str(failure)
    carried = _failure("jagg-s0", 1, deque(["jagg: error class: jagg_core.trainer.checkpoint:CheckpointError",
                                            f"jagg: error: {e.value}"]))
    assert type(carried) is CheckpointError and "state.json holds a list" in str(carried)  # the worker's own class

    class State:  # what Prefect's retry condition sees
        def result(self, raise_on_failure=True):
            raise failure

    assert not _retryable(None, None, State())
    assert isinstance(_failure("jagg-s0", -9, deque(["killed"])), WorkerDied)


def test_user_errors_and_every_log_record_are_redacted(capsys):
    """One redaction for what is raised and what is logged: a user error quoting a credentialed URI prints it as
    ``user:***@``, a stage's Prefect task or a flow hands it to Prefect so (its state message is the error's text),
    and so does every log handler (ours, MLflow's, Prefect's console and API handlers get the same filter)."""
    import logging

    from jagg_core.setup.config import ParamsError
    from tasks.common import cli, shown_redacted, stage_logger

    def err():
        return ParamsError("the MLflow store http://user:s3cret@127.0.0.1:1/ cannot open")

    def fail():
        raise err()

    with pytest.raises(ParamsError) as raised:  # what a stage's Prefect task or a flow lets out
        shown_redacted(fail)()
    assert "s3cret" not in str(raised.value) and "user:***@" in str(raised.value)
    assert "s3cret" not in repr(raised.value)

    @cli
    def main(argv=None):
        fail()

    assert main() == 1 and "user:***@" in (printed := capsys.readouterr().err) and "s3cret" not in printed
    seen = []

    class Capture(logging.Handler):
        def emit(self, record):
            seen.append(self.format(record))

    handler = Capture()
    logging.getLogger("prefect.flow_runs").addHandler(handler)
    try:
        stage_logger("test")  # puts the filter on every handler there is
        logging.getLogger("prefect.flow_runs").warning("store %s", "http://user:s3cret@host:1/")
    finally:
        logging.getLogger("prefect.flow_runs").removeHandler(handler)
    assert seen == ["store http://user:***@host:1/"]



def test_a_reward_no_group_varies_in_says_so_once_and_updates_nothing(ci_project, caplog):
    """ci's base never draws what a prompt asks for: toy_fidelity alone is 0 for every image, so no group varies.
    The trainer says so once, in a sentence naming the reward's mean, and no image is kept for the update."""
    import csv
    import logging

    params = load_params(ci_project / "params.yaml", "ci",
                         {"reward.weights": {"toy_fidelity": 1.0}, "train.iterations": 2})
    with caplog.at_level(logging.WARNING, logger="jagg_core.trainer.loop"):
        train(params, "jagg", 0, root=ci_project, progress=False)
    said = [r.getMessage() for r in caplog.records if "earned equal rewards" in r.getMessage()]
    assert len(said) == 1 and "toy_fidelity 0.0000" in said[0] and "reward.weights" in said[0], said
    rows = list(csv.DictReader(Layout(ci_project, "ci").curve("jagg-s0").open(), delimiter="\t"))
    assert [float(r["train/kept_fraction"]) for r in rows] == [0.0, 0.0]
