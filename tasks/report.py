"""Stage `report`: image grids, curves and the speed table into reports/<profile>/, logged to MLflow."""

from __future__ import annotations

import argparse
import sys

from prefect import task

from jagg_core.config import Params
from jagg_core.paths import Layout

from .common import ROOT, add_common_args, cli, layout, load, parse_overrides, stage_logger, sweep_id


def report(params: Params, lay: Layout) -> dict:
    """Build ``reports/<profile>/`` and attach it to the sweep's MLflow parent run."""
    from jagg_core.report import build_report
    from jagg_core.tracking import Tracker

    log = stage_logger("report")
    summary = build_report(params, lay)
    tracker = Tracker(params, lay.root)
    parent = tracker.sweep_run(sweep_id())
    tracker.log_artifact(parent, lay.report_dir, "report")
    tracker.logger(parent).log_metrics(_sweep_metrics(summary), 0)
    tracker.finish(parent)  # the report is the sweep's last stage
    log.info("report: %s", lay.report_dir / "index.html")
    _prefect_artifact(lay)
    return summary


def _sweep_metrics(summary: dict) -> dict[str, float]:
    """The sweep's summary for its parent run: final metrics (mean over seeds) and speeds per method."""
    out = {}
    for row in summary["final"]:
        for metric, value in row.items():
            if isinstance(value, (list, tuple)) and value and value[0] == value[0]:
                out[f"final/{row['method']}/{metric}"] = float(value[0])
    for row in summary["speed"]:
        for key in ("time/iteration", "time/update", "update_speedup", "ideal_update_speedup"):
            if isinstance(row.get(key), float) and row[key] == row[key]:
                out[f"speed/{row['method']}/{key.removeprefix('time/')}"] = row[key]
    return out


def _prefect_artifact(lay: Layout) -> None:
    """Inside a flow, the report's README becomes a Prefect markdown artifact (linked from the flow run)."""
    try:
        from prefect.artifacts import create_markdown_artifact
        from prefect.context import FlowRunContext, TaskRunContext

        if not (FlowRunContext.get() or TaskRunContext.get()):
            return
        md = (lay.report_dir / "README.md").read_text()
        md += f"\n\nFull report: `{lay.report_dir / 'index.html'}`\n"
        create_markdown_artifact(md, key=f"jagg-report-{lay.profile}".replace("_", "-"), description="jagg report")
    except Exception as e:  # noqa: BLE001  (a report must not fail for its Prefect link)
        stage_logger("report").warning("could not create the Prefect artifact: %s", e)


@task(name="report")
def report_task(params: Params) -> dict:
    return report(params, layout(params))


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg report", description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--copy-to", default=None, metavar="DIR",
                    help="also copy summary.json and the figures there (e.g. docs/results for toy-full)")
    ap.add_argument("--base-grid", default=None, metavar="PNG",
                    help="only write a grid of the evaluated base model's test images here (e.g. docs/base_model_grid.png)")
    args = ap.parse_args(argv)
    params = load(args.profile, args.params, parse_overrides(args.overrides))
    if args.base_grid:
        from jagg_core.report import base_model_grid

        print(base_model_grid(layout(params), ROOT / args.base_grid))
        return 0
    lay = layout(params)
    summary = report(params, lay)
    if args.copy_to:
        import shutil

        dest = ROOT / args.copy_to
        dest.mkdir(parents=True, exist_ok=True)
        for name in ["summary.json", *summary["figures"].values()]:
            shutil.copyfile(lay.report_dir / name, dest / name)
        print(f"copied summary.json and {len(summary['figures'])} figures to {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
