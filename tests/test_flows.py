"""The flows' own logic with Prefect's real engine (in-process): which failures a stage task retries, and how a
flow run's parameters become validated params."""

from __future__ import annotations

import pytest

from conftest import REPO
from jagg_core.setup.config import ParamsError


def test_training_is_retried_only_after_its_process_died(tmp_path, monkeypatch):
    from prefect import flow, task

    from jagg_core.trainer import TrainingError
    from flows.stages import train_task
    from tasks.train import WorkerDied, _retryable

    assert train_task.retries == 2 and train_task.retry_condition_fn is _retryable
    calls: list[str] = []

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=_retryable)
    def attempt(kind: str) -> str:
        calls.append(kind)
        if len(calls) == 1:
            raise (WorkerDied if kind == "died" else TrainingError)(f"training run x failed ({kind})")
        return "resumed"

    @flow
    def run(kind: str) -> str:
        return attempt(kind)

    assert run("died") == "resumed" and calls == ["died", "died"]  # killed: retried, resumes
    calls.clear()
    with pytest.raises(TrainingError, match="failed"):
        run("own error")  # a bad parameter, a damaged checkpoint, a diverged loss: fails once, no retry
    assert calls == ["own error"]


def test_flow_overrides_make_a_sweep_point_and_are_validated(monkeypatch):
    from flows.reproduce import flow_params
    from jagg_core.setup.config import ParamsError

    monkeypatch.chdir(REPO)
    plain = flow_params("ci")
    assert plain.outputs is None
    point = flow_params("ci", overrides={"train.iterations": 8, "jagg.window": 2})
    assert point.train.iterations == 8 and point.jagg.window == 2
    assert point.outputs.startswith("ci-") and point.outputs == flow_params("ci", overrides={
        "jagg.window": 2, "train.iterations": 8}).outputs  # the same point, the same folders
    assert flow_params("ci", overrides={"tracking.retries": 1}).outputs is None  # logging only: the profile's own
    with pytest.raises(ParamsError, match=r"train.lr = 'abc' is invalid"):
        flow_params("ci", overrides={"train.lr": "abc"})
    with pytest.raises(ParamsError, match="prompt set or the base model"):
        flow_params("ci", overrides={"pretrain.steps": 5})
    with pytest.raises(ParamsError, match="does not exist"):
        flow_params("ci", params_file="no-such-params.yaml")


def test_a_full_disk_anywhere_is_one_sentence_not_a_traceback(capsys):
    import errno

    from tasks.common import cli

    @cli
    def stage(argv=None) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", "eval/toy/base/curve.json")

    assert stage([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jagg: error: no space left on the device writing eval/toy/base/curve")

    @cli
    def other(argv=None) -> int:
        raise OSError(errno.EACCES, "Permission denied")  # not ours to reword: a traceback shows where

    with pytest.raises(PermissionError):
        other([])


# --- no stage task retries an error that cannot succeed ------------------------------------------------------------


class _State:
    def __init__(self, exc: BaseException):
        self.exc = exc

    def result(self, raise_on_failure: bool = True):
        raise self.exc


def _errors():
    from jagg_core.evaluation.evaluate import EvalError
    from jagg_core.rewards import RewardError
    from jagg_core.trainer.checkpoint import CheckpointError

    from tasks.train import TrainingError

    return [TypeError("tau"), RewardError("tau=200"), PermissionError(13, "read-only"), CheckpointError("[]"),
            MemoryError(), EvalError("x"), TrainingError("x"), ParamsError("x")]


@pytest.mark.parametrize("task", ["flows.stages:train_task", "flows.stages:evaluate_task",
                                  "flows.stages:pretrain_task"])
def test_no_task_retries_an_error_that_cannot_succeed(task):
    import importlib

    from tasks.train import WorkerDied

    module, _, name = task.partition(":")
    prefect_task = getattr(importlib.import_module(module), name)
    condition = prefect_task.retry_condition_fn
    assert condition is not None, f"{task} retries every error"
    for exc in _errors():
        assert condition(prefect_task, None, _State(exc)) is False, exc
    assert condition(prefect_task, None, _State(WorkerDied("killed"))) is True
