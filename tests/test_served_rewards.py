"""The ``served`` reward against real HTTP servers on 127.0.0.1: the reference server of
``examples/plugins/served_reward_server.py`` (which can drop a connection, answer slowly or refuse) and small servers
that answer garbage; then end to end through the CLI (``slow``)."""

from __future__ import annotations

import contextlib
import csv
import http.server
import importlib.util
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_module
from jagg_core.rewards import make_reward, make_weighted_reward
from jagg_core.rewards.served import ServedRewardError, shown_address
from jagg_core.setup.params_io import load_params
from jagg_core.setup.redact import flatten

SERVER_SCRIPT = REPO / "examples" / "plugins" / "served_reward_server.py"
TOKEN = "tok-Xq81-very-secret-ZZ"


def _server_module():
    spec = importlib.util.spec_from_file_location("served_reward_server", SERVER_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SERVER = _server_module()


@contextlib.contextmanager
def _serving(server):
    """``server`` (an http.server on 127.0.0.1) answering in a thread for the duration of the block."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def reference_server(**kw):
    return _serving(SERVER.RewardServer("127.0.0.1", 0, **kw))


def _free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _images(n: int = 6) -> torch.Tensor:
    """``n`` images of distinct brightness (the reference server's score), seeded."""
    g = torch.Generator().manual_seed(0)
    return (torch.rand(n, 3, 8, 8, generator=g) * 0.5 + torch.linspace(0, 0.5, n)[:, None, None, None]).clamp(0, 1)


def _score(url: str, n: int = 6, **options):
    fn = make_reward("served", url=url, **{"backoff_s": 0.0, **options})
    return fn(_images(n), [f"prompt {i // 2}" for i in range(n)], [{} for _ in range(n)])[0]


def _one_sentence(text: str) -> None:
    assert "\n" not in text and "Traceback" not in text and len(text) < 500, text
    assert text.endswith("."), text


def test_scores_are_the_servers_brightness_in_batches_with_the_token():
    with reference_server(token=TOKEN) as srv:
        scores = _score(srv.url, batch_size=4, token=TOKEN)
        assert srv.requests == 2  # 6 images in batches of 4
    pixels = (_images() * 255).round() / 255
    assert torch.allclose(scores, pixels.mean((1, 2, 3)), atol=1e-6)


def test_a_dropped_connection_is_retried_and_the_scores_equal_an_undisturbed_run():
    with reference_server() as srv:
        undisturbed = _score(srv.url, batch_size=2)
    with reference_server(drop_request=2) as srv:  # the second of three requests: mid-batch
        retried = _score(srv.url, batch_size=2, retries=2)
        assert srv.requests == 4  # the dropped one was sent again
    assert torch.equal(retried, undisturbed)


def test_a_slow_answer_past_the_timeout_is_retried_then_one_sentence():
    with reference_server(delay_s=0.6) as srv:
        with pytest.raises(ServedRewardError) as e:
            _score(srv.url, timeout_s=0.15, retries=1)
        assert srv.requests == 2  # the first attempt and one retry
    text = str(e.value)
    _one_sentence(text)
    assert f"the reward server at {srv.url} did not answer within 0.15 s (2 attempts)" in text


@pytest.mark.parametrize("status, says", [(401, "HTTP 401 (missing or wrong bearer token) (check reward.options"),
                                           (422, "HTTP 422 (this server answers every request with 422)")])
def test_a_4xx_is_never_retried(status, says):
    kw = {"token": TOKEN} if status == 401 else {"status": status}
    with reference_server(**kw) as srv:
        with pytest.raises(ServedRewardError) as e:
            _score(srv.url, retries=3, token="wrong-token-value")
        assert srv.requests == 1
    _one_sentence(str(e.value))
    assert says in str(e.value) and "not retried" in str(e.value)


def test_a_503_is_retried_and_a_500_is_not_each_one_sentence():
    with reference_server(status=503) as srv:
        with pytest.raises(ServedRewardError, match=r"answered HTTP 503 \(this server .*\) \(3 attempts\)") as e:
            _score(srv.url, retries=2)
        assert srv.requests == 3
    _one_sentence(str(e.value))
    with reference_server(status=500) as srv:
        with pytest.raises(ServedRewardError, match="answered HTTP 500") as e:
            _score(srv.url, retries=2)
        assert srv.requests == 1
    _one_sentence(str(e.value))


def test_a_server_that_is_down_is_one_sentence_naming_its_address_without_its_query():
    port = _free_port()
    url = f"http://127.0.0.1:{port}/score?key=QueryKey123"  # (credentials in a url are refused: test_deadlines.py)
    with pytest.raises(ServedRewardError) as e:
        _score(url, retries=1, token=TOKEN)
    text = str(e.value)
    _one_sentence(text)
    assert f"the reward server at http://127.0.0.1:{port}/score cannot be reached" in text
    assert "(2 attempts: " in text and "check that it runs" in text
    for secret in ("QueryKey123", TOKEN):
        assert secret not in text


class _Garbage(http.server.BaseHTTPRequestHandler):
    """Answers every POST with the server's ``body`` (bytes) and status 200."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = self.server.body
        if callable(body):
            body = body(self)
        self.send_response(self.server.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def garbage_server(body, status: int = 200):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    server.body, server.status = body, status
    server.daemon_threads = True
    return _serving(server)


@pytest.mark.parametrize("body, says", [
    (b"<html>oops</html>", "answered something that is not JSON ('<html>oops</html>')"),
    (b'{"scores": [1, 2]}', "answered 2 scores for 6 images"),
    (b'{"score": [1, 2, 3, 4, 5, 6]}', 'answered no list under "scores" for 6 images'),
    (b"[1, 2, 3, 4, 5, 6]", 'answered no list under "scores" for 6 images'),
    (b'{"scores": [1, 2, NaN, 4, 5, 6]}', "a score that is not a finite number (NaN)"),
    (b'{"scores": [1, 2, null, 4, 5, 6]}', "a score that is not a finite number (null)"),
    (b'{"scores": [1, 2, true, 4, 5, 6]}', "a score that is not a finite number (true)"),
    (b'{"scores": [1, 2, "3", 4, 5, 6]}', "a score that is not a finite number (\"3\")"),
], ids=["html", "too-few", "no-scores", "a-list", "nan", "null", "bool", "string"])
def test_garbage_is_one_sentence_and_not_retried(body, says):
    with garbage_server(body) as srv:
        url = f"http://127.0.0.1:{srv.server_address[1]}/score"
        with pytest.raises(ServedRewardError) as e:
            _score(url, retries=3)
    _one_sentence(str(e.value))
    assert says in str(e.value), str(e.value)


def test_the_token_never_appears_in_an_error_even_when_the_server_echoes_it():
    def echo(handler):  # a careless server that quotes the request's Authorization header in its refusal
        return json.dumps({"error": f"bad credentials {handler.headers.get('Authorization')}"}).encode()

    with garbage_server(echo, status=403) as srv:
        url = f"http://127.0.0.1:{srv.server_address[1]}/score"
        with pytest.raises(ServedRewardError, match="HTTP 403") as e:
            _score(url, token=TOKEN)
    assert TOKEN not in str(e.value) and "Bearer ***" in str(e.value), str(e.value)
    with garbage_server(lambda h: f"not json {h.headers.get('Authorization')}".encode()) as srv:
        with pytest.raises(ServedRewardError, match="not JSON") as e:
            _score(f"http://127.0.0.1:{srv.server_address[1]}/score", token=TOKEN)
    assert TOKEN not in str(e.value), str(e.value)


def test_the_token_and_url_credentials_are_redacted_from_the_params_mlflow_gets():
    url = "http://bob:Url-Pass-987@127.0.0.1:9/score"
    params = load_params(REPO / "params.yaml", "ci", {"reward.weights": {"served": 1.0},
                                                      "reward.options.served": {"url": url, "token": TOKEN}})
    shown = json.dumps(flatten(params.redacted()))
    assert TOKEN not in shown and "Url-Pass-987" not in shown, shown
    assert params.redacted()["reward"]["options"]["served"]["token"] == "***"
    assert shown_address(url) == "http://127.0.0.1:9/score"


def test_how_the_server_is_reached_is_not_part_of_a_runs_fingerprint(tmp_path):
    """A rotated token, a longer timeout or other retries resume a run; another server or kind starts it over."""
    from jagg_core.setup.paths import Layout
    from jagg_core.trainer.fingerprint import run_fingerprint

    def key(**served):
        params = load_params(REPO / "params.yaml", "ci", {"reward.weights": {"served": 1.0},
                                                          "reward.options.served": served})
        return run_fingerprint(params, Layout.of(params, tmp_path), "jagg", 0)

    base = key(url="http://127.0.0.1:9/score", token="a-token")
    assert key(url="http://127.0.0.1:9/score", token="another", timeout_s=5, retries=9, batch_size=2,
               backoff_s=2, max_in_flight=1, overlap=False) == base
    assert key(url="http://127.0.0.1:8/score", token="a-token") != base
    assert key(url="http://127.0.0.1:9/score", token="a-token", kind="groupwise") != base


@pytest.mark.parametrize("options, says", [
    ({"url": "ftp://host/score"}, "reward.options.served.url"),
    ({"url": "http://h/s", "timeout_s": 0}, "reward.options.served.timeout_s"),
    ({"url": "http://h/s", "retries": 100}, "reward.options.served.retries"),
    ({"url": "http://h/s", "batch_size": 0}, "reward.options.served.batch_size"),
    ({"url": "http://h/s", "kind": "listwise"}, "reward.options.served.kind"),
    ({"url": "http://h/s", "max_in_flight": 0}, "reward.options.served.max_in_flight"),
    ({"url": "http://h/s", "max_in_flight": 65}, "reward.options.served.max_in_flight"),
    ({"url": "http://h/s", "overlap": "sometimes"}, "reward.options.served.overlap"),
    ({"url": "http://h/s", "retry": 2}, "retry"),
])
def test_bad_options_are_one_sentence_before_anything_runs(options, says):
    from jagg_core.setup.config import ParamsError

    with pytest.raises(ParamsError, match=says):
        load_params(REPO / "params.yaml", "ci", {"reward.weights": {"served": 1.0}, "reward.options.served": options})


def test_a_missing_url_a_bad_url_or_a_bad_token_is_one_sentence():
    with pytest.raises(ServedRewardError, match="reward.options.served.url is needed"):
        make_reward("served")
    for url in ("http://[::1/score", "http://host:port/score", "http:///score"):
        with pytest.raises(ServedRewardError, match="must be an http:// or https:// address"):
            make_reward("served", url=url)
    with pytest.raises(ServedRewardError, match="token must be printable ASCII") as e:
        make_reward("served", url="http://127.0.0.1:9/s", token="Bearer t\u00f6ken-secret")
    assert "secret" not in str(e.value)


def test_an_answer_too_large_or_with_a_score_beyond_floats_is_one_sentence(monkeypatch):
    import jagg_core.rewards.served as served

    monkeypatch.setattr(served, "MAX_ANSWER", 1000)
    with garbage_server(b'{"scores": [' + b"1," * 2000 + b"1]}") as srv:
        with pytest.raises(ServedRewardError, match="answered more than 0 MiB"):
            _score(f"http://127.0.0.1:{srv.server_address[1]}/score")
    with garbage_server(b'{"scores": [1, 2, 3, 4, 5, 1' + b"0" * 400 + b']}') as srv:
        with pytest.raises(ServedRewardError, match="not a finite number"):
            _score(f"http://127.0.0.1:{srv.server_address[1]}/score")


def test_a_groupwise_served_reward_gets_one_request_per_prompt_group():
    with reference_server() as srv:
        fn = make_weighted_reward({"served": 1.0}, {"served": {"url": srv.url, "kind": "groupwise", "batch_size": 1}})
        images = _images(6)
        total, info = fn(images, ["a"] * 3 + ["b"] * 3, [{}] * 6, groups=torch.tensor([5, 5, 5, 2, 2, 2]))
        assert srv.requests == 2  # one per group, whatever batch_size says
    # the images brighten with their index: each group's ranking is 0, 0.5, 1
    assert total.tolist() == [0.0, 0.5, 1.0, 0.0, 0.5, 1.0]


# --- end to end through the CLI ------------------------------------------------------------------------------------


@contextlib.contextmanager
def script_server(*args: str):
    """The reference server script as its own process on 127.0.0.1 (a free port); yields its URL."""
    proc = subprocess.Popen([sys.executable, str(SERVER_SCRIPT), "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "listening on http://127.0.0.1:PORT/score", or "" if it died
        assert line.startswith("listening on http://127.0.0.1:"), (line, proc.stderr.read() if not line else "")
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _requests_served(url: str) -> int:
    import httpx

    return httpx.get(url.replace("/score", "/stats"), trust_env=False, timeout=10).json()["requests"]


def _train(root: Path, url: str, *extra: str):
    return run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--seed", "0",
                      "--set", "reward.weights={served: 1.0}", "--set", f"reward.options.served.url={url}",
                      "--set", f"reward.options.served.token={TOKEN}", "--set", "reward.options.served.batch_size=3",
                      "--set", "reward.options.served.backoff_s=0", *extra, root=root, timeout=900)


def _curve(root: Path) -> list[dict]:
    path = root / "runs" / "ci" / "jagg-s0" / "curve.tsv"
    return [{k: v for k, v in row.items() if not k.startswith("time/")}
            for row in csv.DictReader(path.open(), delimiter="\t")]


def _final_weights(root: Path) -> dict:
    from jagg_core.trainer.checkpoint import load_tensors

    return load_tensors(root / "checkpoints/ci/jagg-s0/checkpoint-000002/trainable.safetensors")


@pytest.mark.slow  # two ci trainings of 2 iterations through the launcher and a worker: ~2-4 min
def test_cli_training_with_a_served_reward_survives_a_dropped_connection_bit_for_bit(ci_base, tmp_path):
    """The undisturbed run sends one request at a time after sampling (as before requests were in flight); the
    disturbed one several at once, each micro-batch's as soon as it is sampled (sample.batch_size 4: two per
    rollout), and one is dropped and retried: the same curve and weights, bit for bit."""
    import shutil

    runs, requests = {}, {}
    sequential = ("--set", "reward.options.served.overlap=false", "--set", "reward.options.served.max_in_flight=1")
    for case, args, how in (("undisturbed", (), sequential), ("dropped", ("--drop-request", "2"), ())):
        root = tmp_path / case
        shutil.copytree(ci_base, root)
        with script_server("--token", TOKEN, *args) as url:
            out = _train(root, url, "--set", "sample.batch_size=4", *how)
            requests[case] = _requests_served(url)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-3000:]
        assert TOKEN not in text
        runs[case] = root
    # 8 images per iteration in batches of 3: 3 requests each; the dropped one was sent again
    assert requests == {"undisturbed": 6, "dropped": 7}
    curves = {case: _curve(root) for case, root in runs.items()}
    assert len(curves["undisturbed"]) == 2 and "reward/served/mean" in curves["undisturbed"][0]
    assert curves["dropped"] == curves["undisturbed"]
    a, b = _final_weights(runs["undisturbed"]), _final_weights(runs["dropped"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    params_json = (runs["dropped"] / "runs" / "ci" / "jagg-s0" / "params.json").read_text()
    assert TOKEN not in params_json and '"token": "***"' in params_json


@pytest.mark.slow  # one ci launch that stops at its first reward: ~1 min
def test_cli_training_with_the_server_down_is_one_sentence_and_a_failed_mlflow_run(ci_project):
    from jagg_core.pipeline.tracking import Tracker

    port = _free_port()
    out = _train(ci_project, f"http://127.0.0.1:{port}/score", "--set", "reward.options.served.retries=1")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("jagg: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert f"the reward server at http://127.0.0.1:{port}/score cannot be reached" in errors[0], errors
    assert "Traceback" not in out.stderr and TOKEN not in text
    params = load_params(ci_project / "params.yaml", "ci")
    tracker = Tracker(params, ci_project)
    runs = tracker.client.search_runs([tracker.experiment_id])
    statuses = {r.data.tags.get("jagg.run"): r.info.status for r in runs}
    assert statuses.get("jagg-s0") == "FAILED", statuses
