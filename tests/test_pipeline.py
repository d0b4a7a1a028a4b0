"""The pipeline with its real components: `dvc repro` in a fresh clone, a Prefect server and deployment, MLflow."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from tasks.common import free_port

BIN = Path(sys.executable).parent


def _env(root: Path, **extra) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"JAGG_ROOT": str(root), "PATH": f"{BIN}:{env.get('PATH', '')}", "DVC_NO_ANALYTICS": "1",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    env.pop("PREFECT_API_URL", None)
    env.update(extra)
    return env


def _clone(tmp_path: Path, profile: str = "ci") -> Path:
    """A fresh git repository holding this checkout's files (committed or not), on ``profile``."""
    root = tmp_path / "clone"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, root / f)
    text = (root / "params.yaml").read_text()
    (root / "params.yaml").write_text(re.sub(r"(?m)^profile: \S+", f"profile: {profile}", text, count=1))
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "clone"]):
        subprocess.run(cmd, cwd=root, check=True)
    return root


def _run(cmd: list[str], root: Path, timeout: float = 900, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=root, env=_env(root, **env), capture_output=True, text=True, timeout=timeout)


def _mlflow_runs(root: Path, experiment: str) -> dict[str, dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment}"
    runs = client.search_runs([exp.experiment_id], "tags.`jagg.kind` = 'run'")
    return {r.data.tags["jagg.run"]: {"metrics": r.data.metrics, "tags": r.data.tags, "id": r.info.run_id}
            for r in runs}


CI_PIPELINE = "pipelines/ci/dvc.yaml"  # the ci profile's pipeline (tasks/dvc_pipelines.py writes one per profile)


def _stage(addressed: str) -> str:
    """``pipelines/ci/dvc.yaml:train@jagg-0`` -> ``train@jagg-0``."""
    assert addressed.startswith(f"{CI_PIPELINE}:"), addressed
    return addressed.removeprefix(f"{CI_PIPELINE}:")


def _stale(root: Path) -> set[str]:
    out = _run([str(BIN / "dvc"), "status", "--json", CI_PIPELINE], root)
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
def test_dvc_repro_after_jagg_run_retrains_nothing_then_reruns_only_what_a_change_made_stale(tmp_path):
    """`make run` then `make repro`, on ci: the profile's pipeline runs the commands `jagg run` ran, into the same
    folders, so its first `dvc repro` (no dvc.lock yet: every stage runs once, to be recorded) finds every run
    trained and every evaluation made, rewrites no checkpoint, and leaves the pipeline up to date. Then what a user
    changes: a method's param, a module, an iteration more as a DVC experiment — each reruns exactly its stages.
    (One project for both halves: a `dvc repro` from nothing runs the same stage commands as this one's, which
    tests/conftest.py's fixtures and `jagg run` run in every other test; the suite's time.)"""
    root = _clone(tmp_path)
    # Two methods keep the test's time down (every stage is a fresh process); the matrix logic is the same. ci's
    # pipeline reads its methods from the top-level run.methods (its overlay sets none): the edit changes its stages.
    text = (root / "params.yaml").read_text()
    three, two = "  methods: [baseline, jagg, ablate]\n", "  methods: [baseline, jagg]\n"
    assert three in text
    (root / "params.yaml").write_text(text.replace(three, two, 1))
    run = _run([str(BIN / "jagg"), "run", "--profile", "ci"], root, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    trained = {run: _files(root / "checkpoints/ci" / run) for run in ("baseline-s0", "jagg-s0")}
    curves = {run: (root / "runs/ci" / run / "curve.tsv").read_text() for run in ("baseline-s0", "jagg-s0")}
    assert all(trained.values())
    first = _run([str(BIN / "dvc"), "repro", CI_PIPELINE], root)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert _ran(first) == {"prepare", "pretrain", "evaluate-base", "speed", "report",
                           *(f"{stage}@{m}-0" for stage in ("train", "evaluate") for m in ("baseline", "jagg"))}
    assert (root / "pipelines/ci/dvc.lock").is_file() and not (root / "dvc.lock").exists()
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

    # One method's param: exactly that method's train and evaluate, the side-by-side timing of the methods (it times
    # the changed method too) and the report become stale.
    text = (root / "params.yaml").read_text()
    (root / "params.yaml").write_text(text.replace("  jagg: {mode: jagg}", "  jagg: {mode: jagg, jagg_frac: 1.0}"))
    # `dvc status` names the stages whose own params or deps changed; `dvc repro` then also reruns what depends on
    # their outputs (evaluate@jagg-0 reads the new checkpoints).
    assert _stale(root) == {"train@jagg-0", "speed", "report"}
    second = _run([str(BIN / "dvc"), "repro", CI_PIPELINE], root)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert _ran(second) == {"train@jagg-0", "evaluate@jagg-0", "speed", "report"}
    assert _stale(root) == set()
    # MLflow has every run with its training and evaluation metrics: baseline-s0's from `jagg run`, the retrained
    # jagg-s0's from DVC's stages, tagged with its DVC stage.
    runs = _mlflow_run_list(root, "jagg-ci")
    assert any(r["tags"]["jagg.run"] == "baseline-s0" and TRAINED_METRICS <= set(r["metrics"]) for r in runs)
    by_dvc = [r for r in runs if r["tags"]["jagg.run"] == "jagg-s0" and TRAINED_METRICS <= set(r["metrics"])
              and r["tags"].get("dvc_stage") == f"{CI_PIPELINE}:evaluate@jagg-0"]
    assert len(by_dvc) == 1 and by_dvc[0]["tags"]["method"] == "jagg", [r["tags"] for r in runs]
    assert by_dvc[0]["metrics"]["train/kept_fraction"] > 0  # the ci profile's reward varies within groups: it trains

    # Code: editing a module makes exactly the stages whose commands import it stale, and `dvc repro` reruns them
    # (the report's figures: one stage, so the check stays cheap; test_dvc_deps checks every stage's import list).
    import yaml

    spec = yaml.safe_load((root / CI_PIPELINE).read_text())["stages"]
    edited = "jagg_core/pipeline/report_figures.py"
    users = set()
    for name, stage in spec.items():
        if edited in stage.get("deps", []):
            users |= ({f"{name}@{m}-0" for m in ("baseline", "jagg")} if "matrix" in stage else {name})
    with open(root / edited, "a") as f:
        f.write("\n# an edit\n")
    assert _stale(root) == users == {"report"}
    third = _run([str(BIN / "dvc"), "repro", CI_PIPELINE], root)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert _ran(third) == users and _stale(root) == set()

    # A quick sweep point as a DVC experiment: one more iteration resumes each run (iterations do not change the
    # run's fingerprint) and keeps its whole curve (curve.tsv is persistent), evaluates it and records the experiment
    # with its metrics; evaluation curves are plots.
    exp = _run([str(BIN / "dvc"), "exp", "run", CI_PIPELINE, "-S", "profiles.ci.train.iterations=3", "--name", "three"],
               root)
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


def _flow_artifacts(api: str, flow_run_id: str) -> dict[str, dict]:
    """key -> {type, data} of a flow run's artifacts, read back through the Prefect server's REST API."""
    import urllib.request

    body = json.dumps({"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}).encode()
    req = urllib.request.Request(f"{api}/artifacts/filter", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return {a["key"]: a for a in json.loads(r.read())}


def _get(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200, url
        return r.read()


@pytest.mark.slow
def test_prefect_deployment_run_completes_and_logs_to_mlflow(tmp_path):
    root = _clone(tmp_path)
    port, mlflow_port = free_port(), free_port()
    up = _run([str(BIN / "jagg"), "services", "up", "--prefect-port", str(port), "--mlflow-port", str(mlflow_port)],
              root, timeout=300)
    api = f"http://127.0.0.1:{port}/api"
    env = {"PREFECT_API_URL": api, "PREFECT_HOME": str(root / ".services/prefect")}
    ui = f"http://127.0.0.1:{mlflow_port}"

    def deployment_run(*args: str, timeout: float = 1000) -> subprocess.CompletedProcess:
        return _run([str(BIN / "prefect"), "deployment", "run", "jagg-reproduce/ci", *args, "--watch",
                     "--watch-timeout", "900"], root, timeout=timeout, **env)

    try:
        assert up.returncode == 0, up.stdout + up.stderr
        # `jagg services up` lists what it deployed: every deployment of prefect.yaml (the video profile's too).
        import yaml

        listed = re.search(r"^deployments: (.*)$", up.stdout, re.M).group(1).split(", ")
        names = [d["name"] for d in yaml.safe_load((root / "prefect.yaml").read_text())["deployments"]]
        assert len(listed) == len(names) and {"jagg-reproduce/ci", "jagg-reproduce/wan"} <= set(listed), listed
        # tracking.* overrides say where results are logged, not what is computed: the profile's own folders. Two runs
        # at a time: the first two runs' evaluations go beside the third's training, one after the other (two model
        # loads at once in the flow's process failed with a meta-tensor error before they were chained).
        run = deployment_run("-p", f'overrides={{"tracking.ui_url": "{ui}"}}', "-p", "parallel_runs=2")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "Completed" in run.stdout
        flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", run.stdout).group(1)
        artifacts = _flow_artifacts(api, flow_run_id)
        # A table of final scores and speeds, a link to the sweep's MLflow run, the report with figures that resolve.
        table = json.loads(artifacts["jagg-ci-scores"]["data"])
        assert {r["method"] for r in table} == {"baseline", "jagg", "ablate"}
        assert all("toy_fidelity" in r and "update (s)" in r for r in table)
        link = re.search(r"\((http[^)]+)\)", artifacts["jagg-ci-mlflow"]["data"]).group(1)
        assert link.startswith(f"{ui}/#/experiments/") and _get(link.split("#")[0])
        images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", artifacts["jagg-ci-report"]["data"])
        assert images and all(u.startswith(f"{ui}/get-artifact?") for u in images)
        assert _get(images[-1]).startswith(b"\x89PNG")
        # Both servers listen on the loopback interface only (the default of `jagg services up`).
        import psutil

        listening = {c.laddr.port: c.laddr.ip for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert listening.get(port) == "127.0.0.1" and listening.get(mlflow_port) == "127.0.0.1", listening

        # A sweep point: another params file (only jagg) plus overrides, validated and run into folders of its own.
        alt = (root / "params.yaml").read_text().replace("  ci:\n", "  ci:\n    run: {methods: [jagg]}\n", 1)
        (root / "alt.yaml").write_text(alt)
        point = deployment_run("-p", "params_file=alt.yaml", "-p", 'overrides={"train.iterations": 1}')
        assert point.returncode == 0, point.stdout[-3000:] + point.stderr[-3000:]
        points = [p for p in (root / "runs").iterdir() if p.name.startswith("ci-")]
        # its one run, and its own side-by-side timing (the speed stage)
        assert len(points) == 1 and sorted(p.name for p in points[0].iterdir()) == ["jagg-s0", "speed.json"]
        assert (root / "reports" / points[0].name / "index.html").exists()
        assert (root / "reports/ci/index.html").exists()  # the profile's own report is untouched

        # A bad override fails the flow run with the schema's one sentence, before any work.
        bad = deployment_run("-p", 'overrides={"train.lr": "abc"}', timeout=300)
        assert bad.returncode != 0 and "Failed" in bad.stdout, bad.stdout[-2000:]
        bad_id = re.search(r"UUID: ([0-9a-f-]{36})", bad.stdout).group(1)
        state = json.loads(_get(f"{api}/flow_runs/{bad_id}"))["state"]
        assert "train.lr = 'abc' is invalid" in state["message"], state
    finally:
        _run([str(BIN / "jagg"), "services", "down"], root, timeout=120)
    runs = _mlflow_runs(root, "jagg-ci")
    for method in ("baseline", "jagg"):
        r = runs[f"{method}-s0"]
        assert {"reward/mean", "time/iteration", "eval/toy_fidelity"} <= set(r["metrics"])
        assert r["tags"].get("prefect_flow_run_id")
        assert r["tags"].get("mlflow.source.git.commit") == r["tags"].get("git_commit")
        assert any(k.startswith("system/cpu_utilization") for k in r["metrics"])  # MLflow's system metrics
        ckpt = root / r["tags"]["jagg.checkpoint"]  # the checkpoint a run ended with, and its manifest's digest
        assert hashlib.sha256((ckpt / "manifest.json").read_bytes()).hexdigest() == r["tags"][
            "jagg.checkpoint_manifest_sha256"]
    # every run of the sweeps ended (the base model's evaluation and the parent too), and the parent holds a summary
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("jagg-ci")
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    everything = client.search_runs([exp.experiment_id])
    assert everything and {r.info.status for r in everything} == {"FINISHED"}
    parents = {r.data.tags["jagg.sweep"]: r for r in everything if r.data.tags.get("jagg.kind") == "sweep"}
    assert len(parents) == 2  # the profile's flow run and the sweep point's
    assert {"final/baseline/toy_fidelity", "speed/jagg/update"} <= set(parents[flow_run_id].data.metrics)


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("train.lr=abc", "train.lr = 'abc' is invalid"),
        ("train.lrr=1", "unknown key 'train.lrr'"),
        ("jagg.window=1", "jagg.window = 1 is invalid"),
        ("jagg.jagg_frac=1.5", "jagg_frac must be a number in [0, 1] or 'auto'"),
        ("model.backbone=sdxl", "unknown backbone"),
        ("reward.weights={hps: 1}", "unknown reward 'hps'"),
    ],
)
def test_bad_params_exit_nonzero_with_one_sentence_and_write_nothing(tmp_path, override, fragment):
    root = tmp_path / "p"
    root.mkdir()
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    out = _run([sys.executable, "-m", "tasks.prepare", "--profile", "ci", "--set", override], root, timeout=120)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("jagg: error: ") and fragment in lines[0], out.stderr
    assert sorted(p.name for p in root.iterdir()) == ["params.yaml"]


def test_pretrain_keeps_an_up_to_date_base_model_and_retrains_a_stale_one(ci_project):
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout
    from tasks.pretrain import pretrain

    lay = Layout(ci_project, "ci")
    weights = next((lay.base_model / "transformer").glob("*.safetensors"))
    before = weights.read_bytes()
    params = load_params(ci_project / "params.yaml", "ci")
    card = pretrain(params, lay, progress=False)
    assert card["steps"] == params.pretrain.steps and weights.read_bytes() == before  # kept, not retrained
    changed = load_params(ci_project / "params.yaml", "ci", {"pretrain.seed": 1})
    pretrain(changed, lay, progress=False)
    assert json.loads((lay.base_model / "card.json").read_text())["seed"] == 1
    assert next((lay.base_model / "transformer").glob("*.safetensors")).read_bytes() != before


def test_pretraining_is_bit_identical_for_the_same_params_and_reports_progress(tmp_path):
    """The base model depends on the params only (a step count, no clock): two runs give the same bytes."""
    from jagg_core.setup.params_io import load_params
    from jagg_core.pipeline.pretrain import pretrain_toy

    params = load_params(REPO / "params.yaml", "ci", {"pretrain.steps": 6, "pretrain.warmup": 2})
    lines: list[str] = []
    for name in ("a", "b"):
        pretrain_toy(params, tmp_path / name, progress=False, report=lines.append, report_every_s=0.0)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*")
                   if p.is_file() and p.name not in ("card.json", "README.md"))  # cards hold the wall time
    assert any(p.suffix == ".safetensors" for p in files)
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    assert json.loads((tmp_path / "a" / "card.json").read_text())["steps"] == 6
    assert len(lines) == 12 and lines[-1].startswith("pretrain toy-flux: step 6/6")
