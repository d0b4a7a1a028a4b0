"""Reliability, round 6 (issue 47), mechanisms 3 and 4: secrets in every string that leaves (names included), and
results that say where they came from.

Each test is named after its mechanism (``test_m3_…``: secrets; ``test_m4_…``: provenance) and failed on main at
537edc1 before its fix. Cheap probes call the library in-process; the evaluations and the side-by-side timing are the
real stages on the ci profile's base model (module fixtures, built once); the planted-password grep through every
store is a `jagg run` (``slow``). The rows of docs/reliability.md's "Round 6" section name these tests.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from pathlib import Path
from urllib.parse import quote

import pytest

from conftest import REPO, run_module
from jagg_core.setup.config import ParamsError
from jagg_core.setup.params_io import load_params

PARAMS = REPO / "params.yaml"

# A password each piece of which (between '/', '#', '?', '@', ':' and the space) is long enough to grep on its own.
PASSWORD = "Kv8Qz3Wm7Tx2"


def _one_sentence(text: str) -> str:
    text = text.strip()
    assert "\n" not in text and "Traceback" not in text and len(text) < 600, text
    return text


def _pieces(password: str) -> list[str]:
    return [password, quote(password, safe=""), *(p for p in re.split(r"[/#?@: ]", password) if len(p) >= 6)]


def _sqlite_cells_holding(db: Path, needles: list[str]) -> list[str]:
    """``table.column`` of every cell of a sqlite database holding one of ``needles`` (text or bytes)."""
    hits = []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        for (table,) in con.execute("select name from sqlite_master where type='table'").fetchall():
            for col in [r[1] for r in con.execute(f"pragma table_info('{table}')")]:
                for (value,) in con.execute(f'select "{col}" from "{table}"'):
                    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
                    if any(n in text for n in needles):
                        hits.append(f"{table}.{col}")
                        break
    finally:
        con.close()
    return hits


# --- mechanism 3: secrets in every string that leaves, names included ---------------------------------------------


@pytest.mark.parametrize("experiment, extra", [
    (f"jagg-{{profile}}-http://alice:{PASSWORD}@mlflow.example", {}),  # a URL's credentials in the name
    (f"jagg-{{profile}}-{PASSWORD}", {"reward.options": {"served": {"url": "http://127.0.0.1:9/score",
                                                                    "token": PASSWORD}}}),  # a secret param's value
])
def test_m3_a_password_in_the_experiment_name_never_reaches_mlflows_experiments_table(tmp_path, experiment, extra):
    """`--set tracking.experiment=…<password>…` created an MLflow experiment of that name: the password in clear in
    the experiments table of every store it was logged to. Now the name is refused with one sentence (a redacted
    name would not be the one given, and two passwords would share it), before any store is opened."""
    from jagg_core.pipeline.tracking import Tracker
    from jagg_core.setup.redact import redact

    db = tmp_path / "mlflow.db"
    overrides = {"tracking.experiment": experiment, "tracking.mlflow_uri": f"sqlite:///{db}", **extra}
    try:
        params = load_params(PARAMS, "ci", overrides)
    except ParamsError as e:
        shown = _one_sentence(redact(str(e)))  # what `jagg …` prints
        assert "tracking.experiment holds a secret" in shown, shown
        assert not any(p in shown for p in _pieces(PASSWORD)), shown
    else:
        Tracker(params, tmp_path)  # opens (creates) the experiment, as every stage does
    if db.exists():
        assert _sqlite_cells_holding(db, _pieces(PASSWORD)) == [], "the password is in mlflow.db"
    assert not db.exists(), "a store was opened for params that hold a secret in a name"


def _prefect_env(root: Path) -> dict[str, str]:
    return {"PREFECT_HOME": str(root / ".prefect"), "PREFECT_API_URL": ""}


def test_m3_a_params_path_holding_a_urls_password_is_neither_printed_nor_stored_by_prefect(ci_project):
    """`jagg run --params http://alice:<pw>@host/params.yaml`: the "does not exist" sentence printed the password (the
    path's `//` became `/`, which the URL pattern did not take for a URL), and where such a path exists the flow run's
    parameters in Prefect's database held it. Now a params path with a URL's credentials is refused in one redacted
    sentence before Prefect starts; the pattern also takes a path's `scheme:/` for a URL."""
    url = f"http://alice:{PASSWORD}@files.example/params.yaml"
    missing = run_module("flows.run", "--profile", "ci", "--params", url, root=ci_project,
                         env=_prefect_env(ci_project), timeout=600)
    text = missing.stdout + missing.stderr
    assert missing.returncode == 1, text[-3000:]
    assert "alice:***@" in _one_sentence(missing.stderr.strip().splitlines()[-1]), text[-3000:]
    # The same path as a file that exists (`http:/alice:<pw>@files.example/params.yaml` under the project). On main
    # the flow started (Prefect stored the path) and failed at its first MLflow call (a store nothing listens on).
    planted = ci_project / "http:" / f"alice:{PASSWORD}@files.example" / "params.yaml"
    planted.parent.mkdir(parents=True)
    shutil.copy(ci_project / "params.yaml", planted)
    present = run_module("flows.run", "--profile", "ci", "--params", url, "--set", "run.methods=[jagg]",
                         "--set", "tracking.mlflow_uri=http://127.0.0.1:9/", "--set", "tracking.retries=0",
                         root=ci_project, env=_prefect_env(ci_project), timeout=900)
    both = text + present.stdout + present.stderr
    assert present.returncode == 1, both[-3000:]
    for piece in _pieces(PASSWORD):
        assert piece not in both, f"{piece!r} was printed"
    db = ci_project / ".prefect" / "prefect.db"
    if db.exists():
        assert _sqlite_cells_holding(db, _pieces(PASSWORD)) == [], "Prefect's database holds the password"
    from jagg_core.setup.redact import redact

    assert redact(f"{Path(url)} does not exist") == "http:/alice:***@files.example/params.yaml does not exist"


def test_m3_a_password_with_a_space_in_the_ui_url_is_not_echoed_in_the_validation_error():
    """`--set 'tracking.ui_url=http://alice:Kv8Q z3Wm7Tx2@h:5000'` is no URL (a space), and the validation error
    quoted it whole: the free-text pattern ends a password at a space. The value a field was given is one value:
    its userinfo runs to its last '@', redacted whatever it holds."""
    from jagg_core.setup.redact import redact

    password = "Kv8Qz3 Wm7Tx2ab"
    with pytest.raises(ParamsError) as e:
        load_params(PARAMS, "ci", {"tracking.ui_url": f"http://alice:{password}@127.0.0.1:5000"})
    shown = _one_sentence(redact(str(e.value)))
    assert "tracking.ui_url" in shown and "alice:***@127.0.0.1:5000" in shown, shown
    assert not any(p in shown for p in ["Kv8Qz3", "Wm7Tx2ab", password]), shown


def test_m3_a_sweep_points_folder_covers_only_what_changes_results_and_hashes_no_secret():
    """A sweep point's folder digest hashed every override: `resources.num_threads` or a rotated password beside
    `train.iterations` retrained the whole sweep in a new folder, and a served reward's token (a secret) was hashed
    into a folder name. Now tracking.* and resources.* are no part of it, secrets are hashed redacted, and a point
    without either keeps the folder it had (so existing sweep points keep theirs)."""
    from flows.reproduce import flow_params

    point = {"train.iterations": 8, "jagg.window": 2}
    plain = flow_params("ci", overrides=point).outputs
    assert plain == "ci-91f2a6db"  # main's name for this point: unchanged
    assert flow_params("ci", overrides={**point, "resources.num_threads": 1}).outputs == plain
    assert flow_params("ci", overrides={**point, "tracking.retries": 1,
                                        "tracking.mlflow_uri": f"http://bob:{PASSWORD}@127.0.0.1:9/"}).outputs == plain

    def served(token: str, url: str = "http://127.0.0.1:9/score") -> str:
        return flow_params("ci", overrides={**point, "reward.options": {"served": {"url": url, "token": token}}}).outputs

    assert served("tokA-" + PASSWORD) == served("tokB-" + PASSWORD[::-1]) != plain  # the token: not hashed
    assert served("t0k3n", f"http://alice:{PASSWORD}@127.0.0.1:9/score") == served(
        "t0k3n", "http://alice:an0ther-pw@127.0.0.1:9/score")  # a URL's password: not hashed
    assert served("t0k3n", "http://127.0.0.1:9/score") != served("t0k3n", "http://127.0.0.1:8/score")  # the host is


# --- mechanism 4: results say where they came from ----------------------------------------------------------------

METHODS = ["baseline", "jagg"]


def _report_params(root: Path, **overrides):
    return load_params(root / "params.yaml", "ci", {"run.methods": METHODS, "run.seeds": [0], **overrides})


def _hand_evaluations(root: Path) -> None:
    """Evaluations and curves written by hand (test_report's way: nothing trains) for base, baseline-s0, jagg-s0."""
    from PIL import Image

    for run, value in (("base", 0.2), ("baseline-s0", 0.3), ("jagg-s0", 0.32)):
        step = 0 if run == "base" else 2
        step_dir = root / "eval" / "ci" / run / "steps" / f"{step:06d}"
        rows = []
        for style in ("count", "single"):
            (step_dir / "images" / style).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (24, 24), (200, 10 * i, 0)).save(step_dir / "images" / style / f"{i:05d}.jpg")
                rows.append({"style": style, "index": i, "prompt": f"a red {style} {i}", "toy_fidelity": value,
                             "toy_preference": value})
        (step_dir / "scores.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        metrics = {m: {"benchmark": value, "styles": {}} for m in ("toy_fidelity", "toy_preference")}
        card = {"run": run, "step": step, "metrics": metrics,
                "curve": [{"step": step, "eval/toy_fidelity": value, "eval/toy_preference": value}],
                "images": str((step_dir / "images").relative_to(root))}
        (root / "eval" / "ci" / run / "metrics.json").write_text(json.dumps(card))
        if run != "base":
            curve = root / "runs" / "ci" / run / "curve.tsv"
            curve.parent.mkdir(parents=True)
            curve.write_text("iteration\ttime/update\ttime/iteration\treward/mean\n1\t2.0\t3.0\t0.1\n2\t1.5\t2.5\t0.2\n")


@pytest.fixture(scope="module")
def measured(ci_base, tmp_path_factory) -> Path:
    """A ci project with hand-made evaluations and a real side-by-side timing of its methods at its own settings."""
    from jagg_core.setup.paths import Layout
    from tasks.speed import speed

    root = tmp_path_factory.mktemp("m4") / "project"
    shutil.copytree(ci_base, root)
    _hand_evaluations(root)
    params = _report_params(root)
    speed(params, Layout.of(params, root), rounds=3)
    return root


@pytest.fixture
def reported(measured, tmp_path) -> Path:
    root = tmp_path / "project"
    shutil.copytree(measured, root)
    return root


def test_m4_the_report_shows_no_speed_measurement_taken_at_other_settings(reported):
    """`jagg speed --set jagg.window=2`, then `jagg report`: W = 2 speeds were shown beside runs trained at W = 3
    (and with resources.speed_rounds 0 too, the speed stage skipped, the stale file read). speed.json now carries
    what it timed and its fingerprint; the report shows it only at its own settings and says why not otherwise."""
    from flows.run import _speed_line
    from jagg_core.pipeline.report import build_report
    from jagg_core.setup.paths import Layout
    from tasks.speed import speed

    params = _report_params(reported)
    lay = Layout.of(params, reported)
    assert params.jagg.window == 3
    assert build_report(params, lay)["side_by_side"] is not None  # measured at these settings: shown
    speed(_report_params(reported, **{"jagg.window": 2}), lay, rounds=3)  # `jagg speed --set jagg.window=2`
    for p in (params, _report_params(reported, **{"resources.speed_rounds": 0})):
        summary = build_report(p, lay)
        assert summary["side_by_side"] is None, "a W=2 measurement shown beside runs trained at W=3"
        note = summary["side_by_side_note"]
        assert "other settings" in note and "methods.jagg.window 2 (these runs: 3)" in note, note
        assert "is not shown: runs/ci/speed.json was measured at other settings" in (
            lay.report_dir / "README.md").read_text()
        written = json.loads((lay.report_dir / "summary.json").read_text())
        assert written["side_by_side"] is None and "other settings" in written["side_by_side_note"]
    assert "other settings" in _speed_line(params, lay)  # `jagg run`'s last line says so too
    side = json.loads(lay.speed.read_text())
    side.pop("fingerprint")  # a file that does not say what it timed (written before fingerprints): not shown
    lay.speed.write_text(json.dumps(side))
    assert build_report(params, lay)["side_by_side"] is None


def _strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"not JSON: bare {constant}")

    return json.loads(text, parse_constant=refuse)


def test_m4_nan_in_speed_json_shows_a_word_and_summary_json_is_strict_json(reported):
    """A NaN in speed.json (a ratio whose ideal is not a number, a time not measured) showed as "nan" in the report's
    table with no word, and summary.json was written with bare `NaN` (not JSON: strict readers refuse it; an interval
    over one seed is NaN too). Now the page says "not measured", summary.json and speed.json are strict JSON (null,
    and a note saying what null stands for)."""
    from jagg_core.bench.side_by_side import write_result
    from jagg_core.pipeline.report import build_report
    from jagg_core.setup.paths import Layout

    params = _report_params(reported)
    lay = Layout.of(params, reported)
    side = json.loads(lay.speed.read_text())
    for row in side["table"]:
        if row["method"] == "jagg":
            row.update(update_s=float("nan"), measured_over_ideal=float("nan"), speedup=float("nan"))
    lay.speed.write_text(json.dumps(side))  # as an older stage (or a hand) wrote it: bare NaN
    build_report(params, lay)
    readme = (lay.report_dir / "README.md").read_text()
    lines = readme.splitlines()
    head = next(i for i, line in enumerate(lines) if "update s (median [q1, q3])" in line)  # the side-by-side table
    jagg_row = next(line for line in lines[head:] if line.startswith("| jagg |"))
    assert "nan" not in jagg_row.lower().replace("not measured", ""), jagg_row
    assert "not measured" in jagg_row, jagg_row
    summary = _strict_json((lay.report_dir / "summary.json").read_text())  # bare NaN raises here
    assert "null" in summary and "not a number" in summary["null"], summary.get("null")
    written = dict(side, table=[dict(r, ideal=float("nan")) for r in side["table"]])
    write_result(written, lay.speed)  # the speed stage's own writer
    again = _strict_json(lay.speed.read_text())
    assert all(r["ideal"] is None for r in again["table"]) and "null" in again


@pytest.fixture(scope="module")
def evaluated(ci_base, tmp_path_factory):
    """A ci project whose base model was evaluated on the test split twice (a re-evaluation: its images are cached)
    and once on the validation split, by the real stage into a real MLflow store; returns the base run's id and a
    client."""
    from mlflow.tracking import MlflowClient

    from jagg_core.setup.paths import Layout
    from tasks.evaluate import evaluate

    root = tmp_path_factory.mktemp("m4eval") / "project"
    shutil.copytree(ci_base, root)
    for split in ("test", "test", "validation"):
        params = load_params(root / "params.yaml", "ci", {"eval.split": split})
        evaluate(params, Layout.of(params, root), "base")
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("jagg-ci")
    (run,) = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("jagg.run") == "base"]
    return run.info.run_id, client


def test_m4_a_validation_evaluation_logs_under_names_that_say_validation(evaluated):
    """`jagg evaluate --set eval.split=validation` logged its scores as `eval/<metric>` with the tag `eval.test_set`
    "… the toy's test split …", into the run that holds the test split's evaluation: one metric, two splits' points.
    Now the validation split's metrics, images and tags are under `eval-validation` (as its files are), and its
    test_set tag names the validation split."""
    run_id, client = evaluated
    run = client.get_run(run_id)
    for key in ("eval/toy_fidelity", "eval-validation/toy_fidelity", "eval-validation/ground_truth/toy_fidelity"):
        assert key in run.data.metrics, sorted(run.data.metrics)[:20]
    history = client.get_metric_history(run_id, "eval/toy_preference")
    assert len(history) == 1, [(m.step, m.value) for m in history]  # the test split's own point only
    validation = client.get_metric_history(run_id, "eval-validation/toy_preference")
    assert len(validation) == 1 and validation[0].value != history[0].value
    tags = run.data.tags
    assert "the toy's test split" in tags["eval.test_set"], tags["eval.test_set"]
    assert "the toy's validation split" in tags["eval-validation.test_set"], tags
    images = [a.path for a in client.list_artifacts(run_id, "images")]
    assert any("eval-validation+step" in p for p in images), images


def test_m4_a_re_evaluation_appends_no_duplicate_eval_points(evaluated):
    """Every `jagg evaluate` of a run appended its whole curve (and its images) again: two points of each `eval/*`
    metric at the same step after two evaluations. Now a point the run holds at that step with that value is not
    logged again, nor are that step's images."""
    run_id, client = evaluated
    for key in [k for k in client.get_run(run_id).data.metrics if k.startswith("eval")]:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), f"{key}: {steps}"
    images = [a.path for a in client.list_artifacts(run_id, "images") if a.path.endswith(".png")]
    assert len([p for p in images if "/eval+step+0+" in p]) == 1, images


# --- the check: a planted password in no store, no file, no folder name ----------------------------------


@pytest.mark.slow  # one `jagg run --profile ci` sweep point (a temporary Prefect server): ~2-3 min
def test_m3_a_planted_password_is_in_no_store_no_file_and_no_folder_name(ci_base, tmp_path):
    """The password planted wherever mechanism 3 found it leaking: refused at once (the experiment's name, a params
    path with a URL's credentials, a UI URL with a space in its password), then a whole `jagg run` sweep point with
    it in the UI's URL (tracking.*), a served reward's URL and token (a section that changes results, so in the
    point's digest) and a thread count beside them. No piece of it is in mlflow.db (the experiments table included),
    Prefect's database (flow-run parameters, logs, events, artifacts), any file or folder name of the project, or
    what was printed."""
    from fault_helpers import _files_holding

    root = tmp_path / "project"
    shutil.copytree(ci_base, root)
    env = _prefect_env(root)
    printed = ""
    for args in (["--set", f"tracking.experiment=jagg-{{profile}}-{PASSWORD}",
                  "--set", f"tracking.ui_url=http://alice:{PASSWORD}@127.0.0.1:5000"],
                 ["--params", f"http://alice:{PASSWORD}@files.example/params.yaml"],
                 ["--set", f"tracking.ui_url=http://alice:{PASSWORD[:6]} {PASSWORD[6:]}@127.0.0.1:5000"]):
        refused = run_module("flows.run", "--profile", "ci", *args, root=root, env=env, timeout=300)
        printed += refused.stdout + refused.stderr
        assert refused.returncode == 1, printed[-3000:]
        _one_sentence(refused.stderr.strip().splitlines()[-1])
    served = f"{{served: {{url: 'http://alice:{PASSWORD}@127.0.0.1:9/score', token: '{PASSWORD}'}}}}"
    out = run_module("flows.run", "--profile", "ci", "--set", "run.methods=[jagg]", "--set", "train.iterations=1",
                     "--set", f"tracking.ui_url=http://alice:{PASSWORD}@127.0.0.1:5000",
                     "--set", f"reward.options={served}", "--set", "resources.num_threads=1",
                     root=root, env=env, timeout=900)
    printed += out.stdout + out.stderr
    assert out.returncode == 0, printed[-4000:]
    points = [p.name for p in (root / "runs").iterdir() if p.name.startswith("ci-")]
    assert len(points) == 1 and (root / "reports" / points[0] / "index.html").exists(), points  # it ran, as a point
    needles = _pieces(PASSWORD)
    mlflow_db, prefect_db = root / "mlflow.db", root / ".prefect" / "prefect.db"
    assert mlflow_db.exists() and prefect_db.exists(), "a store was not written: the grep would prove nothing"
    con = sqlite3.connect(f"file:{mlflow_db}?mode=ro", uri=True)
    try:
        assert "jagg-ci" in [r[0] for r in con.execute("select name from experiments")]  # (and MLflow's Default)
        assert con.execute("select count(*) from params").fetchone()[0] > 0
    finally:
        con.close()
    assert _sqlite_cells_holding(mlflow_db, needles) == []
    assert _sqlite_cells_holding(prefect_db, needles) == []
    for needle in needles:
        assert _files_holding(root, needle.encode()) == [], f"{needle!r} reached the project's files"
        assert not [p for p in root.rglob("*") if needle in p.name], f"{needle!r} names a file or folder"
        assert needle not in printed, f"{needle!r} was printed"
