"""Reliability, round 6 (issue 47), mechanisms 1 and 2: writes that follow no planted link, every path argument
checked; every file a stage reads bounded and regular.

Each test is named after its mechanism (``test_m1_…``: the one writing function and the path rule; ``test_m2_…``: the
one bounded reader) and failed on the code before its fix. A FIFO planted where a stage reads used to block it for
good: those tests carry a timeout, so a regression fails instead of hanging. Everything they make is under their
temporary folder. The rows of docs/reliability.md's "Round 6" section name these tests.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import REPO, run_module
from jagg_core.setup.params_io import load_params

PARAMS = REPO / "params.yaml"


def _one_sentence(text: str) -> str:
    text = str(text).strip()
    assert "\n" not in text and "Traceback" not in text and len(text) < 600, text
    return text


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _write_eval(root: Path, outputs: str, run: str, value: float, step: int = 4) -> Path:
    """An evaluation of ``run`` as `jagg evaluate` writes it (images, scores.jsonl, metrics.json); returns the step's
    folder."""
    from PIL import Image

    step_dir = root / "eval" / outputs / run / "steps" / f"{step:06d}"
    rows = []
    for style in ("count", "single"):
        (step_dir / "images" / style).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (24, 24), (200, 10 * i, 0)).save(step_dir / "images" / style / f"{i:05d}.jpg")
            rows.append({"style": style, "index": i, "prompt": f"a red {style} {i}", "toy_fidelity": value})
    (step_dir / "scores.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    card = {"run": run, "step": step, "metrics": {"toy_fidelity": {"benchmark": value, "styles": {}}},
            "curve": [{"step": step, "eval/toy_fidelity": value}], "images": str((step_dir / "images").relative_to(root))}
    (root / "eval" / outputs / run / "metrics.json").write_text(json.dumps(card))
    return step_dir


REP = {"profile": "rep", "run.methods": ["jagg"], "run.seeds": [0], "eval.metrics": ["toy_fidelity"]}
REP_ARGS = ["--profile", "toy", "--set", "profile=rep", "--set", "run.methods=[jagg]", "--set", "run.seeds=[0]",
            "--set", "eval.metrics=[toy_fidelity]"]


def _evaluated_project(root: Path) -> Path:
    """A project with the base model's and one run's evaluations of the scratch profile ``rep`` (no training)."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(PARAMS, root / "params.yaml")
    _write_eval(root, "rep", "base", 0.2, step=0)
    _write_eval(root, "rep", "jagg-s0", 0.3)
    curve = root / "runs" / "rep" / "jagg-s0" / "curve.tsv"
    curve.parent.mkdir(parents=True)
    curve.write_text("iteration\ttime/update\ttime/iteration\treward/mean\n" +
                     "".join(f"{i}\t1.5\t3.0\t0.{i}\n" for i in range(1, 5)))
    return root


# --- mechanism 1: one writing function; every path argument checked ---------------------------------------------


@pytest.mark.slow
def test_m1_report_copy_to_replaces_a_planted_link_instead_of_writing_through_it(tmp_path):
    """`report --copy-to reports/cp` with `reports/cp/summary.json` a symlink to a file elsewhere: the copy was
    written through the link into its target (the path rule checks the folder only). Now the link is replaced by
    the copy, its target untouched."""
    root = _evaluated_project(tmp_path / "project")
    victim = tmp_path / "victim.json"  # outside the project, inside the test's folder
    victim.write_text("precious\n")
    (root / "reports" / "cp").mkdir(parents=True)
    (root / "reports" / "cp" / "summary.json").symlink_to(victim)
    out = run_module("tasks.report", *REP_ARGS, "--copy-to", "reports/cp", root=root, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert victim.read_text() == "precious\n"
    copied = root / "reports" / "cp" / "summary.json"
    assert not copied.is_symlink() and copied.read_bytes() == (root / "reports" / "rep" / "summary.json").read_bytes()


BENCH_FAST = ["--no-mlflow", "--windows", "2", "--fracs", "1", "--repeats", "1", "--steps", "2", "--batch", "1",
              "--no-memory", "--no-comm", "--threads", "1"]


@pytest.mark.parametrize("args, says", [
    (["--out", "../b"], "--out '../b' leads outside the project"),
    (["--write-docs", "../b.md"], "--write-docs '../b.md' leads outside the project"),
    (["--write-docs", "docs"], "--write-docs 'docs' is not a regular file (a folder?)"),
])
def test_m1_bench_out_and_write_docs_follow_the_path_rule_before_the_benchmark(args, says, tmp_path):
    """`bench --out ../b --write-docs ../b.md` wrote outside the project (exit 0); `--write-docs docs` (a folder) was
    an IsADirectoryError after the whole benchmark. Now one sentence, exit 1, before the benchmark runs: nothing
    written inside or outside the project."""
    root = tmp_path / "project"
    (root / "docs").mkdir(parents=True)
    shutil.copy(PARAMS, root / "params.yaml")
    before = _tree(tmp_path)
    out = run_module("tasks.bench", *BENCH_FAST, *args, root=root, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert says in _one_sentence(out.stderr.removeprefix("jagg: error: ")), out.stderr
    assert _tree(tmp_path) == before  # no bench/ results, no ../b, no ../b.md


@pytest.mark.parametrize("args, says", [
    (["--out", "../s.json"], "--out '../s.json' leads outside the project"),
    (["--write-docs", "../p.md"], "--write-docs '../p.md' leads outside the project"),
])
def test_m1_smoke_out_and_write_docs_follow_the_path_rule_before_the_run(args, says, tmp_path):
    """`jagg smoke --out` and `--write-docs` took any path (the JSON and its markdown written anywhere after the
    run); the same rule as every path argument now, before the run."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(PARAMS, root / "params.yaml")
    before = _tree(tmp_path)
    out = run_module("tasks.smoke", "--device", "cpu", "--iterations", "2", *args, root=root, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert says in _one_sentence(out.stderr.removeprefix("jagg: error: ")), out.stderr
    assert _tree(tmp_path) == before


def test_m1_the_workers_outcome_and_context_files_replace_a_planted_link(tmp_path):
    """A symlink planted at `runs/ci/jagg-s9/.worker-context-*.json.outcome-<pid>` was opened O_CREAT|O_TRUNC and
    its target overwritten with the worker's outcome; the context file (params, maybe credentials) was written the
    same way. Both now go through the one writing function: the link is replaced, its target untouched, the file
    is the owner's alone (0600)."""
    from jagg_core.errors import UserError
    from jagg_core.setup.paths import Layout
    from tasks.launch import outcome_file, read_outcome, report_error_class, write_context

    run_dir = tmp_path / "project" / "runs" / "ci" / "jagg-s9"
    run_dir.mkdir(parents=True)
    context = run_dir / ".worker-context-4242.json"
    victims = {name: tmp_path / name for name in ("outcome-victim", "context-victim")}
    for v in victims.values():
        v.write_text("precious\n")
    outcome_file(context).symlink_to(victims["outcome-victim"])
    context.symlink_to(victims["context-victim"])

    params = load_params(PARAMS, "ci")
    write_context(context, params, Layout.of(params, tmp_path / "project"), "", "")
    with pytest.raises(UserError):
        with report_error_class(context):
            raise UserError("the run's own error")
    assert {k: v.read_text() for k, v in victims.items()} == {k: "precious\n" for k in victims}
    for path in (context, outcome_file(context)):
        assert not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600, path
    assert json.loads(context.read_text())["root"] == str(tmp_path / "project")
    assert read_outcome(context)["message"] == "the run's own error"


# --- mechanism 2: every file a stage reads is bounded and regular ------------------------------------------------


@pytest.mark.timeout(30)
def test_m2_a_fifo_at_the_workers_outcome_file_does_not_block_the_launcher(tmp_path):
    """A FIFO at the outcome file's path blocked `train` for good after its last iteration (a plain `open`). Now it
    is no outcome (as a death leaves none), read at once, and removed like any outcome file."""
    import time

    from tasks.launch import outcome_file, read_outcome

    context = tmp_path / ".worker-context-4242.json"
    os.mkfifo(outcome_file(context, pid=1))
    (outcome_file(context, pid=2)).write_text(json.dumps({"kind": "worker", "class": "TypeError", "message": "m"}))
    os.mkdir(outcome_file(context, pid=3))  # a folder there is no outcome either (and no traceback)
    t0 = time.monotonic()
    assert read_outcome(context) == {"kind": "worker", "class": "TypeError", "message": "m"}
    assert time.monotonic() - t0 < 5
    assert not outcome_file(context, pid=1).exists() and not outcome_file(context, pid=2).exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind, says", [
    ("fifo", "not a regular file"),
    ("dev-zero", "not a regular file"),
    ("cut", "line 4 is not one image's scores"),
    ("folder", "is a folder, not a file"),
])
def test_m2_an_evaluations_scores_jsonl_is_read_bounded_and_whole(kind, says, tmp_path):
    """`eval/…/steps/N/scores.jsonl` as a FIFO hung `report`, as a link to /dev/zero read until a MemoryError (4.9
    GB), cut short was a JSONDecodeError traceback, a folder an IsADirectoryError. Now one sentence naming the file
    and what to run, at once, from the report's every reader of it (the intervals over prompts, the image grid)."""
    import time

    from jagg_core.pipeline.report import ReportError, _Run, read_eval
    from jagg_core.pipeline.report_figures import comparison_grid
    from jagg_core.pipeline.report_stats import prompt_intervals
    from jagg_core.setup.paths import Layout

    root = _evaluated_project(tmp_path / "project")
    scores = root / "eval" / "rep" / "base" / "steps" / "000000" / "scores.jsonl"
    text = scores.read_text()
    scores.unlink()
    if kind == "fifo":
        os.mkfifo(scores)
    elif kind == "dev-zero":
        scores.symlink_to("/dev/zero")
    elif kind == "cut":
        scores.write_text(text[: len(text) - 20])
    else:
        scores.mkdir()
    params = load_params(PARAMS, "toy", REP)
    lay = Layout.of(params, root)
    runs = [_Run("jagg", 0, [], read_eval(lay.eval_dir("jagg-s0") / "metrics.json"))]
    t0 = time.monotonic()
    for read in (lambda: prompt_intervals(lay, runs, ["toy_fidelity"], params.eval.protocol, []),
                 lambda: comparison_grid(params, lay, runs, tmp_path / "grid.png")):
        with pytest.raises(ReportError) as e:
            read()
        text = _one_sentence(e.value)
        assert str(scores) in text and says in text and "jagg evaluate --run base" in text, text
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["fifo", "cut"])
def test_m2_a_damaged_generation_json_is_no_marker_not_a_hang_or_a_traceback(kind, ci_project):
    """`steps/N/generation.json` (what a step's images were made from) as a FIFO hung `evaluate`; cut short it was a
    JSONDecodeError traceback. A marker that cannot be read vouches for nothing: the images are made again and the
    marker rewritten whole."""
    marker = ci_project / "eval" / "ci" / "base" / "steps" / "000000" / "generation.json"
    marker.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(marker)
    else:
        marker.write_text('{"weights": null, "base_model": "0123')
    out = run_module("tasks.evaluate", "--profile", "ci", "--run", "base", "--set", "eval.num_images_logged=0",
                     root=ci_project, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    assert marker.is_file() and not marker.is_symlink() and json.loads(marker.read_text())["num_steps"] == 4


@pytest.mark.timeout(30)
def test_m2_a_fifo_at_the_base_models_card_does_not_hang_pretrain(tmp_path):
    """`models/<p>/base/card.json` as a FIFO hung `pretrain` (it reads the card to decide whether the saved base is
    of the same recipe). A card that cannot be read is no card: not the same recipe, so the base is made again and
    its card written whole (replacing the FIFO)."""
    from tasks.pretrain import _same_recipe

    card = tmp_path / "models" / "ci" / "base" / "card.json"
    card.parent.mkdir(parents=True)
    os.mkfifo(card)
    assert _same_recipe(card, load_params(PARAMS, "ci")) is False


@pytest.mark.timeout(30)
def test_m2_a_fifo_at_speed_json_does_not_hang_jagg_run_after_done(tmp_path):
    """`runs/<p>/speed.json` as a FIFO hung `jagg run` after it printed "done" (its speed line read the file with a
    plain `read_text`). Now the line says there is no measurement, at once."""
    from flows.run import _speed_line
    from jagg_core.setup.paths import Layout

    lay = Layout(tmp_path, "ci")
    lay.speed.parent.mkdir(parents=True)
    os.mkfifo(lay.speed)
    assert "no side-by-side speed measurement" in _speed_line(load_params(PARAMS, "ci"), lay)


def test_m2_a_huge_sparse_manifest_is_refused_before_it_is_read(tmp_path):
    """`manifest.json` was read whole and then cut at 16 MiB (a 2 GB sparse file cost 2.7 GB of memory). Now its
    size is checked on the open file first: a 64 MiB sparse manifest costs no memory and is "unreadable"."""
    import tracemalloc

    from jagg_core.trainer.checkpoint import verify_checkpoint

    ckpt = tmp_path / "checkpoint-000001"
    ckpt.mkdir()
    with open(ckpt / "manifest.json", "wb") as f:
        f.truncate(64 << 20)  # sparse: no disk used
    tracemalloc.start()
    try:
        why = verify_checkpoint(ckpt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert why is not None and why.startswith("unreadable manifest") and "larger than" in why, why
    assert peak < 4 << 20, peak


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


def test_m1_a_sqlite_stores_artifacts_go_beside_it_not_into_the_working_folder(store, tmp_path):
    tracker, root = store
    run_id = tracker.child_run("artifacts", "jagg-s0", method="jagg", seed=0, key="artifacts")
    (tmp_path / "note.txt").write_text("kept")
    tracker.log_artifact(run_id, tmp_path / "note.txt", "notes")
    kept = list((root / "mlruns").rglob("note.txt"))
    assert [p.read_text() for p in kept] == ["kept"] and kept[0].parent.name == "notes", kept
    location = tracker.client.get_experiment(tracker.experiment_id).artifact_location
    assert location == (root / "mlruns" / "jagg-ci").as_uri(), location


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


def test_m2_params_are_read_by_the_projects_one_bounded_reader(tmp_path):
    """`params_io` had its own bounded read beside `storage.read_regular`; they are one function now: no other
    module of the project opens a file without blocking, and a params FIFO is that function's sentence."""
    import re

    own = [str(p.relative_to(REPO)) for d in ("jagg_core", "tasks", "flows") for p in (REPO / d).rglob("*.py")
           if re.search(r"O_NONBLOCK", p.read_text(encoding="utf-8"))]
    assert own == ["jagg_core/setup/storage.py"], own
    fifo = tmp_path / "params.yaml"
    os.mkfifo(fifo)
    from jagg_core.setup.config import ParamsError

    with pytest.raises(ParamsError) as e:
        load_params(fifo, "ci")
    assert "is not a regular file (a device, a FIFO or a socket); pass --params" in _one_sentence(e.value)
