"""What every stage entry shares: the repository root, loading params once, one-sentence errors, Prefect logging."""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from jagg_core.setup.config import Params, ParamsError

from jagg_core.setup.params_io import _MAX_SET_CHARS, load_params, parse_yaml
from jagg_core.errors import UserError
from jagg_core.setup.paths import Layout
from jagg_core.setup.redact import redact

__all__ = [
    "ROOT",
    "ServiceError",
    "shown_redacted",
    "USER_ERRORS",
    "add_common_args",
    "cli",
    "layout",
    "load",
    "orchestration_tags",
    "parse_overrides",
    "stage_logger",
    "DEFAULT_SWEEP",
    "add_sweep_arg",
    "process_died",
    "retry_only_died",
]

ROOT = Path(os.environ.get("JAGG_ROOT", ".")).resolve()


class ServiceError(UserError, RuntimeError):
    """A local service (Prefect server, worker, MLflow UI) could not be started or stopped."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """The error types whose message is written for the user: printed as one sentence, no traceback.

    Every such error of the project derives from :class:`jagg_core.errors.UserError`, so no stage has to import the
    whole project to recognise them (a stage's code dependencies stay its own).
    """
    return (UserError, FileNotFoundError)


USER_ERRORS = _user_errors()


def load(profile: str | None = None, params_path: str | os.PathLike | None = None,
         overrides: dict[str, Any] | None = None) -> Params:
    """The validated params of ``profile`` (loaded once per entrypoint)."""
    if params_path is None:
        root_pipeline_current(profile)
    return load_params(params_path or ROOT / "params.yaml", profile, overrides, root=ROOT)


def root_pipeline_current(profile: str | None) -> None:
    """A stage DVC runs from the repository's ``dvc.yaml`` (``DVC_STAGE`` names a stage of it: no file part) is of
    the profile that pipeline was written for, ``--profile`` in its command; after ``profile:`` changed in params.yaml
    that is not the active one any more, and a bare ``dvc repro`` ran the old profile without a word: one sentence,
    before anything is written."""
    stage = os.environ.get("DVC_STAGE", "")
    if not stage or ":" in stage or not profile:
        return
    from jagg_core.setup.storage import read_text  # as tasks.dvc_pipelines reads it (not imported: a stage's deps)

    raw = parse_yaml(read_text(ROOT / "params.yaml", ParamsError, limit=16 << 20), "params.yaml")
    active = active_profile(raw if isinstance(raw, dict) else {})
    if profile != active:
        raise ParamsError(f"dvc.yaml was written for profile {profile!r}, but params.yaml's profile is now "
                          f"{active!r}; run `make pipelines` (python -m tasks.dvc_pipelines) to write {active!r}'s "
                          f"pipeline at the root and move {profile!r}'s to pipelines/{profile}/, then dvc repro again.")


def active_profile(raw: dict[str, Any]) -> str:
    """The profile whose pipeline is the repository's ``dvc.yaml``: params.yaml's ``profile`` key (``$JAGG_PROFILE``
    does not move files)."""
    return str(raw.get("profile", "toy"))


def layout(params: Params, root: Path | None = None) -> Layout:
    return Layout.of(params, root or ROOT)


# The MLflow parent run that groups the runs of stages started on their own (`dvc repro`, `jagg train`); a flow passes
# its own sweep (the Prefect flow run, or `jagg run`'s timestamp) to every stage it runs.
DEFAULT_SWEEP = "default"
# The MLflow UI `jagg services up` started, at its --advertise host and --mlflow-port: set for its worker, read by
# the report's links where the params leave tracking.ui_url unset (tasks/report.py:ui_url).
MLFLOW_UI_ENV = "JAGG_MLFLOW_UI_URL"


def add_sweep_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", default=DEFAULT_SWEEP, metavar="NAME",
                   help=f"MLflow parent run to group this stage's runs under (default: {DEFAULT_SWEEP!r})")


def orchestration_tags() -> dict[str, str]:
    """MLflow tags saying who ran a stage: the DVC stage (DVC sets ``DVC_STAGE`` for every command it runs) and the
    Prefect flow run, where there is one."""
    tags = {}
    if os.environ.get("DVC_STAGE"):
        tags["dvc_stage"] = os.environ["DVC_STAGE"]
    if "prefect.context" not in sys.modules:  # Prefect never imported: no flow run (and no 1.5 s import to learn it)
        return tags
    try:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        if ctx and ctx.flow_run:
            tags["prefect_flow_run_id"] = str(ctx.flow_run.id)
    except Exception:  # noqa: BLE001  (outside Prefect)
        pass
    return tags


def shown_redacted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, whose user errors leave it with their text redacted (:mod:`jagg_core.setup.redact`): what Prefect shows
    of a failed task or flow (its state message, a logged traceback) is the error's text, which may quote a secret."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            e.args = tuple(redact(a) if isinstance(a, str) else a for a in e.args)
            raise

    return wrapper


def process_died(exc: BaseException | None) -> bool:
    """Whether ``exc`` says a process died (killed, out of memory, a crash), the one failure a retry can help:
    a class that sets ``process_died = True`` (``tasks.train.WorkerDied``)."""
    return exc is not None and bool(getattr(type(exc), "process_died", False))


def retry_only_died(task, task_run, state) -> bool:  # noqa: ANN001  (Prefect's retry_condition_fn signature)
    """Every stage task's retry condition: retry only a process that died; a user error (a bad option, a
    RewardError, a damaged manifest, a read-only folder, a TypeError) would fail the same way again."""
    try:
        state.result(raise_on_failure=True)
    except BaseException as e:  # noqa: BLE001
        return process_died(e)
    return False


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous of processes started next)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Redacting(logging.Filter):
    """Every record a handler emits, redacted (credentials in URLs): our lines, MLflow's, Prefect's, printed lines
    that a flow's ``log_prints`` turns into records — before the console or Prefect's database sees them.

    A record about a user error (Prefect's "Task run failed with exception: ServedRewardError(…)", its flow's
    "Encountered exception during execution") keeps its one line and loses its traceback: the error is one sentence
    the user can fix, not a bug. Any other exception's traceback is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info, record.exc_text = None, None
        message = record.getMessage()
        shown = redact(message)
        if shown != message:
            record.msg, record.args = shown, None
        return True


def redact_logs() -> None:
    """Put :class:`_Redacting` on every handler there is now (the root's, Prefect's console and API handlers)."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(f, _Redacting) for f in handler.filters):
                handler.addFilter(_Redacting())


def stage_logger(name: str) -> logging.Logger:
    """The Prefect run logger inside a flow or task (so output reaches the Prefect UI), else a plain logger; every
    handler redacts what it emits (:func:`redact_logs`)."""
    try:
        return _stage_logger(name)
    finally:
        redact_logs()


def _stage_logger(name: str) -> logging.Logger:
    try:
        if "prefect.context" in sys.modules:  # else no flow or task runs in this process
            from prefect.context import FlowRunContext, TaskRunContext
            from prefect.logging import get_run_logger

            if TaskRunContext.get() or FlowRunContext.get():
                return get_run_logger()  # type: ignore[return-value]
    except Exception:  # noqa: BLE001  (no Prefect context, or Prefect not importable)
        pass
    logger = logging.getLogger(f"jagg.{name}")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    base = logging.getLogger("jagg")
    if base.level == logging.NOTSET:  # importing Prefect leaves the root at WARNING: a stage's progress is INFO
        base.setLevel(logging.INFO)
    return logger


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None, help="named profile of params.yaml (default: its `profile` key)")
    p.add_argument("--params", default=None,
                   help="params file (default: params.yaml at the repository root); a file of your own starts with "
                        "`extends: <path to the project's params.yaml>` (docs/extending.md)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a param, e.g. --set train.iterations=5 (YAML value)")


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as a dict; a value is untrusted YAML (invalid, an undefined alias, a Python tag: one
    sentence, see :func:`jagg_core.setup.params_io.parse_yaml`)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ParamsError(f"--set {item!r} must look like KEY=VALUE, e.g. train.iterations=5.")
        if len(value) > _MAX_SET_CHARS:
            raise ParamsError(f"--set {key.strip()[:60]} is {len(value):,} characters long; a value of params is "
                              f"short (at most {_MAX_SET_CHARS:,}).")
        out[key.strip()] = parse_yaml(value, f"--set {key.strip()[:60]}")
    return out


def cli(fn: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Wrap an entry point: user errors become ``jagg: error: <sentence>`` and exit status 1."""

    @functools.wraps(fn)
    def wrapper(argv: list[str] | None = None) -> int:
        try:
            return fn(argv)
        except USER_ERRORS as e:
            print(f"jagg: error: {redact(str(e))}", file=sys.stderr)
            return 1
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            where = f" writing {e.filename}" if e.filename else ""
            print(f"jagg: error: no space left on the device{where}; free some space and run it again (completed "
                  f"work is kept: every file is written whole or not at all).", file=sys.stderr)
            return 1
        except KeyboardInterrupt as e:
            signum = getattr(e, "signum", signal.SIGINT)  # tasks.launch.Interrupted carries SIGTERM's number
            print("jagg: interrupted", file=sys.stderr)
            return 128 + signum

    return wrapper
