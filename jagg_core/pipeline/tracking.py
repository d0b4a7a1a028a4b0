"""MLflow tracking: an experiment per profile, a parent run per sweep, a child run per method × seed.

The store defaults to an embedded SQLite file at the repository root (``sqlite:///<abs path>/mlflow.db``), so no
server is needed; ``jagg ui`` opens the MLflow UI on the same store. Every call is retried with exponential backoff
(SQLite answers "database is locked" while another process writes); a store that cannot be reached at start fails
with one clear sentence before any training. Where the store is and what its failures say: :mod:`.mlflow_store`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

from ..errors import UserError, sentence
from ..setup.config import Params
from ..setup.redact import flatten, redact
from .mlflow_store import (TrackingError, artifact_location, check_sqlite_store, resolve_uri, shown,
                           store_creation_lock, store_failure)
from jagg_core.setup.storage import (append_bytes, atomic_write_bytes, atomic_write_text, json_lines, read_from,
                                  read_regular)

__all__ = ["TrackingError", "Tracker", "MlflowLogger", "RecordStream", "StreamForwarder", "resolve_uri", "git_commit"]

log = logging.getLogger(__name__)

_MAX_BUFFERED_IMAGE = 64 << 20  # a logged image (a grid of a few test images) as the buffer keeps it: a PNG of MiBs

_NO_STEP = -(2**63)  # below any step: a key the run does not hold yet
# An image MLflow's log_image stored: images/<key, its / as ~ (# before MLflow 3)>+step+<step>+timestamp+… (% before)
_IMAGE_FILE = re.compile(r"(.+?)[+%]step[+%](-?\d+)[+%]timestamp[+%]")

_SWEEP = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}\Z")


def check_sweep_name(sweep: str, params: Params | None = None) -> str:
    """A sweep name MLflow takes as a run name and a tag in a search query (no quote, no newline, at most 100), and,
    with ``params``, that holds none of their secrets (:meth:`Params.check_sweep`): the one rule for a sweep's name,
    which every door a name comes in by applies (a stage's ``--sweep``, a flow's ``sweep``, a pool unit's)."""
    if params is not None:
        params.check_sweep(sweep)  # first: the format's sentence below quotes the name
    if not isinstance(sweep, str) or not _SWEEP.fullmatch(sweep):
        raise TrackingError(f"sweep name {str(sweep)[:80]!r} must be 1 to 100 letters, digits, '_', '.', ':' or '-' "
                            f"(it names an MLflow run and is searched for); pass another --sweep.")
    return sweep


T = TypeVar("T")


def git_commit(root: str | os.PathLike) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def param_strings(tree: Mapping[str, Any]) -> dict[str, str]:
    """Params as MLflow's flat strings, every secret redacted (by key and by value, see
    :mod:`jagg_core.setup.redact`)."""
    return {k: str(v)[:6000] for k, v in flatten(redact(dict(tree))).items()}


# Which process runs an MLflow run: `host:pid:start time` (psutil's create_time, so a pid taken over by another
# process is not mistaken for the owner). A stage ends only runs it owns; a RUNNING run whose owner is gone is reaped.
OWNER_TAG = "jagg.owner"
# The owner's heartbeat (Unix seconds), renewed every HEARTBEAT_SECONDS while it trains (:meth:`Tracker.heartbeat`).
# An owner this machine cannot check (another host's, as after a container restart, or a tag it cannot read) whose
# heartbeat (else the run's start) is older than OWNER_STALE_SECONDS is taken to be gone: its run is taken over.
HEARTBEAT_TAG = "jagg.heartbeat"
REAPED_TAG = "jagg.reaped_by"  # who marked a run KILLED whose owner was gone (a later stage, a sweep's watcher)
FAILURE_TAG = "jagg.failure"  # why a run ended FAILED: the user error's sentence, redacted (MLflow keeps 5000 chars)
_MAX_TAG = 5000
HEARTBEAT_SECONDS = 60.0
OWNER_STALE_SECONDS = 600.0
# A run whose orchestrator says its process died (a pool-dispatched unit Prefect marked CRASHED: flows/pool.py) is
# taken over once its owner has missed two heartbeats, not at once: a host cut off from the Prefect server but not
# from MLflow still trains, and its beats keep its run.
CRASHED_OWNER_STALE_SECONDS = 2 * HEARTBEAT_SECONDS + 15.0


def owner_id(pid: int | None = None) -> str:
    import socket

    import psutil

    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{psutil.Process(pid).create_time():.2f}"


def owner_alive(owner: str) -> bool | None:
    """Whether the process ``owner`` names still runs: None where this machine cannot tell (another host, a tag it
    cannot read)."""
    import socket

    import psutil

    host, _, rest = owner.partition(":")
    pid, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    try:
        proc = psutil.Process(int(pid))
        return f"{proc.create_time():.2f}" == started and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except (psutil.AccessDenied, ValueError, OverflowError):
        return None


def _last_sign_of_life(run: Any) -> float:
    """When the owner of ``run`` (an MLflow Run) last said it was alive: its heartbeat, else the run's start (s)."""
    beat = run.data.tags.get(HEARTBEAT_TAG, "")
    try:
        return float(beat)
    except ValueError:
        return (run.info.start_time or 0) / 1000.0


def owner_gone(run: Any, now: float | None = None) -> bool:
    """Whether the owner of ``run`` (an MLflow Run with an owner tag) no longer runs it: its process is gone, or this
    machine cannot check it and its heartbeat is older than :data:`OWNER_STALE_SECONDS`."""
    alive = owner_alive(run.data.tags.get(OWNER_TAG, ""))
    if alive is not None:
        return not alive
    return (time.time() if now is None else now) - _last_sign_of_life(run) > OWNER_STALE_SECONDS


def _shown_owner(owner: str | None) -> str:
    """An owner tag for a sentence: ``host:pid`` of a well-formed one, else the tag itself, cut and quoted."""
    parts = (owner or "?").split(":")
    if len(parts) == 3 and parts[1].isdigit():
        return ":".join(parts[:2])
    return repr((owner or "?")[:60])


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
        if shown(self.uri) != self.uri:
            # MLflow prints "View run … at: <the URI as given>" when a run ends: the password, twice. Silenced.
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        name = params.tracking.experiment.format(profile=params.profile)
        check_sqlite_store(self.uri)
        with store_creation_lock(self.uri, params.tracking.lock_wait_s):  # parallel first runs on a fresh SQLite store: one creates it
            self.client = self._call(lambda: MlflowClient(tracking_uri=self.uri), "be opened")
            self.experiment_id = self._call(lambda: self._open_experiment(name), "open or create the experiment")
        self.experiment = name

    def _open_experiment(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            # MLflow 3 opens an experiment without this tag in its GenAI view (traces); ours trains models.
            return self.client.create_experiment(name, artifact_location=artifact_location(self.uri, name),
                                                 tags={"mlflow.experimentKind": "custom_model_development"})
        except Exception:
            exp = self.client.get_experiment_by_name(name)  # another process created it meanwhile: use theirs
            if exp is None:
                raise
            return exp.experiment_id

    def _call(self, fn: Callable[[], T], what: str, retries: int | None = None) -> T:
        delay = 0.2
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001  (MLflow raises many types for a busy or absent store)
                if attempt == retries:
                    raise TrackingError(store_failure(self.uri, what, e)) from None
                log.warning("MLflow: could not %s (%s); retrying in %.1fs", what, type(e).__name__, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def _search(self, tags: Mapping[str, str], *, oldest_first: bool = False, max_results: int = 1,
                status: str | None = None) -> list:
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        if status is not None:
            query += f" and attributes.status = '{status}'"
        order = ["attributes.start_time ASC"] if oldest_first else None
        return self._call(lambda: self.client.search_runs([self.experiment_id], query, max_results=max_results,
                                                          order_by=order), "search runs")

    def _find(self, tags: Mapping[str, str]) -> str | None:
        runs = self._search(tags)
        return runs[0].info.run_id if runs else None

    @property
    def outputs(self) -> str:
        """The folder name of this profile's runs, checkpoints and evaluations (``outputs``, else the profile)."""
        return self.params.outputs or self.params.profile

    def sweep_run(self, sweep: str) -> str:
        """The parent run of a sweep (created on first use). A stage on its own (`dvc repro`, `jagg train`) only
        groups its run under it: created FINISHED, nothing runs in it. A flow's sweep holds it RUNNING while it runs
        and ends it with its own outcome (:meth:`sweeping`). Sweep runs left RUNNING by a sweep whose process is gone
        (a SIGKILLed `jagg run`, a worker killed under its flow run) are marked KILLED here (:meth:`reap_sweeps`)."""
        check_sweep_name(sweep, self.params)
        self.reap_sweeps()
        run_id = self._find(self._sweep_tags(sweep))
        if run_id is None:
            run_id = self._create_sweep_run(sweep)
            # Nothing runs in it: it is never left RUNNING by whatever ends the command that made it.
            self.finish(run_id)
        return run_id

    def _sweep_tags(self, sweep: str) -> dict[str, str]:
        return {"jagg.kind": "sweep", "jagg.sweep": sweep, "jagg.profile": self.params.profile}

    def _create_sweep_run(self, sweep: str, owned: bool = False) -> str:
        tags = {**self._sweep_tags(sweep), "mlflow.runName": f"{self.params.profile} sweep {sweep}",
                **self._source_tags()}
        if owned:
            tags.update({OWNER_TAG: owner_id(), HEARTBEAT_TAG: f"{time.time():.0f}"})
        return self._call(lambda: self.client.create_run(self.experiment_id, tags=tags).info.run_id,
                          "create the sweep run")

    def reap_sweeps(self) -> list[str]:
        """Sweep runs left RUNNING by a sweep whose process no longer runs (or, another host's, whose heartbeat is
        stale: :func:`owner_gone`) are marked KILLED; returns their ids."""
        found = self._search({"jagg.kind": "sweep"}, status="RUNNING", max_results=100)
        reaped = []
        for r, owner in self._kill_orphans(found):
            log.warning("MLflow: sweep %s's run %s was left RUNNING by process %s, which is gone; marked KILLED",
                        r.data.tags.get("jagg.sweep", "?"), r.info.run_id, _shown_owner(owner))
            reaped.append(r.info.run_id)
        return reaped

    def _kill_orphans(self, found: list) -> Iterator[tuple[Any, str]]:
        """Each run of ``found`` whose owner is another process that is gone (:func:`owner_gone`), with that owner,
        once it is tagged ``jagg.reaped_by`` this process and marked KILLED."""
        for r in found:
            owner = r.data.tags.get(OWNER_TAG)
            if owner and owner != owner_id() and owner_gone(r):
                self.set_tags(r.info.run_id, {REAPED_TAG: owner_id()})
                self._call(lambda: self.client.set_terminated(r.info.run_id, "KILLED"), "mark a stale run KILLED")
                yield r, owner

    @contextlib.contextmanager
    def sweeping(self, sweep: str) -> Iterator[str]:
        """A flow's sweep: its parent run RUNNING while the block runs (owned by this process, its heartbeat renewed)
        and ended with it: FINISHED when the block completes, FAILED (tagged ``jagg.failure``, the error's sentence
        redacted) on an error, KILLED on Ctrl-C, SIGTERM or a cancellation. A sweep of the same name that another live
        process runs keeps its run: this one joins it and leaves the run to its owner to end."""
        check_sweep_name(sweep, self.params)
        self.reap_sweeps()
        run_id = self._find(self._sweep_tags(sweep))
        if run_id is None:
            run_id = self._create_sweep_run(sweep, owned=True)
        elif not self.claim(run_id):
            log.info("MLflow: sweep %s's run %s is RUNNING under %s: this sweep joins it", sweep, run_id,
                     self.owner_of(run_id))
            yield run_id
            return
        with self.watched(run_id):
            with self.ending(run_id), self.heartbeat(run_id):
                yield run_id
            self.finish(run_id)

    @contextlib.contextmanager
    def watched(self, run_id: str) -> Iterator[None]:
        """While the block runs, a watcher process (:mod:`jagg_core.pipeline.sweep_watch`) ends ``run_id`` KILLED
        if this process dies without ending it (SIGKILL, a crash); told ``done`` when the block ends, however it
        ends (the run was ended here), it exits. A watcher that cannot start leaves the run to the next sweep's
        :meth:`reap_sweeps`, as before."""
        import json
        import sys

        try:
            watcher = subprocess.Popen([sys.executable, "-m", "jagg_core.pipeline.sweep_watch"], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                       text=True)
            watcher.stdin.write(json.dumps({"uri": self.uri, "run_id": run_id, "owner": owner_id()}) + "\n")
            watcher.stdin.flush()
        except OSError as e:
            log.warning("MLflow: no watcher for sweep run %s (%s); a SIGKILLed sweep's run is ended by the next "
                        "sweep", run_id, redact(str(e)))
            watcher = None
        try:
            yield
        finally:
            if watcher is not None:
                with contextlib.suppress(OSError):
                    watcher.stdin.write("done")
                    watcher.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    watcher.wait(timeout=10)

    def child_run(self, sweep: str, run: str, *, method: str | None, seed: int | None, key: str,
                  extra_tags: Mapping[str, str] | None = None, per_sweep: bool = False) -> str:
        """The run of ``run`` (``<method>-s<seed>`` or ``base``), keyed by ``key`` (its fingerprint), grouped under
        ``sweep``.

        A run is who it is on disk: its profile, its outputs folder, its name and its fingerprint — not the sweep
        that asks for it. A sweep run again (a new flow run, a new name) adopts the run a training already has, its
        curve and checkpoints with it, and points it to the new sweep; runs of one name and params in two outputs
        folders are two runs. With ``per_sweep`` (a benchmark's run, whose result is the sweep's own), the sweep is
        part of who it is."""
        parent = self.sweep_run(sweep)
        identity = {"jagg.kind": "run", "profile": self.params.profile, "jagg.outputs": self.outputs,
                    "jagg.run": run, "jagg.key": key}
        if per_sweep:
            identity["jagg.sweep"] = sweep
        self.reap(run)  # runs of this name left RUNNING by a process that is gone (a SIGKILLed `jagg run`): KILLED
        found = self._search(identity, oldest_first=True)  # the oldest: a duplicate from before holds less
        run_id = found[0].info.run_id if found else self._legacy(identity)
        if run_id is None:
            # Not nested under the parent (MLflow's UI would show one collapsed row and empty charts until a user
            # expands it): every run is a row of its own, side by side; `jagg.parent_run` points to the sweep's run.
            all_tags = {**identity, "jagg.sweep": sweep, "jagg.parent_run": parent, "mlflow.runName": run,
                        OWNER_TAG: owner_id(), HEARTBEAT_TAG: f"{time.time():.0f}", **self._source_tags(),
                        **(extra_tags or {})}
            if method is not None:
                all_tags["method"] = method
            if seed is not None:
                all_tags["seed"] = str(seed)
            run_id = self._call(lambda: self.client.create_run(self.experiment_id, tags=all_tags).info.run_id,
                                "create a run")
            with self.ending(run_id):  # a signal or an error before the caller holds the id: the run ends too
                self.log_params(run_id, self.params.masked())  # a plugin's secret options `***`, the rest below
        else:
            # Adopted (by this sweep or a later one): it points to the sweep that asks for it now, in one call.
            self.set_tags(run_id, {"jagg.sweep": sweep, "jagg.parent_run": parent, "jagg.outputs": self.outputs,
                                   **(extra_tags or {})})
        return run_id

    def _legacy(self, identity: Mapping[str, str]) -> str | None:
        """A run made before its outputs folder was part of who it is (no ``jagg.outputs`` tag), which this one is:
        its last checkpoint (``jagg.checkpoint``) in this outputs folder, or, without one, the profile's own folder;
        the oldest of them. None if there is none."""
        old = {k: v for k, v in identity.items() if k != "jagg.outputs"}
        prefix = f"checkpoints/{self.outputs}/{identity['jagg.run']}/"
        for r in self._search(old, oldest_first=True, max_results=50):
            tags = r.data.tags
            if "jagg.outputs" in tags:
                continue
            checkpoint = tags.get("jagg.checkpoint")
            if (checkpoint.startswith(prefix) if checkpoint else self.outputs == self.params.profile):
                return r.info.run_id
        return None

    def _source_tags(self) -> dict[str, str]:
        """The commit under MLflow's own key (the UI shows it) and ours."""
        commit = git_commit(self.root)
        return {"git_commit": commit, "mlflow.source.git.commit": commit}

    def log_params(self, run_id: str, tree: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in param_strings(tree).items()]
        for i in range(0, len(params), 100):
            self._call(lambda: self.client.log_batch(run_id, params=params[i : i + 100]), "log params")

    def logger(self, run_id: str, buffer: str | os.PathLike | None = None, *, once: bool = False) -> "MlflowLogger":
        """The run's metric logger; with ``buffer``, an outage of the store is buffered there, not fatal; with
        ``once`` (a training's, which a resumed run logs again from its last checkpoint), a step the run already
        holds is not logged again."""
        return MlflowLogger(self, run_id, buffer, once=once)

    def metric_points(self, run_id: str, key: str) -> set[tuple[int, float]]:
        """The (step, value) points of ``key`` that ``run_id`` holds (what a stage logging again must not repeat)."""
        history = self._call(lambda: self.client.get_metric_history(run_id, key), "read a metric's history")
        return {(int(m.step), float(m.value)) for m in history}

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
        """End ``run_id`` with ``status`` — if this process owns it (:meth:`claim`; a run without an owner, a sweep's,
        is anyone's): a stage never ends a run another live process runs (`jagg evaluate` while it trains)."""
        if self._owned_here(run_id):
            self._call(lambda: self.client.set_terminated(run_id, status), "finish a run")

    def _owned_here(self, run_id: str) -> bool:
        owner = self._call(lambda: self.client.get_run(run_id), "read a run").data.tags.get(OWNER_TAG)
        return owner is None or owner == owner_id()

    def claim(self, run_id: str, *, take_over: bool = False, crashed: bool = False) -> bool:
        """Make this process the owner of ``run_id`` (RUNNING, tagged with this process) unless another live process
        runs it; returns whether it did. A run whose owner is gone (:func:`owner_gone`: its process ended, or it
        cannot be checked from here and its heartbeat is stale) is taken over; with ``take_over`` (``--restart``), so
        is one whose owner cannot be checked at all; with ``crashed`` (its orchestrator saw its process die), one
        whose owner cannot be checked and misses two heartbeats (waiting for that; a beat meanwhile keeps it its
        owner's). A live process of this machine keeps its run. Taking a run over from an owner that was not seen to
        end is said in one warning naming it."""
        from mlflow.entities import RunStatus

        run = self._call(lambda: self.client.get_run(run_id), "read a run")
        owner = run.data.tags.get(OWNER_TAG)
        if run.info.status == "RUNNING" and owner not in (None, owner_id()):
            alive = owner_alive(owner)
            if alive is None:
                age = time.time() - _last_sign_of_life(run)
                if age > OWNER_STALE_SECONDS:
                    log.warning("MLflow run %s was RUNNING under %s, which this machine cannot check and which has "
                                "given no sign of life for %.0f min; taking it over.", run_id, _shown_owner(owner),
                                age / 60)
                elif take_over:
                    log.warning("MLflow run %s was RUNNING under %s, which this machine cannot check (another host's, "
                                "or a tag it cannot read); --restart takes it over.", run_id, _shown_owner(owner))
                elif not crashed or not self._missed_two_beats(run_id, run):
                    return False
            elif alive:
                return False
        self.set_tags(run_id, {OWNER_TAG: owner_id(), HEARTBEAT_TAG: f"{time.time():.0f}"})
        if run.info.status != "RUNNING":
            self._call(lambda: self.client.update_run(run_id, RunStatus.to_string(RunStatus.RUNNING)), "reopen a run")
        return True

    def _missed_two_beats(self, run_id: str, run: Any) -> bool:
        """Wait until the owner of ``run_id`` (RUNNING under a process this machine cannot check) has given no sign of
        life for :data:`CRASHED_OWNER_STALE_SECONDS`; False as soon as it beats again (it lives, on another host)."""
        last = _last_sign_of_life(run)
        while (age := time.time() - last) <= CRASHED_OWNER_STALE_SECONDS:
            log.info("MLflow run %s: waiting %.0f s for its owner %s, whose flow run crashed, to miss a second "
                     "heartbeat before taking it over", run_id, CRASHED_OWNER_STALE_SECONDS - age,
                     _shown_owner(run.data.tags.get(OWNER_TAG)))
            time.sleep(min(15.0, CRASHED_OWNER_STALE_SECONDS - age + 1.0))
            run = self._call(lambda: self.client.get_run(run_id), "read a run")
            if _last_sign_of_life(run) != last or run.info.status != "RUNNING":
                return False
        log.warning("MLflow run %s was RUNNING under %s, whose flow run crashed and which has given no sign of life "
                    "for %.0f s; taking it over.", run_id, _shown_owner(run.data.tags.get(OWNER_TAG)), age)
        return True

    def owner_of(self, run_id: str) -> str:
        """Who runs ``run_id`` (``host:pid``), for a sentence."""
        return _shown_owner(self._call(lambda: self.client.get_run(run_id), "read a run").data.tags.get(OWNER_TAG))

    def held_sentence(self, name: str, run_id: str) -> str:
        """Why ``name``'s run ``run_id`` cannot be claimed (:meth:`claim` said no), with the way out, one sentence."""
        run = self._call(lambda: self.client.get_run(run_id), "read a run")
        owner = run.data.tags.get(OWNER_TAG)
        if owner_alive(owner or "") is None:
            age = max(0.0, time.time() - _last_sign_of_life(run))
            return (f"training run {name} is held by process {_shown_owner(owner)} (MLflow run {run_id}), which this "
                    f"machine cannot check (another host's, or a tag it cannot read; last sign of life {age / 60:.0f} "
                    f"min ago); if it is gone (a restarted container), pass --restart to take the run over, or wait "
                    f"until it is {OWNER_STALE_SECONDS / 60:.0f} min without a heartbeat.")
        return (f"training run {name} is being trained by process {_shown_owner(owner)} (MLflow run {run_id}); wait "
                f"for it to end, or stop it, then run this again.")

    @contextlib.contextmanager
    def heartbeat(self, run_id: str, every: float = HEARTBEAT_SECONDS) -> Iterator[None]:
        """While the block runs, renew the owner's heartbeat on ``run_id`` every ``every`` seconds (a thread), so
        that another machine can tell a live owner it cannot check from one that is gone (:func:`owner_gone`)."""
        import threading

        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(every):
                try:
                    self.client.set_tag(run_id, HEARTBEAT_TAG, f"{time.time():.0f}")
                except Exception as e:  # noqa: BLE001  (an outage of the store: the next beat tries again)
                    log.debug("MLflow heartbeat of run %s not renewed (%s)", run_id, redact(str(e)))

        thread = threading.Thread(target=beat, name=f"jagg-heartbeat-{run_id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=10)  # a beat waiting on a slow store: the thread is a daemon, it ends with the process

    def reap(self, run: str) -> list[str]:
        """Runs named ``run`` left RUNNING by a process that no longer runs (SIGKILL, a crash, the OOM killer; one this
        machine cannot check whose heartbeat is stale: :func:`owner_gone`) are marked KILLED; returns their ids. A run
        without an owner, or whose owner may still run, is kept."""
        query = f"tags.`jagg.run` = '{run}' and attributes.status = 'RUNNING'"
        found = self._call(lambda: self.client.search_runs([self.experiment_id], query, max_results=100),
                           "search runs")
        reaped = []
        for r, owner in self._kill_orphans(found):
            gone = ("which is gone" if owner_alive(owner) is False else
                    "which this machine cannot check and which has given no sign of life for "
                    f"{(time.time() - _last_sign_of_life(r)) / 60:.0f} min")
            log.warning("MLflow run %s (%s) was left RUNNING by process %s, %s; marked KILLED",
                        r.info.run_id, run, _shown_owner(owner), gone)
            reaped.append(r.info.run_id)
        return reaped

    @contextlib.contextmanager
    def ending(self, run_id: str, *, only_running: bool = False) -> Iterator[None]:
        """Whatever ends the block, the run ends too: KILLED on Ctrl-C or SIGTERM (a KeyboardInterrupt, as
        ``tasks.launch.Interrupted``), an exit, Prefect's ``TerminationSignal`` or a cancellation (whatever is not an
        ``Exception``), FAILED on any error; never left RUNNING. With ``only_running``, a run that is
        not RUNNING (a training run evaluated afterwards: FINISHED) keeps its status."""
        try:
            yield
        except BaseException as e:
            # Ctrl-C, SIGTERM, an exit, Prefect's TerminationSignal or a cancellation (none an Exception): KILLED
            status = "FAILED" if isinstance(e, Exception) else "KILLED"
            try:
                run = self.client.get_run(run_id)
                owner = run.data.tags.get(OWNER_TAG)
                mine = owner is None or owner == owner_id()  # another live process's run is not ended here
                if mine and (not only_running or run.info.status == "RUNNING"):
                    if status == "FAILED":
                        try:  # the reason is worth a try; the run is ended FAILED whether or not it is stored
                            self.client.set_tag(run_id, FAILURE_TAG, failure_reason(e))
                        except Exception as err:  # noqa: BLE001
                            log.warning("MLflow run %s: its failure reason could not be stored (%s)", run_id,
                                        redact(str(err)))
                    self.client.set_terminated(run_id, status)
            except Exception as err:  # noqa: BLE001  (the store itself may be what failed: say so, raise the cause)
                log.warning("MLflow run %s could not be marked %s (%s)", run_id, status, redact(str(err)))
            raise


def failure_reason(e: BaseException) -> str:
    """What a FAILED run's ``jagg.failure`` tag says: a user error's sentence, redacted, within MLflow's tag limit;
    for any other error (a bug) its kind only, since its text may quote anything; the traceback is in the log."""
    if isinstance(e, UserError):
        return sentence(redact(str(e)), limit=_MAX_TAG)
    return f"an unexpected {type(e).__name__} (a bug, not a setting): its traceback is in the stage's log."


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


def _png(image: Any) -> bytes:
    """``image`` (a PIL image or an array) as PNG bytes."""
    import io

    from PIL import Image

    png = io.BytesIO()
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(png, format="PNG")
    return png.getvalue()


def _write_beside(log_file: Path, name: str, data: bytes) -> str:
    """``data`` as the file ``name`` (relative to ``log_file``'s folder), whole before a record names it; returns
    ``name``."""
    (log_file.parent / name).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(log_file.parent / name, data)
    return name


def _append_record(log_file: Path, record: dict, fix: str) -> None:
    """``record`` as one JSON line at the end of ``log_file`` (a pending buffer or a record stream)."""
    import json

    append_bytes(log_file, (json.dumps(record) + "\n").encode("utf-8"), TrackingError, fix=fix)


def _beside_file(log_file: Path, folder_name: str, name: str, limit: int, what: str = "files") -> bytes | None:
    """The bytes of the file ``name`` that a record of ``log_file`` names, in the folder ``folder_name`` beside it; or
    None, with one warning, where it is gone, damaged, larger than ``limit`` or outside that folder (an absolute path
    anywhere was uploaded to the run)."""
    folder = (log_file.parent / folder_name).resolve()
    path = (log_file.parent / name).resolve()
    if not path.is_relative_to(folder):
        log.warning("MLflow: %s names the file %s, outside its %s folder %s; skipped, not uploaded.", log_file,
                    str(name)[:200], what, folder)
        return None
    try:
        return read_regular(path, TrackingError, limit=limit, fix="it is skipped, the records after it are sent")
    except TrackingError as e:
        log.warning("MLflow: a file of %s: %s", log_file, e)
        return None


def _beside_image(log_file: Path, folder_name: str, name: str) -> Any:
    """:func:`_beside_file`'s picture (a PIL image), or None with one warning (not an image: a traceback, say)."""
    import io

    from PIL import Image

    data = _beside_file(log_file, folder_name, name, _MAX_BUFFERED_IMAGE, "images")
    if data is None:
        return None
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        log.warning("MLflow: the image %s of %s is not an image (%s); skipped, the records after it are sent.",
                    name, log_file, " ".join(str(e).split())[:120])
        return None


def _whole_record(record: Any, kinds: tuple[str, ...]) -> bool:
    """Whether ``record`` (a line of a buffer or a stream, parsed) is a whole record of one of ``kinds``: metrics
    (numbers by name, a step and a time), an image (a key, a step and its file) or an artifact (a name and its file)."""
    if not isinstance(record, dict) or record.get("kind") not in kinds:
        return False
    if record["kind"] == "metrics":
        return (isinstance(record.get("metrics"), dict) and isinstance(record.get("step"), int)
                and isinstance(record.get("time"), int)
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in record["metrics"].values()))
    if record["kind"] == "image":
        return isinstance(record.get("file"), str) and isinstance(record.get("key"), str) and isinstance(
            record.get("step"), int)
    return isinstance(record.get("file"), str) and isinstance(record.get("name"), str)


class MlflowLogger:
    """A :class:`~jagg_core.setup.metric_logger.MetricLogger` (the trainer's and evaluation's) bound to one MLflow
    run.

    With a ``buffer`` file, a store that stays unreachable after the retries does not stop training: what would have
    been logged is appended to the buffer (images beside it), training goes on, and the buffer is replayed, in
    order, on the first later call that reaches the store (or by :meth:`flush`). Meanwhile the store is tried at
    most every ``probe_seconds``, once.

    With ``once`` (a training's logger), each metric's and image key's steps reach the run once. A resumed training
    logs again the iterations between its last checkpoint and the kill (the same values: it resumes bit-identically),
    which doubled their points in MLflow's history. So the last step of each key the run holds is read once, on the
    first call that reaches the store (one ``get_run``; the image listing too where the run has images), and a point
    at or below it is not sent, whether new or replayed from the buffer (a kill between a replay and the buffer's
    removal). The store holds a run's points up to some step and the buffer the ones after it, in order, so a
    buffered point is still sent, once: a new point at or below the last step of its key in the buffer as it was
    found is not logged again either.
    """

    def __init__(self, tracker: Tracker, run_id: str, buffer: str | os.PathLike | None = None,
                 probe_seconds: float = 30.0, *, once: bool = False):
        self.tracker = tracker
        self.run_id = run_id
        self.buffer = Path(buffer) if buffer else None
        self.probe_seconds = probe_seconds
        self._offline_until = 0.0
        self._offline = False
        self._warned: tuple[int, ...] = ()  # the buffer's damaged lines already reported (pending() then flush())
        self.once = once
        # (kind, key) -> the last step the store holds (read at the first call that reaches it) / the buffer holds
        self._stored: dict[tuple[str, str], int] | None = None if once else {}
        self._queued: dict[tuple[str, str], int] = self._buffered_steps() if once else {}

    # -- the calls -------------------------------------------------------------------------------------------------

    def log_metrics(self, metrics: Mapping[str, float], step: int, *, time_ms: int | None = None) -> None:
        """``metrics`` at ``step``, taken at ``time_ms`` (milliseconds since the epoch; now by default)."""
        step = int(step)
        when = int(time.time() * 1000) if time_ms is None else int(time_ms)
        record = {"kind": "metrics", "run_id": self.run_id, "step": step, "time": when,
                  "metrics": {k: float(v) for k, v in metrics.items()  # NaN-free; a step the buffer holds: once
                              if v == v and step > self._queued.get(("metrics", k), _NO_STEP)}}
        if record["metrics"]:
            self._submit(record)

    def log_image(self, image: Any, key: str, step: int) -> None:
        if int(step) > self._queued.get(("image", key), _NO_STEP):
            self._submit({"kind": "image", "run_id": self.run_id, "key": key, "step": int(step)}, image=image)

    def log_artifact_bytes(self, data: bytes, name: str) -> None:
        """``data`` as the run's artifact ``name`` (e.g. ``rollout/step_000001.gif``); a store that stays down loses
        it with a warning (the strips beside it are buffered)."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(name).name
            atomic_write_bytes(path, data)
            try:
                self.tracker.log_artifact(self.run_id, path, str(Path(name).parent))
            except TrackingError as e:
                log.warning("%s", e)

    def _held(self, retries: int | None) -> dict[tuple[str, str], int]:
        """(kind, key) -> the last step the run holds in the store, read once (``once``)."""
        if self._stored is None:
            client, run_id = self.tracker.client, self.run_id
            run = self.tracker._call(lambda: client.get_run(run_id), "read the run's last steps", retries=retries)
            # Each key's latest point is at its largest step (MLflow's latest_metrics): no history is read.
            held = {("metrics", m.key): int(m.step) for m in run.data.to_proto().metrics}
            if run.data.tags.get("mlflow.loggedImages"):  # log_image's files: images/<key, / as ~>+step+<n>+…
                for a in self.tracker._call(lambda: client.list_artifacts(run_id, "images"),
                                            "list the run's images", retries=retries):
                    m = _IMAGE_FILE.match(Path(a.path).name)
                    if m:
                        key = ("image", m[1].replace("#", "~"))
                        held[key] = max(held.get(key, _NO_STEP), int(m[2]))
            self._stored = held
        return self._stored

    def _send(self, record: dict, image: Any = None, *, retries: int | None = None) -> None:
        client = self.tracker.client
        run_id = record.get("run_id", self.run_id)  # a replayed record goes to the run that logged it
        held = self._held(retries) if self.once and run_id == self.run_id else {}
        if record["kind"] == "metrics":
            from mlflow.entities import Metric

            batch = [Metric(k, v, record["time"], record["step"]) for k, v in record["metrics"].items()
                     if record["step"] > held.get(("metrics", k), _NO_STEP)]  # held already: not again
            for i in range(0, len(batch), 500):
                self.tracker._call(lambda: client.log_batch(run_id, metrics=batch[i : i + 500]),
                                   "log metrics", retries=retries)
            sent = [("metrics", m.key) for m in batch]
        else:
            sent = [("image", record["key"].replace("/", "~"))]
            if record["step"] <= held.get(sent[0], _NO_STEP):
                return  # held already: not again
            if image is None:
                image = self._buffered_image(record)
                if image is None:  # gone, damaged or outside the buffer's folder: skipped with a warning
                    return
            # log_image(key=..., step=...) keeps a history per key: the UI's image-grid chart compares runs by step.
            self.tracker._call(lambda: client.log_image(run_id, image, key=record["key"], step=record["step"]),
                               "log an image", retries=retries)
        if self.once and run_id == self.run_id:  # what this logger sent, the run holds: not again either
            for key in sent:
                held[key] = max(held.get(key, _NO_STEP), record["step"])

    # -- buffering -------------------------------------------------------------------------------------------------

    def _submit(self, record: dict, image: Any = None) -> None:
        if self.buffer is None:
            self._send(record, image)
            return
        if time.monotonic() < self._offline_until:
            self._append(record, image)
            return
        try:
            # Once offline, a single attempt per probe: a store that is down costs no retry backoff per iteration.
            self.flush(retries=0 if self._offline else None)
            self._send(record, image, retries=0 if self._offline else None)
        except TrackingError as e:
            if not self._offline:
                log.warning("MLflow: %s Training goes on; what it logs is kept in %s and sent when the store is back.",
                            e, self.buffer)
            self._offline = True
            self._offline_until = time.monotonic() + self.probe_seconds
            self._append(record, image)
            return
        if self._offline:
            log.warning("MLflow: the store is back; the buffered records were sent.")
        self._offline = False

    def _append(self, record: dict, image: Any = None) -> None:
        self.buffer.parent.mkdir(parents=True, exist_ok=True)
        if image is not None:
            key = record["key"].replace("/", "_")
            name = f"{self.buffer.stem}-images/{key}-{record['step']:06d}-{time.time_ns()}.png"
            record = {**record, "file": _write_beside(self.buffer, name, _png(image))}
        # Appended through the one appender: a regular file, never a link's target, never a FIFO (which hung
        # training after its first iteration while the store was down).
        _append_record(self.buffer, record, "move it aside (the run's buffered metrics are in it)")

    def _records(self) -> list[dict]:
        """The buffer's records, oldest first. A line that is not a whole record (a write cut short by a kill, a
        damaged byte) is skipped with a warning naming the file and the line: the records around it still reach the
        store, and a trained run is not failed for one lost metrics line."""
        data = read_regular(self.buffer, TrackingError, fix="move it aside (the run's buffered metrics are in it)")
        records, bad = [], []
        for n, record in json_lines(data.decode("utf-8", "replace")):
            if _whole_record(record, ("metrics", "image")):
                records.append(record)
            else:
                bad.append(n)
        if bad and tuple(bad) != self._warned:
            self._warned = tuple(bad)
            log.warning("MLflow: %s line %s is not a whole record (a write cut short?); skipped%s.", self.buffer,
                        bad[0], f" with {len(bad) - 1} more" if len(bad) > 1 else "")
        return records

    def _buffered_steps(self) -> dict[tuple[str, str], int]:
        """(kind, key) -> the last step of this run's records in the buffer, as it is found (``once``)."""
        if self.buffer is None or not self.buffer.exists():
            return {}
        steps: dict[tuple[str, str], int] = {}
        for record in self._records():
            if record.get("run_id", self.run_id) == self.run_id:
                keys = record["metrics"] if record["kind"] == "metrics" else [record["key"]]
                for k in keys:
                    steps[(record["kind"], k)] = max(steps.get((record["kind"], k), _NO_STEP), record["step"])
        return steps

    def _buffered_image(self, record: dict) -> Any:
        """A buffered image record's picture, or None (with one warning naming it) where its file is gone (which
        failed every later flush and stranded the records after it), is not an image (a traceback), or lies outside
        the buffer's images folder (an absolute path anywhere was uploaded to the run)."""
        return _beside_image(self.buffer, f"{self.buffer.stem}-images", record["file"])

    def pending(self) -> int:
        """Records waiting in the buffer for the store."""
        if self.buffer is None or not self.buffer.exists():
            return 0
        return len(self._records())

    def flush(self, retries: int | None = None) -> int:
        """Send the buffered records, oldest first; returns how many were sent. Raises :class:`TrackingError` (the
        records not yet sent stay in the buffer) when the store cannot be reached."""
        import json
        import shutil

        if self.buffer is None or not self.buffer.exists():
            return 0
        records = self._records()
        for i, record in enumerate(records):
            try:
                self._send(record, retries=retries)
            except TrackingError:
                rest = "".join(json.dumps(r) + "\n" for r in records[i:])
                atomic_write_text(self.buffer, rest)  # the project's one writing function: never through a link
                raise
        self.buffer.unlink()
        shutil.rmtree(self.buffer.parent / f"{self.buffer.stem}-images", ignore_errors=True)
        return len(records)


_MAX_STREAM_READ = 16 << 20  # what one poll of a record stream reads at most (the rest on the next)
_MAX_STREAM_FILE = 1 << 30  # an artifact a training writes (a rollout's animated GIF: MiBs)
_STREAM_FIX = "move it aside (the run's metrics on their way to MLflow are in it)"


class RecordStream:
    """A :class:`~jagg_core.setup.metric_logger.MetricLogger` for a training's worker: what it logs is appended to the
    run's record stream ``path`` (files beside it, in ``<stem>-files/``), which the launcher holding the MLflow run
    sends (:class:`StreamForwarder`). The worker imports no MLflow (its import and SQL store were ~2.3 s of a ci
    training worker's ~8 s of CPU), and an outage of the store never holds up an iteration."""

    def __init__(self, path: str | os.PathLike, run_id: str):
        self.path, self.run_id = Path(path), run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        values = {k: float(v) for k, v in metrics.items() if float(v) == float(v)}  # NaN-free, as MLflow takes them
        if values:
            self._write({"kind": "metrics", "run_id": self.run_id, "step": int(step),
                         "time": int(time.time() * 1000), "metrics": values})

    def log_image(self, image: Any, key: str, step: int) -> None:
        name = self._file(f"{key.replace('/', '_')}-{int(step):06d}.png", _png(image))
        self._write({"kind": "image", "run_id": self.run_id, "key": key, "step": int(step), "file": name})

    def log_artifact_bytes(self, data: bytes, name: str) -> None:
        self._write({"kind": "artifact", "run_id": self.run_id, "name": name,
                     "file": self._file(Path(name).name, data)})

    def _file(self, name: str, data: bytes) -> str:
        return _write_beside(self.path, f"{self.path.stem}-files/{time.time_ns()}-{name}", data)

    def _write(self, record: dict) -> None:
        _append_record(self.path, record, _STREAM_FIX)


class StreamForwarder:
    """The launcher's half of a training's logging: sends the records its worker appends to the run's record stream
    (:class:`RecordStream`) to MLflow, as they come (a thread reading the stream's new whole lines every ``poll``
    seconds) and at :meth:`close`, through the run's :class:`MlflowLogger` (``logger``: an outage is buffered in its
    pending file and sent later, a step the run holds is not sent twice). A record goes to the run that logged it (a
    start that was stopped left its stream: the next start sends it before it trains). :meth:`close` sends what is
    left and removes the stream, which the worker (gone by then) no longer writes."""

    def __init__(self, logger: MlflowLogger, path: str | os.PathLike, poll: float = 1.0):
        self.path, self.poll = Path(path), poll
        self.loggers = {logger.run_id: logger}
        self.offset = 0
        self._stop: Any = None
        self._thread: Any = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """While the block runs (the worker trains), send the stream's records as they come; then :meth:`close`,
        also when the block fails (what the worker logged before its error reaches its run). Ctrl-C and SIGTERM
        must end the process at once: the thread (a daemon) is told to stop and not waited for, and the next start
        sends what is left."""
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="jagg-mlflow-stream", daemon=True)
        self._thread.start()
        try:
            yield
        except Exception:
            self._stop.set()
            self._thread.join()
            try:
                self.close()
            except Exception as e:  # noqa: BLE001  (the worker's error is what ends the run; the next start sends it)
                log.warning("MLflow: %s", redact(str(e)))
            raise
        except BaseException:
            self._stop.set()
            raise
        self._stop.set()
        self._thread.join()
        self.close()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.forward()
            except Exception as e:  # noqa: BLE001  (said once; close() reads the stream again and raises)
                log.warning("MLflow: %s", redact(str(e)))
                return

    def forward(self) -> int:
        """Send the stream's whole records written since the last call; returns how many were read."""
        if not self.path.exists():
            return 0
        data = read_from(self.path, self.offset, _MAX_STREAM_READ, TrackingError, fix=_STREAM_FIX)
        end = data.rfind(b"\n") + 1  # a line being written is read whole next time
        self.offset += end  # each line is read once
        count = 0
        for _, record in json_lines(data[:end].decode("utf-8", "replace")):
            count += 1
            if _whole_record(record, ("metrics", "image", "artifact")):
                self._send(record)
            else:
                log.warning("MLflow: %s holds a line that is not a whole record (a write cut short?); skipped.",
                            self.path)
        return count

    def close(self) -> int:
        """Send what the stream holds that was not sent, then remove it and its files; returns how many records."""
        import shutil

        count = 0
        while True:
            got = self.forward()
            if not got:
                break
            count += got
        if self.path.exists():
            if self.path.stat().st_size > self.offset:  # the worker was killed mid-line: that record is lost
                log.warning("MLflow: %s ends in a line that is not a whole record (a write cut short); skipped.",
                            self.path)
            self.path.unlink()
        shutil.rmtree(self.path.parent / f"{self.path.stem}-files", ignore_errors=True)
        self.offset = 0
        return count

    def _send(self, record: dict) -> None:
        run_id = str(record.get("run_id") or next(iter(self.loggers)))
        logger = self.loggers.get(run_id)
        if logger is None:  # a stopped start's run: its own logger, the same pending file
            first = next(iter(self.loggers.values()))
            logger = self.loggers[run_id] = first.tracker.logger(run_id, buffer=first.buffer, once=True)
        folder = f"{self.path.stem}-files"
        if record["kind"] == "metrics":
            logger.log_metrics(record["metrics"], record["step"], time_ms=record["time"])
        elif record["kind"] == "image":
            image = _beside_image(self.path, folder, record["file"])
            if image is not None:
                logger.log_image(image, record["key"], record["step"])
        else:
            data = _beside_file(self.path, folder, record["file"], _MAX_STREAM_FILE)
            if data is not None:
                logger.log_artifact_bytes(data, record["name"])
