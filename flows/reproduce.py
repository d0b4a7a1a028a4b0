"""Prefect flows: the full reproduction (prepare → pretrain → train per method × seed → evaluate → report),
evaluation only, and report only. Deployments of these flows are in prefect.yaml.

Every flow takes the profile, an optional params file and optional parameter overrides (``{"train.iterations": 8}``),
validated by the same schema as params.yaml, with the same one-sentence errors. A flow run with overrides is a sweep
point: its runs, checkpoints, evaluations and report go to folders of its own (``<profile>-<digest of the overrides>``),
beside the profile's, while it shares the profile's prompt set and base model. Overrides of ``tracking.*`` and
``resources.*`` (where results are logged, which devices run them) are no part of the digest: alone they keep the
profile's folders, beside others the point's; a secret is hashed redacted (``sweep_digest``). With
``resources.dispatch: pool`` every training and evaluation of the reproduction is a flow run of its own on the work
pool, taken by any worker on any host (``flows/pool.py``; docs/scaling.md).
"""

from __future__ import annotations

import json
from typing import Any

from prefect import allow_failure, flow
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner

from jagg_core.setup.config import ParamsError
from jagg_core.setup.paths import run_name
from jagg_core.setup.redact import redact
from tasks.common import shown_redacted
from tasks.dvc_record import record_in_dvc

from .pool import run_on_pool
from .stages import evaluate_task, prepare_task, pretrain_task, report_task, speed_task, train_task
from .sweep import flow_params, sweep_digest, sweep_name, sweep_tracked

__all__ = ["evaluate_only", "flow_params", "report_only", "reproduce", "sweep_digest", "sweep_name"]


@flow(name="jagg-reproduce", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=4))
@shown_redacted
def reproduce(profile: str = "toy", parallel_runs: int = 1, overrides: dict[str, Any] | None = None,
              params_file: str | None = None, sweep: str | None = None, restart: bool = False) -> dict:
    """Baseline vs JAGG vs ablate end to end on one profile.

    Args:
        profile: a profile of params.yaml.
        parallel_runs: training runs at a time (on GPUs, give each method its devices in
            resources.cuda_visible_devices); with resources.dispatch = pool, trainings and evaluations in flight on
            the work pool's workers at a time.
        overrides: dotted params to change for this flow run, e.g. {"train.iterations": 8, "jagg.window": 8}.
        params_file: a params file other than the repository's params.yaml.
        sweep: name of the MLflow parent run (default: this flow run's id).
        restart: runs whose checkpoints were written with other params start over (their checkpoints moved
            aside); without it such a run stops and says what changed.
    """
    if parallel_runs < 1:
        raise ParamsError(f"parallel_runs {parallel_runs} must be at least 1.")
    params = flow_params(profile, params_file, overrides)
    sweep = sweep_name(sweep, params)
    with sweep_tracked(params, sweep):  # its MLflow parent run RUNNING, then ended with the sweep's outcome
        return _reproduce(params, profile, parallel_runs, overrides, params_file, sweep, restart)


def _reproduce(params, profile: str, parallel_runs: int, overrides: dict[str, Any] | None,  # noqa: ANN001
               params_file: str | None, sweep: str, restart: bool) -> dict:
    """The reproduction's stages, in the sweep's flow run (:func:`reproduce`)."""
    if params.outputs:
        print(f"sweep point {params.outputs}: {json.dumps(redact(overrides), sort_keys=True, default=str)}")
    prepare_task(params)
    pretrain_task(params)
    if params.resources.dispatch == "pool":  # every training and evaluation a flow run of its own (flows/pool.py)
        finished = run_on_pool(params, profile=profile, parallel_runs=parallel_runs, sweep=sweep, overrides=overrides,
                               params_file=params_file, restart=restart)
        speed_task(params)
        return _recorded({"report": report_task(params, sweep), "runs": finished}, params.profile, overrides,
                         params_file)
    evaluate_task(params, "base", sweep)
    # Runs one at a time by default: on a shared CPU, overlapping runs would distort each other's timings (the
    # report's speed table times every method side by side at the end instead: its interleaved measurement).
    runs = [(m, s) for s in params.run.seeds for m in params.run.methods]
    finished, evaluations = [], []
    pending, in_flight = list(runs), {}
    while pending or in_flight:
        # At most parallel_runs trainings in flight, the next one as soon as one finishes (no batch barrier)
        while pending and len(in_flight) < parallel_runs:
            m, s = pending.pop(0)
            in_flight[train_task.submit(params, m, s, sweep, restart)] = (m, s)
        done = next(as_completed(list(in_flight)))
        m, s = in_flight.pop(done)
        finished.append(done.result())
        if parallel_runs > 1:
            # Its evaluation runs beside the next trainings, one evaluation at a time: two model loads at once in
            # one process are not safe (diffusers' meta-device init)
            after = [allow_failure(evaluations[-1])] if evaluations else []
            evaluations.append(evaluate_task.submit(params, run_name(m, s), sweep, wait_for=after))
    for f in evaluations:
        f.result()
    if parallel_runs == 1:
        for m, s in runs:
            evaluate_task(params, run_name(m, s), sweep)
    speed_task(params)  # every method's update side by side, on one machine state: the report's speed table
    return _recorded({"report": report_task(params, sweep), "runs": finished}, params.profile, overrides,
                         params_file)


def _recorded(result: dict, profile: str, overrides: dict[str, Any] | None, params_file: str | None) -> dict:
    """``result``, once DVC's record holds what the flow finished (tasks/dvc_record.py): a bare `dvc repro` afterwards
    runs nothing. Its line goes to the flow run's log."""
    line = record_in_dvc(profile, overrides=overrides, params_file=params_file)
    print(line)
    return {**result, "dvc": line}


@flow(name="jagg-evaluate", log_prints=True)
@shown_redacted
def evaluate_only(profile: str = "toy", overrides: dict[str, Any] | None = None, params_file: str | None = None,
                  sweep: str | None = None) -> dict:
    """Evaluate the base model and every run's checkpoints, then rebuild the report."""
    params = flow_params(profile, params_file, overrides)
    sweep = sweep_name(sweep, params)
    with sweep_tracked(params, sweep):  # its MLflow parent run RUNNING, then ended with the sweep's outcome
        evaluate_task(params, "base", sweep)
        for s in params.run.seeds:
            for m in params.run.methods:
                evaluate_task(params, run_name(m, s), sweep)
        return report_task(params, sweep)


@flow(name="jagg-report", log_prints=True)
@shown_redacted
def report_only(profile: str = "toy", overrides: dict[str, Any] | None = None, params_file: str | None = None,
                sweep: str | None = None) -> dict:
    """Rebuild the report from what is on disk."""
    params = flow_params(profile, params_file, overrides)
    return report_task(params, sweep_name(sweep, params))
