"""`make run` then a bare `dvc repro` on ci in a fresh clone whose active profile is ci (its pipeline the root's
dvc.yaml): it runs nothing `jagg run` ran (`jagg run` records it in dvc.lock), and each later change (a method's param, a module, a DVC experiment)
reruns exactly the stages it made stale. The same project carries issue 61's planted secrets (mechanism 3) in ci's own
section of params.yaml, where a user running DVC keeps them: after the `jagg run` and the first `dvc repro` none is in
any store (mlflow.db, Prefect's database), dvc.lock, .dvc/, another file or folder name, or what was printed.

A file of its own (its `jagg run` and ~17 stage processes are among the suite's longest: 5 min 20 s alone on the Intel
Xeon): pytest-xdist gives each file to one worker, and tests/conftest.py starts the longest files first. One project
for both tests (a module fixture), the secrets' test first: it only reads, the other then changes the project.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import run_module
from fault_helpers import _files_holding, _one_sentence
from test_pipeline import BIN, _clone, _run, _with_ci_base
from test_redaction import _pieces, _sqlite_cells_holding

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



# Drawn as the tests run: a secret written in this file would be found in the project's copy of it.
URL_PASSWORD = f"Hn4W{secrets.token_hex(5)}"  # tracking.ui_url's: a URL's credentials
TOKEN = f"tok-{secrets.token_hex(6)}"  # a served reward's token (a secret by its key's name)
PHRASE = f"phrase-{secrets.token_hex(6)}"  # a plugin's option under a name the word list does not know, marked secret

VAULT = '''"""A reward whose option seed_phrase is a secret its spec marks."""
from jagg_core.rewards import register_reward


@register_reward("vault", options={"seed_phrase": (str, None)}, secret=("seed_phrase",))
def vault(seed_phrase: str | None = None):
    def fn(images, prompts, metadata):
        return images.mean(dim=(1, 2, 3)).float().cpu(), {}
    return fn
'''


@dataclass
class Repro:
    root: Path
    trained: dict  # run -> its checkpoint files (mtime, bytes) after `jagg run`
    curves: dict  # run -> its curve.tsv after `jagg run`
    first: subprocess.CompletedProcess  # the first bare `dvc repro`
    printed: str  # everything the refused start, `jagg run` and the first `dvc repro` printed
    stale_after_run: set  # `dvc status dvc.yaml`'s stale stages right after `jagg run`
    first_s: float  # the first bare `dvc repro`'s wall time


@pytest.fixture(scope="module")
def repro(ci_base, tmp_path_factory) -> Repro:
    """`make pipelines`, `make run`, then a bare `dvc repro`, on a clone whose active profile is ci, with two methods
    (every stage is a fresh process: the suite's time; the matrix logic is the same) and the planted secrets; and,
    first, a stage started under a sweep name holding the token (refused)."""
    # ci's pipeline reads its methods from the top-level run.methods (its overlay sets none): the edit changes its stages
    root = _with_ci_base(_clone(tmp_path_factory.mktemp("repro")), ci_base, methods="[baseline, jagg]")
    text = (root / "params.yaml").read_text()
    # the secrets, in ci's own section: a served reward's token (the reward unweighted: it changes no result), a
    # plugin's secret option and a URL's password
    reward = "    reward: {weights: {toy_fidelity: 1.0, toy_preference: 1.0}}\n"
    planted = ("    reward:\n      weights: {toy_fidelity: 1.0, toy_preference: 1.0}\n"
               f"      options: {{served: {{url: 'http://127.0.0.1:9/score', token: '{TOKEN}'}}, "
               f"vault: {{seed_phrase: '{PHRASE}'}}}}\n"
               "    plugins: [plugins/vault.py]\n"
               f"    tracking: {{ui_url: 'http://alice:{URL_PASSWORD}@127.0.0.1:5000'}}\n")
    assert text.count(reward) == 1
    (root / "params.yaml").write_text(text.replace(reward, planted))
    (root / "plugins").mkdir(exist_ok=True)
    (root / "plugins" / "vault.py").write_text(VAULT)
    # `make pipelines` on the clone, whose params.yaml says `profile: ci`: ci's pipeline comes to the root, toy's goes
    # to pipelines/toy/ (what a user who switches profile commits)
    moved = _run([str(BIN / "python"), "-m", "tasks.dvc_pipelines"], root)
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert "--profile ci " in (root / "dvc.yaml").read_text() and not (root / "pipelines/ci").exists()
    assert (root / "pipelines/toy/dvc.yaml").is_file()
    # The other profiles' pipelines (tests/test_dvc_pipelines.py checks them) leave the clone: DVC builds its index of
    # every pipeline in the repository again after each stage it runs: 4.0–4.6 s of CPU for the repository's eleven
    # pipelines (331 stages), 0.9 s for ci's and toy's (22), and no claim here is about another profile's stages.
    for other in (root / "pipelines").iterdir():
        if other.is_dir() and other.name != "toy":
            shutil.rmtree(other)
    for cmd in (["git", "add", "-A"], ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "ci"]):
        subprocess.run(cmd, cwd=root, check=True)
    prefect = {"PREFECT_HOME": str(root / ".prefect"), "PREFECT_API_URL": ""}
    # the sweep name: refused at a stage's door before anything is stored under it
    refused = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--seed", "0",
                         "--sweep", f"sweep-{TOKEN}", root=root, env=prefect, timeout=300)
    printed = refused.stdout + refused.stderr
    assert refused.returncode == 1 and "sweep name holds a secret" in printed, printed[-3000:]
    _one_sentence(refused.stderr.strip().splitlines()[-1])
    run = _run([str(BIN / "jagg"), "run", "--profile", "ci"], root, timeout=1200, **prefect)
    printed += run.stdout + run.stderr
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "DVC's record of dvc.yaml is this run's" in run.stdout + run.stderr, run.stdout[-3000:] + run.stderr[-3000:]
    trained = {r: _files(root / "checkpoints/ci" / r) for r in ("baseline-s0", "jagg-s0")}
    curves = {r: (root / "runs/ci" / r / "curve.tsv").read_text() for r in ("baseline-s0", "jagg-s0")}
    stale_after_run = _stale(root)
    start = time.perf_counter()
    first = _run([str(BIN / "dvc"), "repro"], root)  # bare: the root's dvc.yaml
    first_s = time.perf_counter() - start
    printed += first.stdout + first.stderr
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return Repro(root, trained, curves, first, printed, stale_after_run, first_s)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the module's `jagg run` and first `dvc repro`, beside another test worker on 2 cores
def test_a_planted_password_is_in_no_store_no_lock_no_file_and_no_folder_name_after_jagg_run_and_dvc_repro(repro):
    """Before 4fb33cb every stage listed the whole overlay `profiles.ci` as a DVC param, so a secret there was in
    clear in dvc.lock. Now: a sweep name holding the token is refused in one sentence; `jagg run --profile ci` and
    `dvc repro` of ci's pipeline (each stage recorded, the trained runs found trained) leave the URL's password, the
    token and the secret plugin option in params.yaml alone."""
    root = repro.root
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]  # the stores and the lock were written (else
    assert {"train@jagg-0", "evaluate@jagg-0", "report"} <= set(lock), set(lock)  # the grep below proves nothing)
    mlflow_db, prefect_db = root / "mlflow.db", root / ".prefect" / "prefect.db"
    assert mlflow_db.exists() and prefect_db.exists()
    assert (root / "reports/ci/index.html").exists() and (root / "checkpoints/ci/jagg-s0").is_dir()
    for needle in _pieces(URL_PASSWORD) + [TOKEN, PHRASE]:
        assert _sqlite_cells_holding(mlflow_db, [needle]) == [], needle
        assert _sqlite_cells_holding(prefect_db, [needle]) == [], needle
        assert _files_holding(root, needle.encode()) == ["params.yaml"], needle  # the user's own file alone
        assert not [p for p in root.rglob("*") if needle in p.name], f"{needle!r} names a file or folder"
        assert needle not in repro.printed, f"{needle!r} was printed"
    # a section holding a secret is listed by its other keys: the stage still reruns when they change
    listed = lock["train@jagg-0"]["params"]["params.yaml"]
    assert "profiles.ci.train" in listed and "profiles.ci.reward.options.served.url" in listed, listed


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~20 stage processes after the module's; beside another test worker on 2 cores
def test_dvc_repro_after_jagg_run_retrains_nothing_then_reruns_only_what_a_change_made_stale(repro):
    """`make run` then `make repro`, on ci as the active profile: its pipeline is the root's dvc.yaml (`make
    pipelines` put it there) and runs the commands `jagg run` ran, into the same folders, and `jagg run` leaves DVC's
    record (dvc.lock, by `dvc commit`: tasks/dvc_record.py) holding what it finished, so `dvc status dvc.yaml` says it
    is up to date at once and a bare `dvc repro` runs no stage, in under a minute, rewriting nothing. Then what a user
    changes: a method's param, a module, an iteration more as a DVC experiment — each reruns exactly its stages.
    (One project for both halves: a `dvc repro` from nothing runs the same stage commands as this one's, which
    tests/conftest.py's fixtures and `jagg run` run in every other test; the suite's time. For the same reason the
    clone starts with the session's ci prompts and base model, which its prepare and pretrain stages find up to date,
    as they do after `jagg run`.)"""
    root, trained, curves, first = repro.root, repro.trained, repro.curves, repro.first
    assert all(trained.values())
    assert repro.stale_after_run == set()  # `jagg run` recorded every stage it ran
    assert _ran(first) == set() and "Running stage" not in first.stdout, first.stdout[-3000:]
    assert repro.first_s < 60, f"a bare dvc repro that runs nothing took {repro.first_s:.0f} s"
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
    assert set(side["methods"]) == {"baseline", "jagg"} and side["rounds"] == 3
    # the table, or (where the suite's load kept the stage off its core: side_by_side.py) why it is not shown
    assert "side by side" in index and ("cannot be trusted" in index) != side["trusted"]
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
    # MLflow has every run with its training and evaluation metrics: baseline-s0's from `jagg run`; jagg-s0 one run
    # per fingerprint (`jagg run`'s, and the retrained one, tagged with the DVC stages that trained and evaluated it:
    # the evaluation's under eval., issue 61, mechanism 5).
    runs = _mlflow_run_list(root, "jagg-ci")
    assert any(r["tags"]["jagg.run"] == "baseline-s0" and TRAINED_METRICS <= set(r["metrics"]) for r in runs)
    jagg_runs = [r for r in runs if r["tags"]["jagg.run"] == "jagg-s0" and TRAINED_METRICS <= set(r["metrics"])]
    assert len(jagg_runs) == 2 and len({r["tags"]["jagg.key"] for r in jagg_runs}) == 2, [r["tags"] for r in runs]
    by_dvc = [r for r in jagg_runs if r["tags"].get("dvc_stage") == "train@jagg-0"  # DVC_STAGE: a root stage's bare
              and r["tags"].get("eval.dvc_stage") == "evaluate@jagg-0"]  # name
    assert len(by_dvc) == 1, [r["tags"] for r in runs]
    assert all(r["tags"]["method"] == "jagg" for r in jagg_runs)
    assert all(r["metrics"]["train/kept_fraction"] > 0 for r in jagg_runs)  # ci's reward varies: it trains

    # Code: editing a module makes exactly the stages whose commands import it stale, and `dvc repro` reruns them
    # (the report's figures: one stage, so the check stays cheap; test_dvc_deps checks every stage's import list).
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

    # A quick sweep point as a DVC experiment, on one run's evaluation (its training upstream): one more iteration
    # resumes the run (iterations do not change the run's fingerprint) and keeps its whole curve (curve.tsv is
    # persistent), evaluates it and records the experiment with its metrics; evaluation curves are plots. The run the
    # experiment does not target keeps its two iterations.
    exp = _run([str(BIN / "dvc"), "exp", "run", "evaluate@jagg-0", "-S", "profiles.ci.train.iterations=3",
                "--name", "three"], root)
    assert exp.returncode == 0, exp.stdout[-3000:] + exp.stderr[-3000:]
    assert _ran(exp) == {"train@jagg-0", "evaluate@jagg-0"}
    shown = json.loads(_run([str(BIN / "dvc"), "exp", "show", "--json"], root).stdout)
    names = {e.get("name") for rev in shown for e in (rev.get("experiments") or []) for e in e.get("revs", [])}
    assert "three" in names, shown
    assert (root / "checkpoints/ci/jagg-s0/checkpoint-000003/manifest.json").exists()
    for method, steps in (("baseline", ["1", "2"]), ("jagg", ["1", "2", "3"])):
        curve = (root / "runs/ci" / f"{method}-s0/curve.tsv").read_text().splitlines()
        assert [ln.split("\t")[0] for ln in curve[1:]] == steps, method
    assert [p["step"] for p in json.loads((root / "eval/ci/jagg-s0/curve.json").read_text())] == [1, 2, 3]
    plots = _run([str(BIN / "dvc"), "plots", "show", "--json"], root)
    assert plots.returncode == 0 and "eval/ci/jagg-s0/curve.json" in plots.stdout, plots.stderr[-2000:]
