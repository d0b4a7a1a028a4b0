"""Screenshots of what a user sees: the MLflow UI (runs side by side, a metric chart, an image grid) and the Prefect
UI (a flow run, its table of scores and its report with figures served by MLflow), taken with headless Chromium
(driven over the DevTools protocol) into docs/ui/.

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


class Browser:
    """Headless Chromium driven over the DevTools protocol: set the UI's local settings, open a page, wait, shoot."""

    def __init__(self, chromium: str, width: int = 1600, height: int = 1000):
        import tempfile

        from websockets.sync.client import connect

        self.port = _free_port()
        self.profile = tempfile.mkdtemp(prefix="jagg-chromium-")
        self.proc = subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                      f"--remote-debugging-port={self.port}", f"--user-data-dir={self.profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                pages = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=2).read())
                target = next(p for p in pages if p["type"] == "page")
                break
            except (OSError, StopIteration):
                time.sleep(0.2)
        else:
            raise SystemExit("ui_screenshots: error: Chromium did not start.")
        self.ws = connect(target["webSocketDebuggerUrl"], max_size=None)
        self.n = 0

    def call(self, method: str, **params: object) -> dict:
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.n:
                return msg.get("result", {})

    def open(self, url: str, wait: float = 6.0) -> None:
        self.call("Page.navigate", url=url)
        time.sleep(wait)

    def set_local_storage(self, origin: str, items: dict[str, object]) -> None:
        self.open(origin, wait=3.0)
        for k, v in items.items():
            self.call("Runtime.evaluate", expression=f"localStorage.setItem({json.dumps(k)}, {json.dumps(json.dumps(v))})")

    def shoot(self, url: str, out: Path, *, width: int = 1600, height: int = 1000, wait: float = 8.0,
              script: str | None = None) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.open(url, wait)
        if script:
            self.call("Runtime.evaluate", expression=script)
            time.sleep(2.0)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        import base64

        out.write_bytes(base64.b64decode(data))
        print(f"{out}  <- {url}")

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.profile, ignore_errors=True)


def _get_json(url: str, body: dict | None = None) -> object:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _latest_sweep(profile: str) -> str:
    """The name of the profile's most recent sweep in the project's MLflow store."""
    os.environ.setdefault("JAGG_ROOT", str(ROOT))
    sys.path.insert(0, str(ROOT))
    from jagg_core.setup.params_io import load_params
    from jagg_core.pipeline.tracking import Tracker

    tracker = Tracker(load_params(ROOT / "params.yaml", profile), ROOT)
    runs = tracker.client.search_runs([tracker.experiment_id], "tags.`jagg.kind` = 'sweep'",
                                      order_by=["attributes.start_time DESC"], max_results=50)
    named = [r.data.tags["jagg.sweep"] for r in runs if r.data.tags.get("jagg.sweep", "").startswith("run-")]
    if not named:
        sys.exit(f"ui_screenshots: error: no `jagg run` sweep of profile {profile} in the MLflow store; `make run` first.")
    return named[0]


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
        # The report attaches to the profile's latest sweep (that of `make run`), not to a sweep of its own.
        sweep_name = _latest_sweep(args.profile)
        run = subprocess.run([str(BIN / "prefect"), "deployment", "run", f"jagg-report/report-{args.profile}", "-p",
                              f'overrides={{"tracking.ui_url": "{ui}"}}', "-p", f"sweep={sweep_name}", "--watch"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
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
                     if t.get("jagg.kind") == "sweep" and t.get("jagg.sweep") == sweep_name)
        browser = Browser(chromium)
        try:
            # The model-training view, without the assistant panel that MLflow opens on a browser's first visit.
            # And the runs table with the columns that compare methods (the UI keeps them per browser).
            columns = ["tags.`method`", "tags.`seed`", "metrics.`eval/toy_fidelity`", "metrics.`reward/mean`",
                       "metrics.`time/iteration`", "metrics.`time/update`", "metrics.`time/backward`"]
            browser.set_local_storage(ui, {"mlflow.workflowType_v1": "machine_learning",
                                           "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": True,
                                           "mlflow.assistant.panelOpen_v1": False,
                                           f'MLflowLocalStorage-1.1-ExperimentPage-["{exp_id}"]-ReactComponentState':
                                               {"searchFilter": "tags.`jagg.kind` = 'run'",
                                                "orderByKey": "attributes.start_time", "orderByAsc": False,
                                                "startTime": "ALL", "lifecycleFilter": "Active",
                                                "datasetsFilter": [], "modelVersionFilter": "All Runs",
                                                "selectedColumns": columns, "runsHiddenMode": "FIRST_10_RUNS",
                                                "hideEmptyCharts": True, "useGroupedValuesInCharts": True,
                                                "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0,
                                                                          "selectedXAxisMetricKey": ""}}})
            ml = "workflowType=machine_learning"
            close = ("document.querySelectorAll('[data-component-id=\"mlflow.assistant.chat_panel.close\"]')"
                     ".forEach(b => b.click())")
            browser.shoot(f"{ui}/#/experiments/{exp_id}/runs?{ml}", out / "mlflow-runs.png", height=600, script=close)
            browser.shoot(f"{ui}/#/experiments/{exp_id}/runs?{ml}&compareRunsMode=CHART", out / "mlflow-charts.png",
                          height=1400, wait=12.0, script=close)
            browser.shoot(f"{ui}/#/experiments/{exp_id}/runs/{sweep}/artifacts/report/grid.png?{ml}",
                          out / "mlflow-image-grid.png", height=1200, script=close)
            browser.shoot(f"http://127.0.0.1:{prefect_port}/runs/flow-run/{flow_run}", out / "prefect-flow-run.png")
            artifacts = _get_json(f"{api}/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run]}}})
            table = next(a for a in artifacts if a["key"].endswith("-scores"))
            browser.shoot(f"http://127.0.0.1:{prefect_port}/artifacts/artifact/{table['id']}",
                          out / "prefect-artifact-scores.png", height=500)
            report = next(a for a in artifacts if a["key"].endswith("-report"))  # its figures come from MLflow
            browser.shoot(f"http://127.0.0.1:{prefect_port}/artifacts/artifact/{report['id']}",
                          out / "prefect-artifact-report.png", height=1600, wait=10.0)
        finally:
            browser.close()
    finally:
        subprocess.run([str(BIN / "jagg"), "services", "down"], cwd=ROOT, env=_env(), timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
