"""What the hosts of a pool-dispatched sweep share, said and checked (``resources.dispatch: pool``).

A sweep whose trainings and evaluations run as flow runs of their own on the Prefect work pool (``flows/pool.py``)
needs every worker that takes one to see what the sweep's flow sees: the same project folder (prompts, base model,
checkpoints; on a filesystem every host mounts) and the same MLflow store (a server, ``tracking.mlflow_uri``; a
sqlite file would be each host's own, which the params' schema refuses). The sweep writes a sentinel — a random token
in a file of the project folder and the same token as a tag of its MLflow parent run — and passes the token to every
unit; a worker that reads another token, or none, at either place refuses the unit with one sentence before it loads
a model, trains or writes anything (:func:`check_shared`).
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Any

from jagg_core.errors import UserError
from jagg_core.setup.config import Params
from jagg_core.setup.redact import redact
from jagg_core.pipeline.tracking import Tracker
from jagg_core.setup.paths import inside
from jagg_core.setup.storage import atomic_write_text, read_regular
from jagg_core.pipeline.mlflow_store import resolve_uri

__all__ = ["SENTINELS", "DispatchError", "check_shared", "remove_sentinel", "where", "write_sentinel"]

SENTINELS = ".jagg-dispatch"  # the project folder's sentinels of running sweeps (git-ignored)
# The same token on the sweep's MLflow parent run, under a tag of its own per start of the sweep: two sweeps started
# under one name (one parent run) each keep theirs, instead of the second one's overwriting the first's.
TOKEN_TAG = "jagg.dispatch_token"


def _token_tag(token: str) -> str:
    return f"{TOKEN_TAG}.{token[:8]}"


class DispatchError(UserError, RuntimeError):
    """A worker's view of the project folder or of the tracking store is not the sweep's."""


def where() -> dict[str, str]:
    """The worker (Prefect sets ``PREFECT__WORKER_NAME`` for the flow runs it starts) and host of this process."""
    return {"worker": os.environ.get("PREFECT__WORKER_NAME") or "no worker", "host": socket.gethostname()}


def write_sentinel(params: Params, root: Path, sweep: str) -> dict[str, str]:
    """Write this sweep's token into the project folder and onto its MLflow parent run; returns what every unit is
    given to check its own view against (:func:`check_shared`)."""
    token = secrets.token_hex(16)
    tracker = Tracker(params, root)
    sweep_run = tracker.sweep_run(sweep)  # checks the sweep's name, which names the file too
    rel = f"{SENTINELS}/{sweep}-{token[:8]}.token"
    atomic_write_text(root / rel, token + "\n")
    try:
        tracker.set_tags(sweep_run, {_token_tag(token): token})
    except BaseException:
        (root / rel).unlink(missing_ok=True)  # no token file outlives a sweep that never started
        raise
    return {"token": token, "file": rel, "root": str(root), "host": socket.gethostname(),
            "mlflow_uri": redact(params.tracking.mlflow_uri)}


def remove_sentinel(root: Path, shared: dict[str, str]) -> None:
    """Remove the sweep's token file; a filesystem that will not (a stale NFS handle) does not hide the sweep's own
    outcome: a warning, the file left for `jagg services` to ignore (units check the token, not the file's age)."""
    try:
        (root / shared["file"]).unlink(missing_ok=True)
    except OSError as e:
        print(f"jagg: warning: could not remove the sweep's token file {shared['file']} ({e.strerror or e}).")


def check_shared(params: Params, root: Path, sweep: str, shared: dict[str, Any]) -> None:
    """Refuse, in one sentence, a unit whose worker sees another project folder or another MLflow store than the
    sweep's flow (nothing is read but the sentinel and the sweep's run; nothing is written)."""
    me = where()
    who = f"worker {me['worker']!r} on {me['host']}"
    # The file's name comes in the unit's parameters: a path inside the project (`../../…` is refused), read bounded
    # and regular (a FIFO or /dev/zero there held the worker's only slot with the unit RUNNING): one sentence.
    rel = shared.get("file")
    if not isinstance(rel, str) or not rel:
        raise DispatchError(f"{who} refuses a unit without the sweep's token file name; start the sweep again.")
    token_file = inside(root, rel, "the unit's sweep token file", kind="file")
    seen = None
    if token_file.exists():
        seen = read_regular(token_file, DispatchError, limit=4096, fix="start the sweep again").decode(
            "utf-8", "replace").strip()
    if seen != shared["token"]:
        raise DispatchError(
            f"{who} does not see the sweep's project folder ({shared['root']} on {shared['host']}): its {root} holds "
            f"no {shared['file']} with the sweep's token; put the project on a filesystem every worker mounts and "
            f"start each worker with JAGG_ROOT set to it (docs/scaling.md).")
    found = _sweep_token(params, root, sweep, who, _token_tag(shared["token"]))
    if found != shared["token"]:
        seen = f"no sweep {sweep!r}" if found is None else f"sweep {sweep!r} without this start's token"
        raise DispatchError(
            f"{who} does not see the sweep's MLflow store: at {redact(params.tracking.mlflow_uri)} it finds {seen}; "
            f"point tracking.mlflow_uri at a server every host reaches by the same address (docs/scaling.md).")


def _sweep_token(params: Params, root: Path, sweep: str, who: str, tag: str) -> str | None:
    """The token under ``tag`` on ``sweep``'s parent run in the store this worker sees ("" if the run is there
    without it; None if there is no such run), read only (no experiment is created)."""
    from mlflow.tracking import MlflowClient

    uri = resolve_uri(params.tracking.mlflow_uri, root)
    try:
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(params.tracking.experiment.format(profile=params.profile))
        if exp is None:
            return None
        query = f"tags.`jagg.kind` = 'sweep' and tags.`jagg.sweep` = '{sweep}'"
        runs = client.search_runs([exp.experiment_id], query, max_results=1)
    except Exception as e:  # noqa: BLE001  (MLflow raises many types for an absent store)
        raise DispatchError(f"{who} cannot read the sweep's MLflow store at {redact(uri)} ({type(e).__name__}); "
                            f"point tracking.mlflow_uri at a server every host reaches (docs/scaling.md).") from None
    return runs[0].data.tags.get(tag, "") if runs else None
