"""Reliability, round 5 (issue 41): what a hostile tester broke after round 4, fixed by class.

Each test is named after its class (``test_c1_…`` for class 1, secrets; ``test_c2_…`` for class 2, a worker's outcome;
…). Cheap probes call the library in-process or start one short command; a credentialed end-to-end `jagg run` is
marked ``slow``. The rows of docs/reliability.md's "Round 5" section name these tests.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_module
from jagg_core.setup.config import ParamsError
from jagg_core.setup.params_io import load_params

PARAMS = REPO / "params.yaml"


def _one_sentence(text: str) -> str:
    text = text.strip()
    assert "\n" not in text and "Traceback" not in text and len(text) < 600, text
    return text


# --- class 1: secrets --------------------------------------------------------------------------------------------

# Passwords with the characters that ended round 4's redaction early ('/', '#', '?') and '@'; each piece between them
# is long enough to be grepped on its own.
UI_PASSWORD = "Qz7Kp9/Vx3Lm5#Wr8Tn2?Hy6Bc4@Jd1Fg0"
STORE_PASSWORD = "Mf9Rt2@Yx5Qw8"  # a password the MLflow client can use as typed ('/', '#' and '?' would end the host)


def _pieces(password: str) -> list[str]:
    import re
    from urllib.parse import quote

    return [password, quote(password, safe=""), *(p for p in re.split(r"[/#?@]", password) if len(p) >= 6)]


@pytest.mark.parametrize("text, password", [
    ("http://alice:Pa/ssW0rdXYZ@127.0.0.1:9/", "Pa/ssW0rdXYZ"),
    ("postgresql://alice:Pa#ssW0rdXYZ@host/db", "Pa#ssW0rdXYZ"),
    ("store http://alice:Pa?ssW0rdXYZ@h:5000/api is down", "Pa?ssW0rdXYZ"),
    ("http://alice:Pa@ss/W0#rd?XYZ@127.0.0.1:9/x", "Pa@ss/W0#rd?XYZ"),
    (f"[x](http://alice:{UI_PASSWORD}@h/a.png) [y](http://alice:{UI_PASSWORD}@h/b.png)", UI_PASSWORD),
])
def test_c1_passwords_with_url_delimiters_are_redacted(text, password):
    """A password holding '/', '#', '?' or '@' is redacted whole (round 4 stopped at the first '/', '#' or '?' and
    printed the password); the user and the host stay."""
    from jagg_core.setup.redact import redact

    shown = redact(text)
    assert password not in shown and "alice:***@" in shown, shown
    assert "W0rdXYZ" not in shown and "ssW0rd" not in shown, shown


def test_c1_a_secret_seen_once_is_redacted_where_a_library_quotes_a_piece_of_it():
    """requests reads `http://alice:Pa/ssW0rdXYZ@127.0.0.1:9/` as host "alice" and path "/ssW0rdXYZ@127.0.0.1:9/":
    its error quotes a piece of the password without the URL. Params remember their secrets for every later
    redaction of the process (every log record, every error sentence)."""
    from jagg_core.setup.redact import redact

    load_params(PARAMS, "ci", {"tracking.mlflow_uri": "http://alice:Pa/ssLeakPiece42@127.0.0.1:9/"})
    shown = redact("HTTPConnectionPool(host='alice', port=80): Max retries exceeded with url: "
                   "/ssLeakPiece42@127.0.0.1:9/api/2.0/mlflow/experiments/get-by-name")
    assert "ssLeakPiece42" not in shown, shown


def test_c1_an_unreachable_store_with_a_slash_in_its_password_prints_no_part_of_it(ci_project):
    """The issue's repro: `jagg train --set tracking.mlflow_uri=http://alice:Pa/ssW0rdXYZ@127.0.0.1:9/ --set
    tracking.retries=0` printed the whole password twice. Now one sentence, exit 1, no piece of it."""
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--seed", "0",
                     "--set", "tracking.mlflow_uri=http://alice:Pa/ssW0rdXYZ@127.0.0.1:9/",
                     "--set", "tracking.retries=0", root=ci_project, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    for piece in ("Pa/ssW0rdXYZ", "ssW0rdXYZ", "Pa%2FssW0rdXYZ"):
        assert piece not in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def _prefect_rows_holding(db: Path, needles: list[str]) -> list[str]:
    """``table.column`` of every text cell of Prefect's database holding one of ``needles``."""
    hits = []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in con.execute("select name from sqlite_master where type='table'")]
        for table in tables:
            cols = [r[1] for r in con.execute(f"pragma table_info('{table}')")]
            for col in cols:
                for (value,) in con.execute(f'select "{col}" from "{table}"'):
                    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
                    if any(n in text for n in needles):
                        hits.append(f"{table}.{col}")
                        break
    finally:
        con.close()
    return hits


@pytest.mark.slow  # one `jagg run --profile ci` (a temporary Prefect server, a live MLflow server): ~2-4 min
def test_c1_a_credentialed_jagg_run_leaves_no_password_anywhere(ci_base, tmp_path):
    """`jagg run --profile ci` with credentials in every URL field (tracking.ui_url: a password holding '/', '#',
    '?' and '@'; tracking.mlflow_uri: a live server reached with a password holding '@'): no piece of either password
    is in mlflow.db, mlruns/, Prefect's database (artifacts, artifact collections, events, flow-run parameters, logs,
    read row by row and as bytes), runs/, eval/, reports/, any other file of the project, or the output. (Round 4:
    the MLflow link artifact and the report's markdown held the UI's password, in `artifact`, `artifact_collection`
    and the events.)"""
    from fault_helpers import _MlflowServer, _files_holding

    root = tmp_path / "project"
    shutil.copytree(ci_base, root)
    server = _MlflowServer(root)
    server.start()
    ui = f"http://alice:{UI_PASSWORD}@127.0.0.1:5000"
    store = f"http://bob:{STORE_PASSWORD}@127.0.0.1:{server.port}/"
    try:
        out = run_module("flows.run", "--profile", "ci", "--set", "run.methods=[jagg]",
                         "--set", f"tracking.ui_url={ui}", "--set", f"tracking.mlflow_uri={store}", root=root,
                         env={"PREFECT_HOME": str(root / ".prefect"), "PREFECT_API_URL": ""}, timeout=900)
    finally:
        server.stop()
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    db = root / ".prefect" / "prefect.db"
    assert db.exists(), "no Prefect database: the grep below would prove nothing"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:  # the stores were written: the artifacts the report made, the run's parameters, its logs and events
        keys = {r[0] for r in con.execute("select key from artifact")}
        assert {"mlflow", "report"} <= {k.rsplit("-", 1)[-1] for k in keys}, keys
        links = [r[0] for r in con.execute("select data from artifact where key like '%-mlflow'")]
        assert links and all("alice:***@127.0.0.1:5000" in link for link in links), links
        assert con.execute("select count(*) from log").fetchone()[0] > 0
    finally:
        con.close()
    needles = _pieces(UI_PASSWORD) + _pieces(STORE_PASSWORD)
    assert _prefect_rows_holding(db, needles) == []
    for needle in needles:
        assert _files_holding(root, needle.encode()) == [], f"{needle!r} reached the project's files"
        assert needle not in text, f"{needle!r} was printed"
    for folder in ("mlflow.db", "runs", "eval", "reports"):
        assert (root / folder).exists(), folder


# --- class 2: a worker's outcome travels by a channel that cannot scroll away ------------------------------------


def test_c2_a_workers_error_behind_a_long_traceback_is_its_own_not_a_death(ci_project, monkeypatch):
    """A real `accelerate launch` whose worker raises a PermissionError deep in the trainer (as under a read-only
    checkpoint folder): its traceback and accelerate's own lines are longer than the 30 lines the launcher keeps, so
    the "jagg: worker error" line printed before them scrolled away and the failure was a WorkerDied, retried twice
    under `jagg run`. The worker's outcome file says what it was: a TrainingError naming the PermissionError.
    (Through `accelerate launch`, as several processes start: one process starts without it, and its own traceback
    alone is shorter than 30 lines; tests/test_worker_errors.py has a worker's error on that path.)"""
    import logging

    from jagg_core.setup.paths import Layout
    from jagg_core.trainer import TrainingError
    from jagg_core.trainer.fingerprint import run_fingerprint
    from tasks.launch import Machine, write_context
    from tasks.train import WorkerDied, _launch_workers, _retryable

    params = load_params(ci_project / "params.yaml", "ci", {"train.iterations": 1})
    lay = Layout.of(params, ci_project)
    context = lay.run_dir("jagg-s0") / ".worker-context-test.json"
    write_context(context, params, lay, "", run_fingerprint(params, lay, "jagg", 0))
    monkeypatch.setenv("JAGG_FAULT", "rollout@1:eacces")
    lines = []

    class Log:
        def info(self, fmt, *args):
            lines.append(fmt % args)

    import tasks.train

    tails = []

    def launch(*args, **kwargs):  # the real launch; its tail (the last 30 lines) kept for the check below
        rc, tail = real_launch(*args, **kwargs)
        tails.append(tail)
        return rc, tail

    real_launch = tasks.train.launch
    monkeypatch.setattr(tasks.train, "launch", launch)
    monkeypatch.setattr(tasks.train, "without_launcher", lambda cmd, env: None)
    with pytest.raises(TrainingError) as e:
        _launch_workers(params, lay, "jagg", 0, Machine(), context, Log())
    assert not isinstance(e.value, WorkerDied), e.value
    assert "PermissionError" in str(e.value) and "Permission denied (injected)" in str(e.value), e.value
    assert any("jagg: worker error: PermissionError" in line for line in lines)  # printed, then scrolled away:
    assert not any("jagg: worker error" in line for line in tails[0]), "the traceback was short: proves nothing"

    class State:  # what Prefect's retry condition sees
        def result(self, raise_on_failure=True):
            raise e.value

    assert not _retryable(None, None, State())
    assert not list(context.parent.glob(context.name + ".outcome-*"))  # read and removed


def test_c2_a_launch_without_an_outcome_is_a_death_and_outcomes_are_bounded(tmp_path):
    """No outcome file (killed, out of memory): a WorkerDied, the one error retried; a user error's outcome is its
    own class; a garbage or huge outcome file is no outcome."""
    from collections import deque

    from jagg_core.trainer.checkpoint import CheckpointError
    from tasks.launch import outcome_file, read_outcome, report_error_class
    from tasks.train import WorkerDied, _failure

    context = tmp_path / "ctx.json"
    with pytest.raises(CheckpointError):
        with report_error_class(context):
            raise CheckpointError("checkpoint 3 is damaged; move it aside.")
    outcome = read_outcome(context)
    failure = _failure("jagg-s0", 1, deque(["x"] * 30), outcome)
    assert type(failure) is CheckpointError and "checkpoint 3 is damaged" in str(failure)
    assert read_outcome(context) is None  # removed once read
    outcome_file(context, 1).write_bytes(b"\xff{garbage")
    outcome_file(context, 2).write_text('{"kind": "user", "class": "os:system", "message": "' + "x" * 100_000 + '"}')
    assert read_outcome(context) is None
    assert isinstance(_failure("jagg-s0", -9, deque(["Killed"]), None), WorkerDied)


@pytest.mark.parametrize("overrides, says", [
    ({"sample.group_size": 1024, "sample.prompts_per_iteration": 65536, "sample.batch_size": 65536},
     "images per iteration"),
    ({"sample.group_size": 512, "sample.prompts_per_iteration": 16, "sample.num_steps": 1000}, "stored latents"),
])
def test_c2_products_of_sizes_are_bounded_with_one_sentence(overrides, says):
    """Each size was bounded on its own (round 4), their product was not: 1024 × 65,536 images per iteration was an
    out-of-memory error in the worker, classed as a death and retried. Now one sentence at validation."""
    with pytest.raises(ParamsError, match=says) as e:
        load_params(PARAMS, "ci", overrides)
    _one_sentence(str(e.value))


# --- class 8: output a user can read -----------------------------------------------------------------------------


def test_c8_the_launcher_shows_the_workers_sentence_not_accelerates_traceback(ci_project, monkeypatch):
    """A real `accelerate launch` (as several processes start; one starts without it) whose worker stops on a user
    error (a prompt file it cannot use): what the launcher relays is the worker's one sentence; accelerate's 10-line
    `CalledProcessError` traceback ("[run] Traceback …") and the class line meant for the launcher are not shown."""
    import tasks.train
    from test_worker_errors import _write_prompts

    from jagg_core.setup.paths import Layout
    from jagg_core.setup.storage import PromptFileError
    from jagg_core.trainer.fingerprint import run_fingerprint
    from tasks.launch import Machine, write_context
    from tasks.train import _launch_workers

    params = load_params(ci_project / "params.yaml", "ci")
    lay = Layout.of(params, ci_project)
    context = lay.run_dir("jagg-s0") / ".worker-context-test.json"
    write_context(context, params, lay, "", run_fingerprint(params, lay, "jagg", 0))
    _write_prompts(lay, "")
    lines = []

    class Log:
        def info(self, fmt, *args):
            lines.append(fmt % args)

    monkeypatch.setattr(tasks.train, "without_launcher", lambda cmd, env: None)
    with pytest.raises(PromptFileError, match="is an empty prompt"):
        _launch_workers(params, lay, "jagg", 0, Machine(), context, Log())
    shown = "\n".join(lines)
    assert "is an empty prompt" in shown, shown
    assert "Traceback" not in shown and "CalledProcessError" not in shown and "error class" not in shown, shown


# --- class 6: typed values all the way down ----------------------------------------------------------------------


@pytest.mark.parametrize("overrides, says", [
    ({"run.seeds": [True]}, "run.seeds.0"),
    ({"run.seeds": ["3"]}, "run.seeds.0"),
    ({"run.seeds": [3.0]}, "run.seeds.0"),
    ({"reward.weights": {"toy_fidelity": True}}, "reward.weights.toy_fidelity"),
    ({"train.adam_betas": [True, 0.999]}, "train.adam_betas.0"),
    ({"sample.sde_window_range": [False, True]}, "sample.sde_window_range.0"),
    ({"sample.sde_window_range": ["0", "1"]}, "sample.sde_window_range.0"),
    ({"model.options.lora": {"rank": True}}, "model.options.lora.rank"),
    ({"model.options.lora": {"rank": "8"}}, "model.options.lora.rank"),
    ({"model.options.lora": {"dropout": False}}, "model.options.lora.dropout"),
    ({"reward.frames": [True]}, "reward.frames"),
    ({"eval.metrics": []}, "eval.metrics"),
    ({"tracking.retries": 1_000_000}, "tracking.retries"),
])
def test_c6_bools_and_quoted_counts_are_refused_inside_lists_and_dicts(overrides, says):
    """Round 4's "true/false is not a number, "5" is not a count" held for top-level fields only: `run.seeds=[true]`
    trained seed 1, `["3"]` seed 3, `reward.weights={toy_fidelity: true}` weighed 1.0; `eval.metrics=[]` passed
    validation and failed once the MLflow run existed; `tracking.retries` had no upper bound. One sentence each."""
    with pytest.raises(ParamsError, match=says.replace(".", r"\.")) as e:
        load_params(PARAMS, "ci", overrides)
    _one_sentence(str(e.value))


def test_c6_valid_values_inside_lists_and_dicts_still_read():
    """What was valid stays valid: numeric strings for numbers (YAML 1.1 reads 3e-4 as one), ints for numbers."""
    p = load_params(PARAMS, "ci", {"run.seeds": [0, 7], "reward.weights": {"toy_fidelity": 1, "toy_preference": "5e-1"},
                                   "train.adam_betas": [0.9, "0.99"], "sample.sde_window_range": [0, 1],
                                   "model.options.lora": {"rank": 4, "alpha": 8}, "tracking.retries": 20})
    assert p.run.seeds == [0, 7] and p.reward.weights == {"toy_fidelity": 1.0, "toy_preference": 0.5}
    assert p.train.adam_betas == (0.9, 0.99) and p.model.options["lora"]["rank"] == 4


def test_c6_yaml_merge_keys_are_read_in_a_file_and_in_set(tmp_path):
    """`<<: *base` and `<<: [*a, *b]` are YAML that `yaml.safe_load` reads; the duplicate-key loader refused them as
    "not valid YAML". A key written beside the merge overrides the merged one; a key written twice is still refused."""
    from tasks.common import parse_overrides

    f = tmp_path / "params.yaml"
    f.write_text(PARAMS.read_text().replace(
        "  ci:\n", "  merged:\n    world: &w {seed: 3}\n    pretrain: {<<: *w, steps: 40}\n"
        "    train: {<<: [{iterations: 3}, {lr: 0.0002}], micro_batch: 8}\n  ci:\n", 1))
    p = load_params(f, "merged")
    assert p.pretrain.seed == 3 and p.pretrain.steps == 40
    assert p.train.iterations == 3 and p.train.lr == 0.0002 and p.train.micro_batch == 8
    sets = parse_overrides(["train={<<: {iterations: 5, lr: 0.001}, lr: 0.002}"])
    assert sets == {"train": {"iterations": 5, "lr": 0.002}}
    with pytest.raises(ParamsError, match="appears twice"):
        parse_overrides(["train={<<: {iterations: 5}, lr: 0.1, lr: 0.2}"])


# --- classes 4 and 5: every argument checked as what it names; files a stage reads are bounded regular files ------


@pytest.mark.parametrize("name", ["jagg-s0\n", "jagg-s\u0663", "jagg-s" + "9" * 20, "jagg-s2147483648",
                                  "../../../esc/x-s0", "jagg-s007", "JAGG-s0", "x" * 65 + "-s0", "jagg-s-1", ""])
def test_c4_one_parser_for_run_names(name):
    """`evaluate --run` and `export --run` read a run name with one parser, which takes exactly what `run_name` writes
    for a method and a seed that run.methods and --seed accept (a trailing newline, non-ASCII digits and 20-digit
    seeds passed Python's `$` and `\\d`; `../../../esc/x-s0` exported a checkpoint from outside the project)."""
    from jagg_core.errors import UserError
    from jagg_core.setup.paths import parse_run_name

    with pytest.raises(UserError, match="is not a run name") as e:
        parse_run_name(name)
    _one_sentence(str(e.value))
    assert parse_run_name("jagg-s0") == ("jagg", 0)
    assert parse_run_name("ablate-matched-s2147483647") == ("ablate-matched", 2**31 - 1)


def test_c4_evaluate_and_export_refuse_what_is_not_a_run_and_open_no_mlflow_run(tmp_path):
    """Before any work and before an MLflow run exists (evaluate made a FAILED run for each such name)."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(PARAMS, root / "params.yaml")
    for module, name in [("tasks.evaluate", "jagg-s0\n"), ("tasks.evaluate", "jagg-s" + "1" * 20),
                         ("tasks.export", "../../../esc/x-s0")]:
        out = run_module(module, "--profile", "ci", "--run", name, root=root, timeout=300)
        assert out.returncode == 1, out.stderr[-2000:]
        assert "is not a run name" in _one_sentence(out.stderr.removeprefix("jagg: error: ")), out.stderr
    assert sorted(p.name for p in root.iterdir()) == ["params.yaml"]  # no mlflow.db, no exports/, nothing


@pytest.mark.parametrize("args, says", [
    (["tasks.report", "--base-grid", "/tmp/jagg-r5-grid.png"], "--base-grid '/tmp/jagg-r5-grid.png' leads outside"),
    (["tasks.report", "--base-grid", "../grid.png"], "leads outside the project"),
    (["tasks.report", "--base-grid", "data"], "is not a regular file"),
    (["tasks.report", "--base-grid", "params.yaml/x.png"], "goes through params.yaml, a file"),
    (["tasks.report", "--copy-to", "params.yaml"], "--copy-to 'params.yaml' is a file, not a folder"),
    (["tasks.report", "--copy-to", "/"], "leads outside the project"),
    (["tasks.bench", "--no-mlflow", "--main-job", "/etc"], "--main-job '/etc' leads outside the project"),
    (["tasks.bench", "--no-mlflow", "--main-job", "reports/damaged"], "is not a report's summary"),
    (["tasks.bench", "--no-mlflow", "--main-job", "reports/fifo"], "not a regular file"),
])
def test_c4_path_arguments_follow_one_rule(args, says, tmp_path):
    """`report --copy-to` and `--base-grid` wrote anywhere (`--base-grid` made a folder at the filesystem root) and
    gave tracebacks onto a file or a folder; `bench --main-job` read any folder and gave a traceback on a damaged
    summary.json. One rule (inside the project; a folder or a file as the argument names), one sentence, exit 1,
    nothing written."""
    root = tmp_path / "project"
    (root / "data").mkdir(parents=True)
    shutil.copy(PARAMS, root / "params.yaml")
    (root / "reports" / "damaged").mkdir(parents=True)
    (root / "reports" / "damaged" / "summary.json").write_text('[{"iteration_breakdown": 1}]')
    (root / "reports" / "fifo").mkdir()
    os.mkfifo(root / "reports" / "fifo" / "summary.json")
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    out = run_module(*args[:1], "--profile", "ci", *args[1:], root=root, timeout=120)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert says in _one_sentence(out.stderr.removeprefix("jagg: error: ")), out.stderr
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    assert not Path("/tmp/jagg-r5-grid.png").exists()


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "folder", "huge"])
def test_c5_prompt_files_are_bounded_regular_files(kind, tmp_path):
    """`train.jsonl` as a symlink to /dev/zero was read until killed (memory growing), a FIFO hung, a folder was an
    IsADirectoryError traceback. Now one sentence each, at once."""
    import time

    from jagg_core.setup.storage import MAX_READ_BYTES, PromptFileError, read_prompts

    path = tmp_path / "train.jsonl"
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        with open(path, "wb") as f:
            f.truncate(MAX_READ_BYTES + 1)  # sparse: no disk used
    t0 = time.monotonic()
    with pytest.raises(PromptFileError) as e:
        read_prompts(path)
    assert time.monotonic() - t0 < 5
    text = _one_sentence(str(e.value))
    assert str(path) in text and ("regular file" in text or "folder" in text or "larger than" in text), text


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


def test_c5_a_curve_with_nan_or_inf_rows_is_reported_not_a_crash(tmp_path):
    """`nan` / `inf` rows (a skipped update's reward, a damaged time) made `jagg report` crash in its statistics
    (statistics.pstdev: AttributeError); a value that is not finite is not a measurement: the speed table and the
    iteration breakdown are built without it."""
    import math

    from jagg_core.pipeline.report import _Run, iteration_breakdown, read_curve, speed_table

    curve = tmp_path / "curve.tsv"
    curve.write_text("iteration\treward/mean\ttime/iteration\ttime/update\ttime/rollout\n1\t0.5\t1.0\t0.5\t0.3\n"
                     "2\tnan\tinf\t0.4\t0.3\n3\t0.6\t1.1\t-inf\t0.3\n4\tinf\tnan\tnan\tnan\n")
    params = load_params(PARAMS, "toy", {"run.methods": ["jagg"]})
    runs = [_Run("jagg", 0, read_curve(curve), None)]
    (speed,) = speed_table(params, runs)
    assert speed["time/update"] == pytest.approx(0.4)  # iterations 2-4 (the first is warm-up): only 0.4 is finite
    (phases,) = iteration_breakdown(runs, params.train)
    assert phases["iteration_s"] == pytest.approx(1.1) and math.isfinite(phases["overhead_share"])


def test_c5_a_refused_report_leaves_no_empty_folder(tmp_path):
    """`jagg report --set outputs=ghost` (nothing evaluated there) is one sentence and leaves no empty report
    folder behind."""
    from jagg_core.pipeline.report import ReportError, build_report
    from jagg_core.setup.paths import Layout

    params = load_params(PARAMS, "toy", {"profile": "rep", "outputs": "ghost"})
    lay = Layout.of(params, tmp_path)
    with pytest.raises(ReportError, match="nothing to report"):
        build_report(params, lay)
    assert not lay.report_dir.exists() and not any(tmp_path.iterdir())


# --- class 3: a stage never writes one profile's settings into another's folder ------------------------------------


@pytest.mark.parametrize("stage", ["tasks.prepare", "tasks.pretrain", "tasks.train", "tasks.evaluate"])
def test_c3_a_profile_override_cannot_write_into_another_profiles_folders(stage, tmp_path):
    """`jagg prepare --profile ci --set profile=toy` exited 0 and rewrote data/toy/prompts with ci's prompts (train,
    pretrain and evaluate took the same path; only the flows refused a `profile` override). One sentence, exit 1,
    nothing written."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(PARAMS, root / "params.yaml")
    extra = {"tasks.train": ["--method", "jagg"], "tasks.evaluate": ["--run", "jagg-s0"]}.get(stage, [])
    out = run_module(stage, "--profile", "ci", "--set", "profile=toy", *extra, root=root, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "would write profile 'ci'" in _one_sentence(out.stderr.removeprefix("jagg: error: "))
    assert sorted(p.name for p in root.iterdir()) == ["params.yaml"]


def test_c3_an_empty_profile_overlay_with_no_sections_is_refused(tmp_path):
    """A params file holding `profile: ci` and `profiles: {ci: {}}` passed round 4's check (`profile: ci` alone) and
    prepare overwrote data/ci/prompts with the code's sizes; what was there is kept."""
    root = tmp_path / "project"
    (root / "data" / "ci" / "prompts").mkdir(parents=True)
    kept = root / "data" / "ci" / "prompts" / "train.jsonl"
    kept.write_text('{"prompt": "kept"}\n')
    (root / "params.yaml").write_text("profile: ci\nprofiles: {ci: {}}\n")
    out = run_module("tasks.prepare", root=root, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "every value would be the code's default" in _one_sentence(out.stderr.removeprefix("jagg: error: "))
    assert kept.read_text() == '{"prompt": "kept"}\n'
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == [
        "data/ci/prompts/train.jsonl", "params.yaml"]


# --- class 7: MLflow run states that say what happened -------------------------------------------------------------

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
