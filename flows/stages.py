"""The pipeline's Prefect tasks: each stage's plain function (``tasks/<stage>.py:<stage>_stage``) made a task here,
where the flows that run them are, with its retry rule. ``tasks/`` never imports Prefect, so a stage run by DVC or
the command line does not pay for it (1.5–2 s of every stage process, and of every quick refusal of bad input).

Only a process that died is retried (``tasks/common.py:retry_only_died``; a training run also after a lost
rendezvous, ``tasks/train.py:_retryable``, resuming from its last complete checkpoint); an error of the run's own
fails at once. Each task shows a user error redacted (``tasks/common.py:shown_redacted``).
"""

from __future__ import annotations

from prefect import task

from tasks.common import retry_only_died, shown_redacted
from tasks.evaluate import evaluate_stage
from tasks.prepare import prepare_stage
from tasks.pretrain import pretrain_stage
from tasks.report import report_stage
from tasks.speed import speed_stage
from tasks.train import _retryable, train_stage

__all__ = ["evaluate_task", "prepare_task", "pretrain_task", "report_task", "speed_task", "train_task"]

prepare_task = task(name="prepare")(shown_redacted(prepare_stage))
pretrain_task = task(name="pretrain", retries=1, retry_condition_fn=retry_only_died)(shown_redacted(pretrain_stage))
train_task = task(name="train", retries=2, retry_delay_seconds=5, retry_condition_fn=_retryable)(
    shown_redacted(train_stage))
evaluate_task = task(name="evaluate", retries=1, retry_condition_fn=retry_only_died)(shown_redacted(evaluate_stage))
speed_task = task(name="speed")(shown_redacted(speed_stage))
report_task = task(name="report")(shown_redacted(report_stage))
