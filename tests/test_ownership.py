"""Who ends an MLflow run, and in what state: every run a command opens ends whatever ends the command (KILLED on a
signal, FAILED on an error); a stage ends only the runs it owns (a tag naming its process); a run whose owner is gone,
or cannot be checked and has missed its heartbeats, is taken over with one warning."""

from __future__ import annotations

import pytest

from fault_helpers import PARAMS
from jagg_core.setup.params_io import load_params


# --- every run a command opens is ended ----------------------------------------------------------------------------


def _sqlite_tracker(tmp_path):
    from jagg_core.pipeline.tracking import Tracker

    params = load_params(PARAMS, "ci", {"tracking.mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db"})
    return Tracker(params, tmp_path)


def _statuses(tracker) -> dict[str, str]:
    runs = tracker.client.search_runs([tracker.experiment_id])
    return {r.data.tags.get("jagg.run", r.data.tags.get("jagg.kind")): r.info.status for r in runs}


def test_every_mlflow_run_a_command_opens_ends_whatever_ends_it(tmp_path, monkeypatch):
    from jagg_core.pipeline.tracking import Tracker

    from tasks.launch import Interrupted

    tracker = _sqlite_tracker(tmp_path)
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
