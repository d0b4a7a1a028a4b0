"""Screenshots of what a user sees: the MLflow UI (runs side by side, a metric chart, an image grid) and the Prefect
UI (a flow run and its artifacts), taken with headless Chromium into docs/ui/.

    .venv/bin/python scripts/ui_screenshots.py [--profile toy] [--out docs/ui]

Needs a finished `make run` (or `jagg run --profile <profile>`) in this checkout, and Debian's `chromium`. Starts the
services (`jagg services up` on free ports), runs the `jagg-report/report-toy` deployment once (so that a flow run
with its artifacts exists; the report is rebuilt from disk), takes the screenshots and stops the services.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, JAGG_ROOT=str(ROOT), PATH=f"{BIN}:{os.environ.get('PATH', '')}", HF_HUB_OFFLINE="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    env.update(extra)
    return env


def _shoot(chromium: str, url: str, out: Path, size: str = "1600,1000", wait_ms: int = 25000) -> None:
    """One screenshot of ``url`` after ``wait_ms`` of (virtual) time for the page's scripts to render."""
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={size}",
           f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url]
    subprocess.run(cmd, check=True, capture_output=True, timeout=180)
    print(f"{out.relative_to(ROOT)}  <- {url}")


def _get_json(url: str, body: dict | None = None) -> object:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="toy")
    ap.add_argument("--out", default="docs/ui")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        sys.exit("ui_screenshots: error: Chromium is not installed (Debian: apt-get install chromium).")
    if not (ROOT / "reports" / args.profile / "index.html").exists():
        sys.exit(f"ui_screenshots: error: no report for profile {args.profile}; run `make run` first.")
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    prefect_port, mlflow_port = _free_port(), _free_port()
    ui = f"http://127.0.0.1:{mlflow_port}"
    api = f"http://127.0.0.1:{prefect_port}/api"
    env = _env(PREFECT_API_URL=api, PREFECT_HOME=str(ROOT / ".services/prefect"))
    up = subprocess.run([str(BIN / "jagg"), "services", "up", "--prefect-port", str(prefect_port), "--mlflow-port",
                         str(mlflow_port)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    if up.returncode != 0:
        sys.exit(f"ui_screenshots: error: could not start the services: {up.stderr.strip()[-500:]}")
    try:
        run = subprocess.run([str(BIN / "prefect"), "deployment", "run", f"jagg-report/report-{args.profile}", "-p",
                              f'overrides={{"tracking.ui_url": "{ui}"}}', "--watch"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
        if run.returncode != 0:
            sys.exit(f"ui_screenshots: error: the report deployment failed: {run.stdout[-800:]}")
        flow_run = re.search(r"UUID: ([0-9a-f-]{36})", run.stdout).group(1)
        for _ in range(60):  # the MLflow UI starts in the background
            try:
                urllib.request.urlopen(f"{ui}/health", timeout=5)
                break
            except OSError:
                time.sleep(1)
        exp = _get_json(f"{ui}/api/2.0/mlflow/experiments/get-by-name?experiment_name=jagg-{args.profile}")
        exp_id = exp["experiment"]["experiment_id"]
        runs = _get_json(f"{ui}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp_id], "max_results": 200,
                                                               "order_by": ["attributes.start_time DESC"]})["runs"]
        tags = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
        sweep = next(r["info"]["run_id"] for r, t in zip(runs, tags)
                     if t.get("jagg.kind") == "sweep" and t.get("jagg.sweep") == flow_run)
        _shoot(chromium, f"{ui}/#/experiments/{exp_id}/runs", out / "mlflow-runs.png")
        _shoot(chromium, f"{ui}/#/experiments/{exp_id}/runs?compareRunsMode=CHART", out / "mlflow-charts.png",
               size="1600,1400")
        _shoot(chromium, f"{ui}/#/experiments/{exp_id}/runs/{sweep}/artifacts/report/grid.png",
               out / "mlflow-image-grid.png", size="1600,1200")
        _shoot(chromium, f"http://127.0.0.1:{prefect_port}/runs/flow-run/{flow_run}", out / "prefect-flow-run.png")
        artifacts = _get_json(f"{api}/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run]}}})
        table = next(a for a in artifacts if a["key"].endswith("-scores"))
        _shoot(chromium, f"http://127.0.0.1:{prefect_port}/artifacts/artifact/{table['id']}",
               out / "prefect-artifact-scores.png")
    finally:
        subprocess.run([str(BIN / "jagg"), "services", "down"], cwd=ROOT, env=_env(), timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
