"""Results say where they came from (jagg_core/setup/provenance.py): speed.json carries what it timed and its
fingerprint, and the report and `jagg run`'s last line show it only at its own settings (or say why not); NaN is a word
and strict JSON; an evaluation of the validation split logs under names that say so, and a re-evaluation logs no point
twice. The evaluations and the side-by-side timing are the real stages on the ci profile's base model (module
fixtures, built once)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fault_helpers import PARAMS, _one_sentence
from jagg_core.setup.params_io import load_params


# --- the side-by-side speed: shown at its own settings only --------------------------------------------------------


def test_m7_a_sweep_without_the_baseline_says_why_there_is_no_speedup(tmp_path):
    """`jagg run` of methods without the exact baseline ended with "update speedup vs the exact baseline, every method
    timed side by side: " and nothing after it. Now it says there is no baseline and gives the seconds it has."""
    from flows.run import _speed_line
    from jagg_core.bench.side_by_side import speed_rows
    from jagg_core.setup.paths import Layout
    from jagg_core.setup.provenance import fingerprint, speed_made_from

    def measured(params, result):  # speed.json as the speed stage writes it: what it timed, and its fingerprint
        made = speed_made_from(params, list(result["methods"]))
        lay.speed.write_text(json.dumps({**result, "table": speed_rows(result), "made_from": made,
                                         "fingerprint": fingerprint(made)}))

    params = load_params(PARAMS, "ci", {"run.methods": ["jagg", "ablate"]})
    lay = Layout.of(params, tmp_path)
    counts = {"grad_forwards": 2, "nograd_forwards": 2, "reused_velocities": 0}
    timed = {"update": {"median": 0.25, "q1": 0.2, "q3": 0.3}, "counts": counts}
    result = {"methods": {"jagg": {**timed, "mode": "jagg"}, "ablate": {**timed, "mode": "ablate"}}}
    lay.speed.parent.mkdir(parents=True, exist_ok=True)
    measured(params, result)
    line = _one_sentence(_speed_line(params, lay))
    assert "no exact baseline" in line and "jagg 0.250 s" in line and not line.endswith(": "), line
    result["methods"]["baseline"] = {**timed, "mode": "exact"}
    params = load_params(PARAMS, "ci", {"run.methods": ["baseline", "jagg", "ablate"]})
    measured(params, result)
    assert "jagg 1.00x" in _speed_line(params, lay)  # with it, the speedups as before


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
    shown = build_report(params, lay)
    # measured at these settings: shown, unless the suite's load kept it off the core (then it says so)
    assert shown["side_by_side"] is not None or "cannot be trusted" in shown["side_by_side_note"]
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
    head = next(i for i, line in enumerate(lines) if "update s (fastest half [q1, q3])" in line)  # the side-by-side table
    jagg_row = next(line for line in lines[head:] if line.startswith("| jagg |"))
    assert "nan" not in jagg_row.lower().replace("not measured", ""), jagg_row
    assert "not measured" in jagg_row, jagg_row
    summary = _strict_json((lay.report_dir / "summary.json").read_text())  # bare NaN raises here
    assert "null" in summary and "not a number" in summary["null"], summary.get("null")
    written = dict(side, table=[dict(r, ideal=float("nan")) for r in side["table"]])
    write_result(written, lay.speed)  # the speed stage's own writer
    again = _strict_json(lay.speed.read_text())
    assert all(r["ideal"] is None for r in again["table"]) and "null" in again


# --- an evaluation's points in MLflow: its split's names, none twice -----------------------------------------------


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
