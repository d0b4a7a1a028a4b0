"""`make run` then a bare `dvc repro` on ci in a fresh clone whose active profile is ci (its pipeline the root's
dvc.yaml): it retrains nothing `jagg run` trained, and each later change (a method's param, a module, a DVC experiment)
reruns exactly the stages it made stale.

A file of its own (its one test is the suite's longest, ~13 min on a slow 2-core machine): pytest-xdist gives each
file to one worker, and tests/conftest.py starts the longest files first.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from test_pipeline import BIN, _clone, _run, _with_ci_base


PIPELINE = "dvc.yaml"  # the active profile's pipeline (tasks/dvc_pipelines.py writes it at the root): ci's here


def _stage(addressed: str) -> str:
    """A stage of the root pipeline, as DVC names it: ``train@jagg-0`` (another pipeline's has its path before a
    colon)."""
    assert ":" not in addressed, addressed
    return addressed


def _stale(root: Path) -> set[str]:
    out = _run([str(BIN / "dvc"), "status", "--json", PIPELINE], root)
    assert out.returncode == 0, out.stderr
    return {_stage(s) for s in json.loads(out.stdout or "{}")}


def _ran(out: subprocess.CompletedProcess) -> set[str]:
    return {_stage(s) for s in re.findall(r"Running stage '([^']+)'", out.stdout)}


def _files(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {str(f.relative_to(folder)): (f.stat().st_mtime_ns, f.read_bytes()) for f in sorted(folder.rglob("*"))
            if f.is_file()}


def _mlflow_run_list(root: Path, experiment: str) -> list[dict]:
    """Every run of ``experiment`` (a run name has one MLflow run per sweep: `jagg run`'s, DVC's ``default``)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment}"
    return [{"metrics": r.data.metrics, "tags": r.data.tags}
            for r in client.search_runs([exp.experiment_id], "tags.`jagg.kind` = 'run'")]


TRAINED_METRICS = {"reward/mean", "time/update", "train/backward_calls", "train/kl_ref", "eval/toy_fidelity",
                   "reward/toy_fidelity/group_std", "reward/toy_fidelity/zero_std_frac"}



@pytest.mark.slow
@pytest.mark.timeout(1800)  # `jagg run`, then ~20 stage processes; beside another test worker on 2 cores
def test_dvc_repro_after_jagg_run_retrains_nothing_then_reruns_only_what_a_change_made_stale(ci_base, tmp_path):
    """`make run` then `make repro`, on ci as the active profile: its pipeline is the root's dvc.yaml (`make
    pipelines` put it there) and runs the commands `jagg run` ran, into the same folders, so a bare `dvc repro` (no
    dvc.lock yet: every stage runs once, to be recorded) finds every run trained and every evaluation made, rewrites
    no checkpoint, and `dvc status dvc.yaml` then says it is up to date. Then what a user
    changes: a method's param, a module, an iteration more as a DVC experiment — each reruns exactly its stages.
    (One project for both halves: a `dvc repro` from nothing runs the same stage commands as this one's, which
    tests/conftest.py's fixtures and `jagg run` run in every other test; the suite's time. For the same reason the
    clone starts with the session's ci prompts and base model, which its prepare and pretrain stages find up to date,
    as they do after `jagg run`.)"""
    root = _with_ci_base(_clone(tmp_path), ci_base)
    # Two methods keep the test's time down (every stage is a fresh process); the matrix logic is the same. ci's
    # pipeline reads its methods from the top-level run.methods (its overlay sets none): the edit changes its stages.
    text = (root / "params.yaml").read_text()
    three, two = "  methods: [baseline, jagg, ablate]\n", "  methods: [baseline, jagg]\n"
    assert three in text
    (root / "params.yaml").write_text(text.replace(three, two, 1))
    # `make pipelines` on the clone, whose params.yaml says `profile: ci`: ci's pipeline comes to the root, toy's goes
    # to pipelines/toy/ (what a user who switches profile commits)
    moved = _run([str(BIN / "python"), "-m", "tasks.dvc_pipelines"], root)
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert "--profile ci " in (root / "dvc.yaml").read_text() and not (root / "pipelines/ci").exists()
    assert (root / "pipelines/toy/dvc.yaml").is_file()
    for cmd in (["git", "add", "-A"], ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "ci"]):
        subprocess.run(cmd, cwd=root, check=True)
    run = _run([str(BIN / "jagg"), "run", "--profile", "ci"], root, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    trained = {run: _files(root / "checkpoints/ci" / run) for run in ("baseline-s0", "jagg-s0")}
    curves = {run: (root / "runs/ci" / run / "curve.tsv").read_text() for run in ("baseline-s0", "jagg-s0")}
    assert all(trained.values())
    first = _run([str(BIN / "dvc"), "repro"], root)  # bare: the root's dvc.yaml
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert _ran(first) == {"prepare", "pretrain", "evaluate-base", "speed", "report",
                           *(f"{stage}@{m}-0" for stage in ("train", "evaluate") for m in ("baseline", "jagg"))}
    assert (root / "dvc.lock").is_file() and not (root / "pipelines/ci").exists()  # its lock beside it
    assert {run: _files(root / "checkpoints/ci" / run) for run in trained} == trained  # not one file rewritten
    assert {run: (root / "runs/ci" / run / "curve.tsv").read_text() for run in curves} == curves
    for method in ("baseline", "jagg"):
        run = f"{method}-s0"
        assert (root / "checkpoints/ci" / run / "checkpoint-000002/manifest.json").exists()
        metrics = json.loads((root / "eval/ci" / run / "metrics.json").read_text())
        assert metrics["step"] == 2 and "toy_fidelity" in metrics["metrics"]
        assert [p["step"] for p in metrics["curve"]] == [1, 2]
    assert json.loads((root / "eval/ci/base/metrics.json").read_text())["step"] == 0
    # The report: its files exist and every image the HTML references is there.
    index = (root / "reports/ci/index.html").read_text()
    images = re.findall(r'src="([^"]+)"', index)
    assert "grid.png" in images and "reward.png" in images and "per_second.png" in images
    side = json.loads((root / "runs/ci/speed.json").read_text())  # the speed stage: both methods, side by side
    assert set(side["methods"]) == {"baseline", "jagg"} and side["rounds"] == 3 and "side by side" in index
    assert {"kl_ref.png", "group_std-toy_fidelity.png", "zero_std_frac-toy_fidelity.png"} <= set(images)
    for src in images:
        assert (root / "reports/ci" / src).is_file(), src
    assert "jagg" in (root / "reports/ci/README.md").read_text()
    assert _stale(root) == set()
    status = _run([str(BIN / "dvc"), "status", PIPELINE], root)
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout + status.stderr

    # One method's param: exactly that method's train and evaluate, the side-by-side timing of the methods (it times
    # the changed method too) and the report become stale.
    text = (root / "params.yaml").read_text()
    (root / "params.yaml").write_text(text.replace("  jagg: {mode: jagg}", "  jagg: {mode: jagg, jagg_frac: 1.0}"))
    # `dvc status` names the stages whose own params or deps changed; `dvc repro` then also reruns what depends on
    # their outputs (evaluate@jagg-0 reads the new checkpoints).
    assert _stale(root) == {"train@jagg-0", "speed", "report"}
    second = _run([str(BIN / "dvc"), "repro"], root)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert _ran(second) == {"train@jagg-0", "evaluate@jagg-0", "speed", "report"}
    assert _stale(root) == set()
    # MLflow has every run with its training and evaluation metrics: baseline-s0's from `jagg run`, the retrained
    # jagg-s0's from DVC's stages, tagged with its DVC stage.
    runs = _mlflow_run_list(root, "jagg-ci")
    assert any(r["tags"]["jagg.run"] == "baseline-s0" and TRAINED_METRICS <= set(r["metrics"]) for r in runs)
    by_dvc = [r for r in runs if r["tags"]["jagg.run"] == "jagg-s0" and TRAINED_METRICS <= set(r["metrics"])
              and r["tags"].get("dvc_stage") == "evaluate@jagg-0"]  # DVC_STAGE: a root stage's bare name
    assert len(by_dvc) == 1 and by_dvc[0]["tags"]["method"] == "jagg", [r["tags"] for r in runs]
    assert by_dvc[0]["metrics"]["train/kept_fraction"] > 0  # the ci profile's reward varies within groups: it trains

    # Code: editing a module makes exactly the stages whose commands import it stale, and `dvc repro` reruns them
    # (the report's figures: one stage, so the check stays cheap; test_dvc_deps checks every stage's import list).
    import yaml

    spec = yaml.safe_load((root / PIPELINE).read_text())["stages"]
    edited = "jagg_core/pipeline/report_figures.py"
    users = set()
    for name, stage in spec.items():
        if edited in stage.get("deps", []):
            users |= ({f"{name}@{m}-0" for m in ("baseline", "jagg")} if "matrix" in stage else {name})
    with open(root / edited, "a") as f:
        f.write("\n# an edit\n")
    assert _stale(root) == users == {"report"}
    third = _run([str(BIN / "dvc"), "repro"], root)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert _ran(third) == users and _stale(root) == set()

    # A quick sweep point as a DVC experiment: one more iteration resumes each run (iterations do not change the
    # run's fingerprint) and keeps its whole curve (curve.tsv is persistent), evaluates it and records the experiment
    # with its metrics; evaluation curves are plots.
    exp = _run([str(BIN / "dvc"), "exp", "run", "-S", "profiles.ci.train.iterations=3", "--name", "three"], root)
    assert exp.returncode == 0, exp.stdout[-3000:] + exp.stderr[-3000:]
    assert {"train@baseline-0", "train@jagg-0", "evaluate@baseline-0", "evaluate@jagg-0"} <= _ran(exp)
    shown = json.loads(_run([str(BIN / "dvc"), "exp", "show", "--json"], root).stdout)
    names = {e.get("name") for rev in shown for e in (rev.get("experiments") or []) for e in e.get("revs", [])}
    assert "three" in names, shown
    assert (root / "checkpoints/ci/jagg-s0/checkpoint-000003/manifest.json").exists()
    for method in ("baseline", "jagg"):
        curve = (root / "runs/ci" / f"{method}-s0/curve.tsv").read_text().splitlines()
        assert [ln.split("\t")[0] for ln in curve[1:]] == ["1", "2", "3"]
    assert [p["step"] for p in json.loads((root / "eval/ci/jagg-s0/curve.json").read_text())] == [1, 2, 3]
    plots = _run([str(BIN / "dvc"), "plots", "show", "--json"], root)
    assert plots.returncode == 0 and "eval/ci/jagg-s0/curve.json" in plots.stdout, plots.stderr[-2000:]
