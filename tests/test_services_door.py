"""`jagg services` at its doors (issue 61, mechanism 6): it signals only what it started, and a worker gets a name it
can keep — the project's name rule, and none that a live worker of the pool already has.

Real processes (`sleep`) stand for the services; a stub HTTP server on 127.0.0.1 answers the two calls `jagg services
worker` makes of the Prefect server before it starts a worker (its health, the pool's workers); the worker's spawn is
a spy, so no test starts Prefect.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest

import tasks.services as services


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setattr(services, "STATE", tmp_path)
    monkeypatch.setattr(services, "_interruptible", lambda: None)  # main() would take the test process's signals
    return tmp_path


@pytest.fixture
def sleeper():
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        procs.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_down_leaves_a_process_whose_command_line_is_not_the_one_it_started(state, sleeper, capsys):
    """Before: pids.json naming a stranger's pid and start time (a record of `prefect server start`, or one without a
    command line) made `jagg services down` kill the stranger. After: its command line is compared with the one
    recorded as the service started; a mismatch is left alone and said in one line."""
    stranger = sleeper()
    started = psutil.Process(stranger.pid).create_time()
    server = [str(services.BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", "4200"]
    for record in ({"pid": stranger.pid, "started": started, "cmd": server},
                   {"pid": stranger.pid, "started": started}):  # no command line recorded: not provably ours
        (state / "pids.json").write_text(json.dumps({"server": record, "host": socket.gethostname()}))
        capsys.readouterr()
        assert services.main(["status"]) == 0
        status = capsys.readouterr().out
        assert "running" not in status and "command line is not the one jagg started" in status, status
        services.down()
        assert stranger.poll() is None, "down signalled a process it did not start"
        said = capsys.readouterr().out.strip().splitlines()
        assert len(said) == 1 and said[0].startswith(f"jagg: server: pid {stranger.pid} left alone: it runs "
                                                     f"`sleep 60`, not the command line jagg started"), said
    # a service it started (its command line recorded as it started) is stopped, on the head and on a worker host
    ours, worker = sleeper(), sleeper()
    services._write_pids({"server": ours.pid})
    services._write_pids({"worker-gpu-1": worker.pid}, services._host_file())
    assert json.loads((state / "pids.json").read_text())["server"]["cmd"] == ["sleep", "60"]
    services.main(["status"])
    assert capsys.readouterr().out.count("running") == 2
    services.down()
    assert ours.wait(timeout=20) is not None and worker.wait(timeout=20) is not None
    assert capsys.readouterr().out == ""


class _Prefect:
    """A stub of the Prefect server's two answers `jagg services worker` reads before it starts a worker."""

    def __init__(self, workers: list[dict]):
        self.workers = workers
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # noqa: ANN002
                pass

            def _answer(self, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer(True) if self.path == "/api/health" else self.send_error(404)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/api/work_pools/jagg/workers/filter":
                    self._answer(stub.workers)
                else:
                    self.send_error(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.api = f"http://127.0.0.1:{self.server.server_address[1]}/api"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def prefect():
    stubs: list[_Prefect] = []

    def start(workers: list[dict]) -> _Prefect:
        stubs.append(_Prefect(workers))
        return stubs[-1]

    yield start
    for s in stubs:
        s.close()


@pytest.fixture
def spawned(monkeypatch, sleeper):
    """The services' spawns, recorded; each starts a `sleep` in place of Prefect or MLflow."""
    calls: list[str] = []

    def spawn(name: str, cmd: list[str], env: dict) -> int:
        calls.append(name)
        return sleeper().pid

    monkeypatch.setattr(services, "_spawn", spawn)
    monkeypatch.setattr(services, "_wait_worker", lambda *a: None)
    return calls


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_a_worker_name_off_the_name_rule_is_one_sentence_and_starts_nothing(state, prefect, spawned, capsys,
                                                                             monkeypatch):
    """Before: `--name a/b` was an `Errno 2` (its log .services/worker-a/b.log), 500 characters an `OSError`
    traceback (a file name too long). After: the project's name rule (jagg_core/setup/names.py) at the door, one
    sentence, exit 1, nothing started — for `jagg services worker` and `jagg services up`."""
    stub = prefect([])
    wait = services._wait_http  # (`up` before the fix: its server, a `sleep`, never answers; give up at once)
    monkeypatch.setattr(services, "_wait_http", lambda url, timeout, what: wait(url, 1, what))
    for name in ("a/b", "x" * 500, "..", "Gpu 1", "-gpu"):
        assert services.main(["worker", "--api", stub.api, f"--name={name}"]) == 1
        said = _error(capsys)
        assert said.startswith("jagg: error: the worker name ") and "is not a name by the project's rule" in said
        assert len(said) < 300, said
        assert services.main(["up", f"--name={name}", "--mlflow-port", "0", "--prefect-port", "1"]) == 1
        assert "is not a name by the project's rule" in _error(capsys)
    assert spawned == [] and not (state / "pids.json").exists()
    # a host's name is the default: lowercased, it may hold dots; one off the rule asks for --name
    monkeypatch.setattr(services.socket, "gethostname", lambda: "Node_3.Lab")
    assert services._worker_name(None) == "node_3.lab" and services._worker_name("gpu-1.cluster") == "gpu-1.cluster"
    monkeypatch.setattr(services.socket, "gethostname", lambda: "my laptop")
    with pytest.raises(services.ServiceError, match=r"^this host's name 'my laptop', the worker's default name, is "
                                                      r"not a name by the project's rule .*: give --name one"):
        services._worker_name(None)


def test_a_worker_name_a_live_worker_of_the_pool_has_is_refused_naming_it(state, prefect, spawned, capsys):
    """Before: a second host starting `jagg services worker --name gpu-1` while gpu-1 ran elsewhere became the same
    Prefect worker, sharing its log. After: a worker of that name the pool's server calls ONLINE is refused in one
    sentence naming it, nothing started; an OFFLINE one (stopped) is replaced."""
    beat = "2026-12-05T19:31:01.987684Z"
    stub = prefect([{"name": "gpu-2", "status": "ONLINE", "last_heartbeat_time": beat},
                    {"name": "gpu-1", "status": "ONLINE", "last_heartbeat_time": beat, "heartbeat_interval_seconds": 30}])
    assert services.main(["worker", "--api", stub.api, "--name", "gpu-1", "--queue", "units"]) == 1
    said = _error(capsys)
    assert said.startswith(f"jagg: error: a worker named 'gpu-1' of pool 'jagg' is online at {stub.api} (last "
                           f"heartbeat {beat})") and "give another --name" in said and "offline 90 s after" in said
    assert spawned == [] and not services._host_file().exists()
    stub.workers[1]["status"] = "OFFLINE"
    assert services.main(["worker", "--api", stub.api, "--name", "gpu-1", "--queue", "units"]) == 0
    assert spawned == ["worker-gpu-1"]
    assert f"worker 'gpu-1' serves pool 'jagg' of {stub.api}" in capsys.readouterr().out


@pytest.fixture
def up_parts(monkeypatch, sleeper):
    """`jagg services up` with what it starts recorded: each spawn's command line and environment (a `sleep` in its
    place, or the real process for the names in ``real``), the pool's creation and the deployment stubbed."""
    spawns: dict[str, dict] = {}
    real: set[str] = set()
    spawn = services._spawn

    def record(name: str, cmd: list[str], env: dict) -> int:
        spawns[name] = {"cmd": cmd, "env": env}
        return spawn(name, cmd, env) if name in real else sleeper().pid

    monkeypatch.setattr(services, "_spawn", record)
    wait = services._wait_http
    monkeypatch.setattr(services, "_wait_http", lambda url, timeout, what: wait(url, timeout, what)
                        if "prefect-server" in real and what == "the Prefect server" else None)
    monkeypatch.setattr(services, "_run", lambda cmd, env: None)
    monkeypatch.setattr(services, "crash_automation", lambda api, crash_after=0: None)
    monkeypatch.setattr(services, "late_automations", lambda api, pool, wait_s: [])
    monkeypatch.setattr(services, "deployments", lambda api: ["jagg-reproduce/toy"])
    monkeypatch.setattr(services.socket, "gethostname", lambda: "head-1")
    return spawns, real


def test_bound_to_every_interface_up_advertises_an_address_other_machines_reach(state, up_parts, capsys,
                                                                               monkeypatch):
    """Before: `jagg services up --host 0.0.0.0` (docs/scaling.md's N-host set-up) served a Prefect UI whose pages
    called `http://0.0.0.0:4210/api` (PREFECT_UI_API_URL), which a browser on another machine cannot reach, printed
    that address, and the reports' MLflow links ignored `--mlflow-port` and the host (tracking.ui_url's
    127.0.0.1:5000). After: the advertised address (`--advertise`, by default this host's name) in the UI's API
    address, the printed URLs and, through the worker's JAGG_MLFLOW_UI_URL, the report's MLflow links; this host's
    own processes still call the loopback."""
    from tasks.common import load

    spawns, _ = up_parts
    ci, named = load("ci"), load("ci", None, {"tracking.ui_url": "http://mlflow.lab:80"})
    for extra, public in (([], "head-1"), (["--advertise", "10.0.0.5"], "10.0.0.5")):
        assert services.main(["up", "--host", "0.0.0.0", "--prefect-port", "4210", "--mlflow-port", "5001",
                              *extra]) == 0
        printed = capsys.readouterr().out
        server, worker = spawns["prefect-server"]["env"], spawns["prefect-worker"]["env"]
        assert server["PREFECT_UI_API_URL"] == f"http://{public}:4210/api"
        assert worker["JAGG_MLFLOW_UI_URL"] == f"http://{public}:5001"
        assert worker["PREFECT_UI_URL"] == f"http://{public}:4210"
        assert worker["PREFECT_API_URL"] == "http://127.0.0.1:4210/api"  # this host's own processes: the loopback
        assert spawns["mlflow"]["cmd"][2:6] == ["--host", "0.0.0.0", "--port", "5001"]
        assert f"prefect_ui: http://{public}:4210" in printed and f"mlflow_ui: http://{public}:5001" in printed
        assert f"PREFECT_API_URL=http://{public}:4210/api " in printed and "0.0.0.0" not in printed
        services.down()
        # the report a sweep of that worker makes links to that MLflow UI, unless the params name one
        from tasks.report import ui_url
        monkeypatch.setenv("JAGG_MLFLOW_UI_URL", worker["JAGG_MLFLOW_UI_URL"])
        assert ui_url(ci) == f"http://{public}:5001" and ui_url(named) == "http://mlflow.lab:80"
    monkeypatch.delenv("JAGG_MLFLOW_UI_URL")
    assert ui_url(ci) == "http://127.0.0.1:5000"  # outside `jagg services`: the field's default
    # bound to one address, that address is the one handed out
    assert services.main(["up", "--host", "10.0.0.7", "--prefect-port", "4210", "--mlflow-port", "0"]) == 0
    assert spawns["prefect-server"]["env"]["PREFECT_UI_API_URL"] == "http://10.0.0.7:4210/api"
    assert "JAGG_MLFLOW_UI_URL" not in spawns["prefect-worker"]["env"]  # no MLflow UI started: the params' own
    services.down()
    capsys.readouterr()
    spawns.clear()
    for bad in ("http://head:5000", "head:5000", "0.0.0.0", "[::]", "a/b", "x" * 300):
        assert services.main(["up", "--host", "0.0.0.0", "--advertise", bad]) == 1
        said = _error(capsys)
        assert said.startswith("jagg: error: --advertise ") and "no scheme, port or path" in said and len(said) < 400
    assert spawns == {} and not (state / "pids.json").exists()


@pytest.mark.parametrize("bad, why", [
    ("0", "short, octal or hex form (0.0.0.0"), ("0.0", "(0.0.0.0"), ("0x0", "(0.0.0.0"),
    ("000.0.0.0", "(0.0.0.0"), ("127.1", "(127.0.0.1"), ("::ffff:0.0.0.0", "every interface"),
    ("[::ffff:0.0.0.0]", "every interface"), ("localhost", "loopback"), ("127.0.0.1", "loopback"),
    ("::1", "loopback"), ("fe80::1%eth0", "link-local"), ("fe80::1", "link-local"), ("eth0%x", "scoped"),
    ("[10.0.0.5]", "in brackets"), ("224.0.0.1", "multicast"),
])
def test_advertise_is_parsed_as_an_address_not_by_its_spelling(state, up_parts, capsys, bad, why):
    """Before: `--advertise` took 0, 0.0, 0x0, 000.0.0.0 (every interface to the system's resolver), ::ffff:0.0.0.0,
    127.1, localhost and fe80::1%eth0 (an invalid URL: `http://[fe80::1%eth0]:4200`). After: `ipaddress` reads it
    (an IPv4-mapped address as its IPv4 one), a name's numeric last label is the resolver's IPv4 form, and an
    address no other machine reaches (every interface, loopback, `localhost`, link-local, multicast) is one sentence,
    nothing started. `localhost` is refused: it is this machine on every machine."""
    spawns, _ = up_parts
    assert services.main(["up", "--host", "0.0.0.0", "--advertise", bad]) == 1
    said = _error(capsys)
    assert said.startswith(f"jagg: error: --advertise {bad!r} ") and why in said and "no scheme, port or path" in said
    assert spawns == {} and not (state / "pids.json").exists()
    for good in ("head", "gpu-1.lab", "10.0.0.5", "2001:db8::1", "[2001:db8::1]"):
        assert services.advertised("0.0.0.0", good) == good
    for wildcard in ("0", "0x0", "::ffff:0.0.0.0", "0.0.0.0", "::"):  # --host: every interface by ipaddress too
        assert services.advertised(wildcard) == "head-1"


@pytest.mark.slow  # a real `prefect server start` (~10-20 s on a 2-core host)
def test_the_prefect_ui_of_a_server_bound_to_every_interface_calls_the_advertised_api(state, up_parts):
    """The real Prefect server `jagg services up --host 0.0.0.0` starts on host head-1 (its pool, deployments, worker
    and MLflow stubbed) tells its UI's pages to call http://head-1:<port>/api (its /ui-settings, which the browser
    reads first); before, http://0.0.0.0:<port>/api."""
    import urllib.request

    spawns, real = up_parts
    real.add("prefect-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        services.up("0.0.0.0", port, None, "jagg")  # advertised: this host's name, head-1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=30) as r:
            settings = json.loads(r.read())
    finally:
        services.down()
    assert settings["api_url"] == f"http://head-1:{port}/api", settings


def test_a_worker_restarted_as_the_docs_say_links_to_the_advertised_uis(state, up_parts, monkeypatch):
    """docs/scaling.md, "Restarting only the head's worker": `jagg services worker --api http://head:4200/api --name
    head-2 --queue default` on the head. Before: that worker had no JAGG_MLFLOW_UI_URL, so its sweeps' reports
    linked to tracking.ui_url's 127.0.0.1:5000 (neither the head nor --mlflow-port). After: it gets the UIs `up`
    recorded in pids.json, as `up`'s own worker does."""
    spawns, _ = up_parts
    assert services.main(["up", "--host", "0.0.0.0", "--prefect-port", "4210", "--mlflow-port", "5001"]) == 0
    monkeypatch.setattr(services, "_registered", lambda api, pool, name: None)  # no worker of that name online
    monkeypatch.setattr(services, "_wait_worker", lambda *a: None)
    assert services.worker("http://head-1:4210/api", "jagg", "head-2", ["default"]) == "head-2"
    env = spawns["worker-head-2"]["env"]
    assert env["JAGG_MLFLOW_UI_URL"] == "http://head-1:5001" and env["PREFECT_UI_URL"] == "http://head-1:4210"
    assert env["PREFECT_API_URL"] == "http://head-1:4210/api"
    services.down()
