"""MLflow tracking: an experiment per profile, a parent run per sweep, a child run per method × seed.

The store defaults to an embedded SQLite file at the repository root (``sqlite:///<abs path>/mlflow.db``), so no
server is needed; ``jagg ui`` opens the MLflow UI on the same store. Every call is retried with exponential backoff
(SQLite answers "database is locked" while another process writes); a store that cannot be reached at start fails
with one clear sentence before any training.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from .config import Params
from .redact import redact
from .errors import UserError

__all__ = ["TrackingError", "Tracker", "MlflowLogger", "resolve_uri", "git_commit"]

log = logging.getLogger(__name__)
T = TypeVar("T")
class TrackingError(UserError, RuntimeError):
    """The tracking store cannot be used; the message is for the user."""


def resolve_uri(uri: str, root: str | os.PathLike) -> str:
    """Relative ``sqlite:///x.db`` paths are taken relative to the repository root and made absolute."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + str((Path(root) / uri[len(prefix):]).resolve())
    return uri


def git_commit(root: str | os.PathLike) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def param_strings(tree: Mapping[str, Any]) -> dict[str, str]:
    """Params as MLflow's flat strings, every secret redacted (by key and by value, see :mod:`jagg_core.redact`)."""
    return {k: str(v)[:6000] for k, v in _flatten(redact(dict(tree))).items()}


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


class Tracker:
    """One MLflow store and one experiment; creates or finds parent (sweep) and child (run) runs by tags."""

    def __init__(self, params: Params, root: str | os.PathLike, *, retries: int | None = None):
        import mlflow  # noqa: F401  (import here: the algorithm never needs MLflow)
        from mlflow.tracking import MlflowClient

        self.params = params
        self.root = Path(root)
        self.uri = resolve_uri(params.tracking.mlflow_uri, root)
        self.retries = params.tracking.retries if retries is None else retries
        if self.uri.startswith(("http://", "https://")):
            # Our own loop retries (with backoff) every call; MLflow's HTTP layer would add up to 7 retries with
            # exponential backoff per call (minutes for an absent server). Explicit environment settings win.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        self.client = MlflowClient(tracking_uri=self.uri)
        name = params.tracking.experiment.format(profile=params.profile)
        exp = self._call(lambda: self.client.get_experiment_by_name(name), "open the experiment")
        self.experiment_id = exp.experiment_id if exp else self._call(
            # MLflow 3 opens an experiment without this tag in its GenAI view (traces); ours trains models.
            lambda: self.client.create_experiment(name, tags={"mlflow.experimentKind": "custom_model_development"}),
            "create the experiment",
        )
        self.experiment = name

    def _call(self, fn: Callable[[], T], what: str) -> T:
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001  (MLflow raises many types for a busy or absent store)
                if attempt == self.retries:
                    raise TrackingError(
                        f"the MLflow store {self.uri} cannot {what} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                        f"check tracking.mlflow_uri or start the server."
                    ) from None
                log.warning("MLflow: could not %s (%s); retrying in %.1fs", what, type(e).__name__, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def _find(self, tags: Mapping[str, str]) -> str | None:
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self._call(lambda: self.client.search_runs([self.experiment_id], query, max_results=1), "search runs")
        return runs[0].info.run_id if runs else None

    def sweep_run(self, sweep: str) -> str:
        """The parent run of a sweep (created on first use)."""
        tags = {"jagg.kind": "sweep", "jagg.sweep": sweep, "jagg.profile": self.params.profile}
        run_id = self._find(tags)
        if run_id is None:
            run = self._call(lambda: self.client.create_run(self.experiment_id, tags={
                **tags, "mlflow.runName": f"{self.params.profile} sweep {sweep}",
                **self._source_tags()}), "create the sweep run")
            run_id = run.info.run_id
        return run_id

    def child_run(self, sweep: str, run: str, *, method: str | None, seed: int | None, key: str,
                  extra_tags: Mapping[str, str] | None = None) -> str:
        """The run of ``run`` (``<method>-s<seed>`` or ``base``) in ``sweep``, keyed by ``key`` (its fingerprint)."""
        parent = self.sweep_run(sweep)
        tags = {"jagg.kind": "run", "jagg.sweep": sweep, "jagg.run": run, "jagg.key": key}
        run_id = self._find(tags)
        if run_id is None:
            # Not nested under the parent (MLflow's UI would show one collapsed row and empty charts until a user
            # expands it): every run is a row of its own, side by side; `jagg.parent_run` points to the sweep's run.
            all_tags = {**tags, "jagg.parent_run": parent, "mlflow.runName": run, "profile": self.params.profile,
                        **self._source_tags(), **(extra_tags or {})}
            if method is not None:
                all_tags["method"] = method
            if seed is not None:
                all_tags["seed"] = str(seed)
            run_id = self._call(lambda: self.client.create_run(self.experiment_id, tags=all_tags).info.run_id,
                                "create a run")
            self.log_params(run_id, self.params.model_dump(mode="json"))
        elif extra_tags:
            for k, v in extra_tags.items():
                self._call(lambda: self.client.set_tag(run_id, k, v), "tag a run")
        return run_id

    def _source_tags(self) -> dict[str, str]:
        """The commit under MLflow's own key (the UI shows it) and ours."""
        commit = git_commit(self.root)
        return {"git_commit": commit, "mlflow.source.git.commit": commit}

    def log_params(self, run_id: str, tree: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in param_strings(tree).items()]
        for i in range(0, len(params), 100):
            self._call(lambda: self.client.log_batch(run_id, params=params[i : i + 100]), "log params")

    def logger(self, run_id: str) -> "MlflowLogger":
        return MlflowLogger(self, run_id)

    def log_artifact(self, run_id: str, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self._call(lambda: self.client.log_artifacts(run_id, str(path), artifact_path), "log artifacts")
        else:
            self._call(lambda: self.client.log_artifact(run_id, str(path), artifact_path), "log an artifact")

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        self._call(lambda: self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()]),
                   "tag a run")

    def system_metrics(self, run_id: str, interval: float = 10.0) -> Any:
        """MLflow's own monitor of CPU, memory, disk and network (GPU where there is one), logged as ``system/…``
        every ``interval`` seconds while the run trains; None where it cannot start (no psutil). Call ``finish()``."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(run_id, sampling_interval=interval, resume_logging=True,
                                           tracking_uri=self.uri)
        except Exception as e:  # noqa: BLE001  (system metrics are a convenience, never a reason to stop)
            log.warning("MLflow system metrics are off (%s: %s)", type(e).__name__, e)
            return None
        monitor.start()
        return _SystemMetrics(monitor)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self._call(lambda: self.client.set_terminated(run_id, status), "finish a run")


class _SystemMetrics:
    """MLflow's system-metrics monitor, stopped so that a run shorter than one interval still logs what it sampled."""

    def __init__(self, monitor: Any):
        self.monitor = monitor

    def finish(self) -> None:
        m = self.monitor
        m._shutdown_event.set()
        if m._process is not None:
            m._process.join()
            m._process = None
        try:
            if any(mon.metrics for mon in m.monitors):  # samples taken since the last publish
                m.publish_metrics(m.aggregate_metrics())
            m.mlflow_logger.flush()
        except Exception as e:  # noqa: BLE001
            log.warning("MLflow system metrics: the last samples were not logged (%s)", e)


class MlflowLogger:
    """A :class:`~jagg_core.metric_logger.MetricLogger` (the trainer's and evaluation's) bound to one MLflow run."""

    def __init__(self, tracker: Tracker, run_id: str):
        self.tracker = tracker
        self.run_id = run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, int(step)) for k, v in metrics.items() if v == v]  # NaN-free
        for i in range(0, len(batch), 500):
            self.tracker._call(lambda: self.tracker.client.log_batch(self.run_id, metrics=batch[i : i + 500]),
                               "log metrics")

    def log_image(self, image: Any, key: str, step: int) -> None:
        # log_image(key=..., step=...) keeps a history per key: the UI's image-grid chart compares runs by step.
        self.tracker._call(lambda: self.tracker.client.log_image(self.run_id, image, key=key, step=int(step)),
                           "log an image")
