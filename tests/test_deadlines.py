"""Issue 61, mechanism 2: every wait has a deadline. The served reward against real HTTP servers on 127.0.0.1 that drip
their answer or answer JSON the client must not read whole (the helpers of tests/test_served_rewards.py), and a
pool-dispatched sweep that no worker serves."""

from __future__ import annotations

import http.server
import re
import time

import pytest

from test_served_rewards import _one_sentence, _score, _serving, garbage_server
from jagg_core.rewards.served import ServedRewardError


# --- the served reward: one deadline per request ---------------------------------------------------------------------

class _Drip(http.server.BaseHTTPRequestHandler):
    """Answers every POST with valid scores, one byte every ``server.every_s`` seconds: of its status line and headers
    (``server.part == "head"``) or of its body (``"body"``). No single read waits long; the whole answer does."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests += 1
        body = b'{"scores": [1, 2, 3, 4, 5, 6]}' + b" " * 70
        head = f"HTTP/1.0 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        drip, at_once = (head + body, b"") if self.server.part == "head" else (body, head)
        try:
            self.wfile.write(at_once)
            self.wfile.flush()
            for i in range(len(drip)):
                self.wfile.write(drip[i:i + 1])
                self.wfile.flush()
                time.sleep(self.server.every_s)
        except OSError:  # the client cut the connection: its deadline
            pass


def drip_server(part: str, every_s: float = 0.05):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    server.part, server.every_s, server.requests, server.daemon_threads = part, every_s, 0, True
    return _serving(server)


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_server_that_drips_its_answer_is_cut_at_the_deadline_retried_then_one_sentence(part):
    """A byte every 0.05 s never lets one read wait 0.3 s: before, the answer's ~100 bytes took 5 s and were accepted
    (each read within timeout_s); now each request has one deadline of timeout_s, all of it."""
    with drip_server(part) as srv:
        url = f"http://127.0.0.1:{srv.server_address[1]}/score"
        start = time.monotonic()
        with pytest.raises(ServedRewardError) as e:
            _score(url, timeout_s=0.3, retries=1)
        took = time.monotonic() - start
        assert srv.requests == 2  # the first attempt and one retry, as for any timeout
    text = str(e.value)
    _one_sentence(text)
    assert f"the reward server at {url} did not answer within 0.3 s (2 attempts); if the judge is slow" in text, text
    assert took < 2.0, took


def test_a_server_that_answers_in_time_a_byte_at_a_time_still_gives_its_scores():
    """The deadline is on the whole answer, not a guess: a drip that ends within it is read whole."""
    with drip_server("body", every_s=0.002) as srv:
        scores = _score(f"http://127.0.0.1:{srv.server_address[1]}/score", timeout_s=5)
    assert scores.tolist() == [1, 2, 3, 4, 5, 6]


# --- the served reward: an answer parsed with bounds, and what is wrong said -----------------------------------------

DEEP = b"[" * 200_000 + b"]" * 200_000


@pytest.mark.parametrize("body, says", [
    (b'{"scores": ' + DEEP + b"}", "answered JSON nested deeper than 64 levels; it must answer"),
    (b'{"scores": [1, 2, 3, 4, 5, 6], "scores": [6, 5, 4, 3, 2, 1]}',
     "answered JSON whose key 'scores' is given twice in one object; it must answer"),
    (b'{"scores": [1, 2, 3, 4, 5, 1' + b"0" * 4999 + b"]}", "answered a number of 5,000 digits; it must answer"),
    (b'{"scores": [1, 2, 3, 4, 5, 6.' + b"0" * 4999 + b"]}", "answered a number of 5,000 digits; it must answer"),
], ids=["200000-nested", "key-twice", "5000-digit-int", "5000-digit-float"])
def test_an_answer_too_deep_with_a_key_twice_or_a_huge_number_is_one_sentence_saying_so(body, says):
    """Before: 200,000 nested [ was a RecursionError traceback, a key twice was read (the last one won), a
    5,000-digit integer was "not JSON" (Python's int limit), a 5,000-digit float was read."""
    with garbage_server(body) as srv:
        url = f"http://127.0.0.1:{srv.server_address[1]}/score"
        with pytest.raises(ServedRewardError) as e:
            _score(url, retries=3)
    _one_sentence(str(e.value))
    assert f"the reward server at {url} {says}" in str(e.value), str(e.value)


def test_a_refusal_whose_error_body_is_nested_200000_deep_is_still_the_refusals_sentence():
    """Before: the 4xx's body, read for its "error", was a RecursionError traceback."""
    with garbage_server(b'{"error": ' + DEEP + b"}", status=422) as srv:
        with pytest.raises(ServedRewardError) as e:
            _score(f"http://127.0.0.1:{srv.server_address[1]}/score", retries=3)
    _one_sentence(str(e.value))
    assert "refused the request with HTTP 422; a refused request is not retried" in str(e.value), str(e.value)


def test_a_plain_answer_is_read_as_before():
    with garbage_server(b'{"scores": [1, 2.5, -3e2, 4, 5, 6], "note": {"a": [{"b": "[[[{{{"}]}}') as srv:
        scores = _score(f"http://127.0.0.1:{srv.server_address[1]}/score")
    assert scores.tolist() == [1, 2.5, -300, 4, 5, 6]


# --- a pool-dispatched sweep that no worker serves -------------------------------------------------------------------
# flows/pool.py's run_on_pool against tests/test_pool_dispatch.py's scripted Prefect client (run_deployment,
# read_flow_runs, set_flow_run_state), with Prefect's own state objects; the real server and workers of that module's
# `cluster` take minutes to start, so the flow run's state is checked as the client is asked to set it.

class _SweepPrefect:
    """The scripted client, plus the state calls made on the sweep's own flow run (``SWEEP``)."""

    SWEEP = "5eeb5eeb-0000-4000-8000-000000000000"

    def __init__(self, outcome):
        from test_pool_dispatch import _FakePrefect

        self.fake, self.told = _FakePrefect(outcome), []

    def __getattr__(self, name):
        return getattr(self.fake, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set_flow_run_state(self, fid, state, force):
        if str(fid) == self.SWEEP:
            assert force and state.is_running()  # the sweep keeps RUNNING; only its message changes
            self.told.append(state.message)
        else:
            self.fake.set_flow_run_state(fid, state, force)


def _sweep(monkeypatch, outcome, **resources):
    from types import SimpleNamespace

    import flows.pool as pool
    from conftest import REPO
    from jagg_core.setup.params_io import load_params

    prefect = _SweepPrefect(outcome)
    run = SimpleNamespace(id=prefect.SWEEP, run_count=1, tags=[])
    monkeypatch.setattr(pool, "POLL_S", 0.0)
    monkeypatch.setattr(pool, "run_deployment", prefect.fake.run_deployment)
    monkeypatch.setattr(pool, "get_client", lambda sync_client: prefect)
    monkeypatch.setattr(pool, "FlowRunContext", SimpleNamespace(get=lambda: SimpleNamespace(flow_run=run)))
    monkeypatch.setattr(pool, "write_sentinel", lambda params, root, sweep: {"file": "t"})
    monkeypatch.setattr(pool, "remove_sentinel", lambda root, shared: None)
    params = load_params(REPO / "params.yaml", "ci", {"run.methods": ["jagg"], "run.seeds": [0],
                                                      **{f"resources.{k}": v for k, v in resources.items()}})
    return prefect, lambda: pool.run_on_pool(params, profile="ci", parallel_runs=2, sweep="s", overrides=None,
                                             params_file=None, restart=False)


def test_a_sweep_no_worker_serves_fails_after_pool_wait_s_in_one_sentence_and_says_so_in_its_state(monkeypatch):
    """Before: the sweep waited for ever, its "no worker has taken it" line in its log only; now the line is its flow
    run's state message too, and after resources.pool_wait_s it fails (cancelling what it submitted)."""
    import flows.pool as pool
    from prefect.states import Scheduled

    from flows.pool import PoolError

    monkeypatch.setattr(pool, "UNTAKEN_S", 0.05)
    start = time.monotonic()

    def outcome(unit, polls):
        assert time.monotonic() - start < 5, "the sweep still waits after 5 s"  # before: for ever
        return Scheduled()

    prefect, sweep = _sweep(monkeypatch, outcome, pool_wait_s=0.3)
    with pytest.raises(PoolError) as e:
        sweep()
    assert time.monotonic() - start < 3
    _one_sentence(str(e.value))
    said = str(e.value)
    assert re.fullmatch(r"no worker of the pool has taken any of the sweep's units in 0\.3 s "
                        r"\(resources\.pool_wait_s\): start one that serves the pool's queue `units` "
                        r"\(docs/scaling\.md\), or set resources\.pool_wait_s to 0 to wait for ever; the sweep stopped "
                        r"and cancelled the units still in flight \(evaluate base, train jagg-s0\): run it again to "
                        r"resume them\.", said), said
    assert prefect.told and set(prefect.told) <= {
        f"{u}: no worker of the pool has taken it in 0 s; start one that serves the pool's queue `units` "
        f"(docs/scaling.md)" for u in ("evaluate base", "train jagg-s0")}, prefect.told
    assert sorted(prefect.cancelled) == ["evaluate base", "train jagg-s0"]


@pytest.mark.parametrize("wait", [{}, {"pool_wait_s": 0}], ids=["default", "0"])
def test_a_sweep_waits_until_a_worker_comes_saying_so_in_its_state_message_then_clears_it(monkeypatch, wait):
    """With the default (an hour) or 0 (for ever) the sweep waits 0.5 s of polls for a worker; meanwhile its state
    message says which unit no worker has taken (before: its log only), and once they are taken it says nothing."""
    import flows.pool as pool
    from prefect.states import Completed, Running, Scheduled

    monkeypatch.setattr(pool, "UNTAKEN_S", 0.05)
    came = time.monotonic() + 0.5  # a worker comes after 0.5 s

    def outcome(unit, polls):
        now = time.monotonic()
        return Scheduled() if now < came else Running() if now < came + 0.1 else Completed()

    prefect, sweep = _sweep(monkeypatch, outcome, **wait)
    done = sweep()
    assert sorted((d["kind"], d["run"]) for d in done) == [("evaluate", "base"), ("evaluate", "jagg-s0"),
                                                            ("train", "jagg-s0")]
    assert prefect.told[0] and prefect.told[-1] is None, prefect.told  # said while it waited, cleared once taken


def test_pool_wait_s_is_a_setting_of_resources_with_a_default_of_an_hour():
    from conftest import REPO
    from jagg_core.setup.config import ParamsError
    from jagg_core.setup.params_io import load_params

    assert load_params(REPO / "params.yaml", "ci").resources.pool_wait_s == 3600
    with pytest.raises(ParamsError, match="pool_wait_s"):
        load_params(REPO / "params.yaml", "ci", {"resources.pool_wait_s": -1})


# --- issue 61, mechanism 3 (its served part): credentials in a served url are refused, never sent as HTTP Basic -----

@pytest.mark.parametrize("with_token", [False, True], ids=["url-only", "url-and-token"])
def test_a_served_url_with_credentials_is_refused_pointing_to_token_and_nothing_is_sent(with_token):
    """Before: httpx sent user:password as HTTP Basic (with a token beside it, the token was silently not sent) and a
    server echoing its header got base64(user:password) into an error; now one sentence, before any request."""
    import base64

    password = "Pa55-w0rd-XYZ"
    seen = []

    def echo(handler):
        seen.append(handler.headers.get("Authorization"))
        return b'{"scores": [1, 2, 3, 4, 5, 6]}'

    with garbage_server(echo) as srv:
        url = f"http://alice:{password}@127.0.0.1:{srv.server_address[1]}/score"
        with pytest.raises(ServedRewardError) as e:
            _score(url, **({"token": "tok-Xq81-beside"} if with_token else {}))
    text = str(e.value)
    _one_sentence(text)
    assert seen == [], seen  # nothing was sent
    assert (f"reward.options.served.url 'http://127.0.0.1:{srv.server_address[1]}/score' holds credentials before its "
            f"host, which would be sent as HTTP Basic: put the secret in reward.options.served.token") in text, text
    basic = base64.b64encode(f"alice:{password}".encode()).decode()
    for secret in (password, "alice", basic):
        assert secret not in text
