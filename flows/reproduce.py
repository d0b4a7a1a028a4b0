"""Prefect flows: the full reproduction (prepare → pretrain → train per method × seed → evaluate → report),
evaluation only, and report only. Deployments of these flows are in prefect.yaml."""

from __future__ import annotations

import os

from prefect import flow
from prefect.context import FlowRunContext
from prefect.task_runners import ThreadPoolTaskRunner

from jagg_core.paths import run_name
from tasks.common import load
from tasks.evaluate import evaluate_task
from tasks.prepare import prepare_task
from tasks.pretrain import pretrain_task
from tasks.report import report_task
from tasks.train import train_task


def _sweep() -> None:
    """All runs of this flow run share one MLflow parent run, keyed by the flow run id."""
    ctx = FlowRunContext.get()
    if ctx and ctx.flow_run and "JAGG_SWEEP" not in os.environ:
        os.environ["JAGG_SWEEP"] = str(ctx.flow_run.id)


@flow(name="jagg-reproduce", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=4))
def reproduce(profile: str = "toy", parallel_runs: int = 1) -> dict:
    """Baseline vs JAGG vs ablate end to end on one profile.

    Args:
        profile: a profile of params.yaml.
        parallel_runs: training runs at a time (on GPUs, give each method its devices in
            resources.cuda_visible_devices).
    """
    _sweep()
    params = load(profile)
    prepare_task(params)
    pretrain_task(params)
    evaluate_task(params, "base")
    # Runs one at a time by default: on a shared CPU, overlapping runs would distort each other's timings.
    runs = [(m, s) for s in params.run.seeds for m in params.run.methods]
    finished = []
    for i in range(0, len(runs), max(1, parallel_runs)):
        batch = [train_task.submit(params, m, s) for m, s in runs[i : i + parallel_runs]]
        finished += [f.result() for f in batch]
    for m, s in runs:
        evaluate_task(params, run_name(m, s))
    return {"report": report_task(params), "runs": finished}


@flow(name="jagg-evaluate", log_prints=True)
def evaluate_only(profile: str = "toy") -> dict:
    """Evaluate the base model and every run's checkpoints, then rebuild the report."""
    _sweep()
    params = load(profile)
    evaluate_task(params, "base")
    for s in params.run.seeds:
        for m in params.run.methods:
            evaluate_task(params, run_name(m, s))
    return report_task(params)


@flow(name="jagg-report", log_prints=True)
def report_only(profile: str = "toy") -> dict:
    """Rebuild the report from what is on disk."""
    _sweep()
    return report_task(load(profile))
