"""Stage `report`: image grids, curves and the speed table into reports/<profile>/, logged to MLflow."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Iterator

from jagg_core.setup.config import Params
from jagg_core.setup.paths import Layout, PathRuleError, inside
from jagg_core.setup.redact import redact

from .common import (DEFAULT_SWEEP, MLFLOW_UI_ENV, ROOT, add_common_args, add_sweep_arg, cli, layout, load,
                     parse_overrides, stage_logger)
from jagg_core.pipeline.tracking import Tracker
from jagg_core.setup.storage import copy_file, read_text
from jagg_core.pipeline.report_stats import ReportError


def report(params: Params, lay: Layout, *, sweep: str = DEFAULT_SWEEP) -> dict:
    """Build ``reports/<profile>/`` and attach it to the sweep's MLflow parent run."""
    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.pipeline.report import build_report

    log = stage_logger("report")
    summary = build_report(params, lay)
    tracker = Tracker(params, lay.root)
    parent = tracker.sweep_run(sweep)
    tracker.log_artifact(parent, lay.report_dir, "report")
    tracker.logger(parent).log_metrics(_sweep_metrics(summary), 0)
    tracker.finish(parent)  # the report is the sweep's last stage
    log.info("report: %s", lay.report_dir / "index.html")
    # Prefect stores an artifact's data (and its events) as given: the UI's URL goes there redacted, as everywhere.
    _prefect_artifacts(lay, summary, redact(ui_url(params).rstrip("/")), tracker.experiment_id, parent)
    return summary


def ui_url(params: Params) -> str:
    """The MLflow UI the report's links point to: ``tracking.ui_url`` where the params set it (the N-host set-up:
    ``http://head:5000``); else the one `jagg services up` started for the worker running this (``JAGG_MLFLOW_UI_URL``:
    its ``--advertise`` host and ``--mlflow-port``; before, the links named 127.0.0.1:5000 whatever the port and the
    host); else the field's default, ``http://127.0.0.1:5000``."""
    given = os.environ.get(MLFLOW_UI_ENV)
    if "ui_url" in params.tracking.model_fields_set or not given:
        return params.tracking.ui_url
    if not re.fullmatch(r"https?://\S+", given):
        stage_logger("report").warning("%s=%r is not an http(s) URL: the report links to tracking.ui_url, %s",
                                       MLFLOW_UI_ENV, redact(given), redact(params.tracking.ui_url))
        return params.tracking.ui_url
    return given


_SPEED_KEYS = ("time/iteration", "time/update", "update_speedup", "ideal_update_speedup")


def _summary_values(summary: dict) -> Iterator[tuple[str, str, str, float]]:
    """(method, "final" or "speed", name, value): final test metrics (mean over seeds) and speeds per method."""
    for row in summary["final"]:
        for metric, value in row.items():
            if isinstance(value, (list, tuple)) and value and value[0] == value[0]:
                yield row["method"], "final", metric, float(value[0])
    for row in summary["speed"]:
        for key in _SPEED_KEYS:
            if isinstance(row.get(key), float) and row[key] == row[key]:
                yield row["method"], "speed", key.removeprefix("time/"), row[key]


def _sweep_metrics(summary: dict) -> dict[str, float]:
    """The sweep's summary for its parent run: ``final/<method>/<metric>`` and ``speed/<method>/<name>``."""
    return {f"{kind}/{method}/{name}": value for method, kind, name, value in _summary_values(summary)}


def artifact_rows(summary: dict) -> list[dict]:
    """One row per method (final test metrics, mean over seeds; seconds per iteration and update; speedups), for a
    Prefect table artifact."""
    rows: dict[str, dict] = {}
    for method, kind, name, value in _summary_values(summary):
        column = name if kind == "final" else f"{name} (s)" if name in ("iteration", "update") else name
        rows.setdefault(method, {"method": method})[column] = round(value, 4)
    return list(rows.values())


def report_markdown(lay: Layout, ui_url: str, run_id: str) -> str:
    """The report's README with its figures as links into the MLflow parent run's artifacts (served by the MLflow
    UI), so that they render in the Prefect UI."""
    # redacted before the links go in: the links' own query (path, run_uuid: the project's, no secret) must stay
    # whole, and redaction treats every value of a URL's query as a secret; ui_url comes redacted
    md = redact(read_text(lay.report_dir / "README.md", ReportError, fix="run the report stage again"))
    for png in sorted(p.name for p in lay.report_dir.glob("*.png")):
        md = md.replace(f"]({png})", f"]({ui_url}/get-artifact?path=report/{png}&run_uuid={run_id})")
    return md + f"\n\nFull report: `{lay.report_dir / 'index.html'}`\n"


def _prefect_artifacts(lay: Layout, summary: dict, ui_url: str, experiment_id: str, run_id: str) -> None:
    """Inside a flow: a table of final scores and speeds, a link to the sweep's MLflow parent run, and the report
    (figures served by the MLflow UI) as artifacts of the flow run."""
    try:
        from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
        from prefect.context import FlowRunContext, TaskRunContext

        if not (FlowRunContext.get() or TaskRunContext.get()):
            return
        key = f"jagg-{lay.outputs}".replace("_", "-")
        ui_url = redact(ui_url)  # whoever calls: what reaches Prefect's database holds no secret
        create_table_artifact(redact(artifact_rows(summary)), key=f"{key}-scores",
                              description=f"Final test metrics (mean over seeds) and speeds, {lay.outputs}")
        create_link_artifact(f"{ui_url}/#/experiments/{experiment_id}/runs/{run_id}", link_text="the sweep in MLflow",
                             key=f"{key}-mlflow", description="The sweep's MLflow parent run (`jagg services up`)")
        create_markdown_artifact(report_markdown(lay, ui_url, run_id), key=f"{key}-report",
                                 description="jagg report")
    except Exception as e:  # noqa: BLE001  (a report must not fail for its Prefect links)
        stage_logger("report").warning("could not create the Prefect artifacts: %s", e)


def report_stage(params: Params, sweep: str = DEFAULT_SWEEP) -> dict:
    return report(params, layout(params), sweep=sweep)




@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg report", description=__doc__.splitlines()[0])
    add_common_args(ap)
    add_sweep_arg(ap)
    ap.add_argument("--copy-to", default=None, metavar="DIR",
                    help="also copy summary.json and the figures there (e.g. docs/results for toy-full)")
    ap.add_argument("--base-grid", default=None, metavar="PNG",
                    help="only write a grid of the evaluated base model's test images here (e.g. docs/base_model_grid.png)")
    args = ap.parse_args(argv)
    params = load(args.profile, args.params, parse_overrides(args.overrides))
    # One rule for where a path argument may point (inside the project, a folder or a file as it names), checked
    # before any work: `--base-grid /x` made a folder at the filesystem root, `--copy-to` onto a file was a traceback.
    grid = inside(ROOT, args.base_grid, "--base-grid", kind="file") if args.base_grid else None
    dest = inside(ROOT, args.copy_to, "--copy-to", kind="dir") if args.copy_to else None
    if grid is not None:
        # loads torch: imported when the stage runs, so --help and a refused input answer without it
        from jagg_core.pipeline.report_figures import base_model_grid

        if grid.suffix.lower() != ".png":
            raise PathRuleError(f"--base-grid {args.base_grid!r} must name a .png file.")
        print(base_model_grid(layout(params), grid))
        return 0
    lay = layout(params)
    summary = report(params, lay, sweep=args.sweep)
    if dest is not None:
        # each file through the project's one writing function: a link planted in the folder (a symlinked
        # dest/summary.json) is replaced, never written through (the path rule checks the folder only)
        for name in ["summary.json", *summary["figures"].values()]:
            copy_file(lay.report_dir / name, dest / name, ReportError)
        print(f"copied summary.json and {len(summary['figures'])} figures to {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
