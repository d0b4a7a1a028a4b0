"""The watcher of a sweep's MLflow run: a small process of its own that ends the run KILLED when the sweep's process
dies without ending it (SIGKILL, the OOM killer, a crash of the interpreter), at once rather than when the next sweep
or stage opens the store (:meth:`Tracker.reap_sweeps`).

:meth:`Tracker.sweeping` starts it (``python -m jagg_core.pipeline.sweep_watch``, in a session of its own so that a
terminal's Ctrl-C or a signal to the sweep's process group does not reach it) and writes it one line on its standard
input: the store's URI (on a pipe, never in a command line or an environment), the run's id and its owner tag. The
watcher then waits for the pipe's end. A sweep that ends its run itself (FINISHED, FAILED, KILLED on Ctrl-C or
SIGTERM) writes ``done`` first and the watcher exits having imported nothing. An end of the pipe without ``done`` is
the kernel closing a dead process's files: the run, if it is still RUNNING under that owner, is marked KILLED and
tagged ``jagg.reaped_by``. Waiting costs no CPU; MLflow is imported only then.
"""

from __future__ import annotations

import signal
import sys
import time

from ..setup.json_parse import parse_json

DONE = "done"
_TRIES = 5  # a store that does not answer: the next sweep or stage reaps the run, as before


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    first = sys.stdin.readline()
    if not first.strip():
        return 0
    spec = parse_json(first, ValueError, "the sweep's line to its watcher")
    if sys.stdin.read().strip() == DONE:
        return 0
    from mlflow.tracking import MlflowClient

    from .tracking import OWNER_TAG, REAPED_TAG

    for attempt in range(_TRIES):
        try:
            client = MlflowClient(tracking_uri=spec["uri"])
            run = client.get_run(spec["run_id"])
            if run.info.status == "RUNNING" and run.data.tags.get(OWNER_TAG) == spec["owner"]:
                client.set_tag(spec["run_id"], REAPED_TAG, f"the watcher of {spec['owner']}")
                client.set_terminated(spec["run_id"], "KILLED")
            return 0
        except Exception:  # noqa: BLE001  (a store that is busy or restarting: try again, then leave it)
            time.sleep(1 + attempt)
    return 1


if __name__ == "__main__":
    sys.exit(main())
