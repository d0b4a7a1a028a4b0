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


def _with_ci_base(root: Path, ci_base: Path, methods: str | None = None) -> Path:
    """``root`` (a :func:`_clone`) with the ci profile's prompts and base model of the session's ``ci_base`` (what
    the clone's own prepare and pretrain stages would make, bit for bit: tests/conftest.py), which its stages then
    find up to date; with ``methods`` (e.g. ``"[baseline, jagg]"``), the top-level run.methods the ci profile reads,
    committed."""
    for item in ci_base.iterdir():
        if item.name != "params.yaml":
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, root / item.name)
    if methods is not None:
        text = (root / "params.yaml").read_text()
        three = "  methods: [baseline, jagg, ablate]\n"
        assert three in text
        (root / "params.yaml").write_text(text.replace(three, f"  methods: {methods}\n", 1))
        for cmd in (["git", "add", "params.yaml"], ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm",
                                                    f"methods: {methods}"]):
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
def test_prefect_deployment_run_completes_and_logs_to_mlflow(ci_base, tmp_path):
    # Two of the profile's methods (a third's training and evaluation would be more of the same), in a clone with the
    # session's prepared ci prompts and base model.
    root = _with_ci_base(_clone(tmp_path), ci_base, methods="[baseline, jagg]")
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
        assert {r["method"] for r in table} == {"baseline", "jagg"}
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

        # A sweep point: another params file (a profile of its own on ci, only jagg) plus overrides, validated and run
        # into folders of its own (a user's file builds on the project's and never changes its profiles)
        alt = "extends: params.yaml\nprofiles:\n  ci-alt: {extends: ci, run: {methods: [jagg]}}\n"
        (root / "alt.yaml").write_text(alt)
        point = deployment_run("-p", "params_file=alt.yaml", "-p", "profile=ci-alt",
                               "-p", 'overrides={"train.iterations": 1}')
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
    assert len(parents) == 1  # the profile's flow run; the sweep point's is in its own profile's experiment
    alt = client.get_experiment_by_name("jagg-ci-alt")
    assert alt and [r for r in client.search_runs([alt.experiment_id]) if r.data.tags.get("jagg.kind") == "sweep"]
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
