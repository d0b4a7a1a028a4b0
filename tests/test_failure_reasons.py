"""Issue 61, mechanism 7 (nothing silently defaulted): a FAILED MLflow run holds its reason (the user error's sentence,
redacted), a served reward's retries each leave one log line, and a user error that Prefect logs (a task's or a
flow's failure) is its one line without a traceback, while a bug keeps its traceback."""

from __future__ import annotations

import http.server
import io
import json
import logging

import pytest
import torch

from fault_helpers import PARAMS
from jagg_core.errors import UserError
from jagg_core.rewards import make_reward
from jagg_core.rewards.served import ServedRewardError
from jagg_core.setup.params_io import load_params
from test_served_rewards import _serving

SECRET = "hunter2pw"


# --- (1) a FAILED MLflow run says why --------------------------------------------------------------------------------


def test_a_failed_run_is_tagged_with_its_user_error_redacted(tmp_path):
    """Before: a training or evaluation ended by a user error left its MLflow run FAILED with no reason in it."""
    from jagg_core.pipeline.tracking import FAILURE_TAG, Tracker

    params = load_params(PARAMS, "ci", {"tracking.mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db"})
    tracker = Tracker(params, tmp_path)
    run_id = tracker.child_run("why", "jagg-s0", method="jagg", seed=0, key="k")
    error = ServedRewardError(f"the reward server at http://user:{SECRET}@127.0.0.1:9/score cannot be reached "
                              "(4 attempts); check that it runs.")
    with pytest.raises(ServedRewardError), tracker.ending(run_id):
        raise error
    run = tracker.client.get_run(run_id)
    assert run.info.status == "FAILED"
    reason = run.data.tags[FAILURE_TAG]
    assert reason.startswith("the reward server at http://") and "cannot be reached" in reason, reason
    assert SECRET not in reason and "\n" not in reason and len(reason) <= 5000

    long_id = tracker.child_run("why", "jagg-s1", method="jagg", seed=1, key="k1")
    with pytest.raises(UserError), tracker.ending(long_id):
        raise UserError("x" * 20000)
    assert len(tracker.client.get_run(long_id).data.tags[FAILURE_TAG]) <= 5000  # MLflow's tag limit

    bug_id = tracker.child_run("why", "jagg-s2", method="jagg", seed=2, key="k2")
    with pytest.raises(KeyError), tracker.ending(bug_id):
        raise KeyError(SECRET)  # a bug's text may quote anything: only its kind is told
    bug = tracker.client.get_run(bug_id).data.tags[FAILURE_TAG]
    assert "KeyError" in bug and SECRET not in bug


# --- (2) a served reward's retries each leave one line --------------------------------------------------------------


class _FailsFirst(http.server.BaseHTTPRequestHandler):
    """The first POST is a 503; every later one scores each image 0.5."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        self.server.seen += 1
        if self.server.seen == 1:
            status, answer = 503, b'{"error": "warming up"}'
        else:
            status, answer = 200, json.dumps({"scores": [0.5] * len(body["images"])}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)


def _fails_first():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FailsFirst)
    server.seen, server.daemon_threads = 0, True
    return _serving(server)  # test_served_rewards' thread around an http.server, for the block's duration


def test_each_retry_of_a_served_reward_is_one_log_line(caplog):
    """Before: a 503 was retried silently; the user saw nothing until the last attempt failed."""
    with _fails_first() as srv:
        port = srv.server_address[1]
        fn = make_reward("served", url=f"http://127.0.0.1:{port}/score", token=SECRET, retries=2, backoff_s=0.0)
        with caplog.at_level(logging.WARNING, logger="jagg_core.rewards.served"):
            scores = fn(torch.rand(2, 3, 8, 8), ["a", "b"], [{}, {}])[0]
    assert srv.seen == 2 and scores.tolist() == [0.5, 0.5]
    lines = [r.getMessage() for r in caplog.records if r.name == "jagg_core.rewards.served"]
    assert len(lines) == 1, lines
    assert "attempt 1 of 3" in lines[0] and "HTTP 503" in lines[0] and f"127.0.0.1:{port}" in lines[0], lines
    assert SECRET not in lines[0] and "\n" not in lines[0]


# --- (3) Prefect's failure log of a user error is one line, a bug's keeps its traceback ----------------------------


def _logged(exc: BaseException) -> str:
    """What a handler with the stages' filter (tasks.common.redact_logs) prints of Prefect's task failure log."""
    from tasks.common import redact_logs

    stream = io.StringIO()
    logger = logging.getLogger("jagg-test.prefect.task_runs")
    logger.propagate, logger.handlers = False, [logging.StreamHandler(stream)]
    redact_logs()
    try:
        try:
            raise exc
        except BaseException as e:  # noqa: BLE001  (as Prefect's task engine does: logger.error(..., exc_info=True))
            logger.error(f"Task run failed with exception: {e!r}", exc_info=True)
    finally:
        logger.handlers = []
    return stream.getvalue()


def test_prefect_logs_a_user_error_as_one_line_and_a_bug_with_its_traceback():
    """Tested on the logging filter directly (no `jagg run`): before, `jagg run` printed Prefect's traceback of a
    served reward's or an evaluation's user error before the one-line error."""
    shown = _logged(ServedRewardError("the reward server at http://127.0.0.1:9/score cannot be reached."))
    assert "Traceback" not in shown and shown.count("\n") == 1 and "cannot be reached" in shown, shown
    bug = _logged(ZeroDivisionError("division by zero"))
    assert "Traceback" in bug and "ZeroDivisionError" in bug
