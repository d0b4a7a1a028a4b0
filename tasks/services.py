"""`jagg services up|down|status` and `jagg ui`: the local Prefect server, a worker, the deployments, the MLflow UI.

Everything binds to 127.0.0.1 unless ``--host`` says otherwise; bound to every interface (``--host 0.0.0.0``), the
addresses handed out (the Prefect UI's API, the MLflow links of the sweeps' reports, what is printed) are
``--advertise``'s, by default this host's name. State (pids, logs, PREFECT_HOME) lives in ``.services/`` at the
repository root. The worker is stopped before the server (a worker without its server ignores
SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any
from pathlib import Path

from .common import MLFLOW_UI_ENV, ROOT, ServiceError, cli, load
from jagg_core.pipeline.tracking import resolve_uri
from jagg_core.setup.names import is_name, name_rule
from jagg_core.setup.redact import redact
from jagg_core.setup.json_read import parse_json
from jagg_core.setup.storage import atomic_write_text, open_append, read_regular
from .launch import Interrupted

STATE = ROOT / ".services"
BIN = Path(sys.executable).parent


# A flow run's process emits a heartbeat every HEARTBEAT_S (Prefect's own, `PREFECT_FLOWS_HEARTBEAT_FREQUENCY`; 30 s
# is its minimum); the automation below marks a run CRASHED once none came for CRASH_AFTER_S (Prefect's "zombie flow
# run" recipe): a worker or host that died leaves its runs CRASHED, and a pool-dispatched sweep submits them again.
HEARTBEAT_S = 30
CRASH_AFTER_S = 90
AUTOMATION = "jagg: a flow run without heartbeats is crashed"
LATE_AUTOMATION = "jagg: cancel a run of {pool}/{queue} that no worker takes"
_FINAL_EVENTS = [f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")]  # a run's end
WORKER_START_S = 120  # a worker's first heartbeat: its imports take ~10 s on a slow 2-core host
_HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")  # a DNS name, or an IPv4 address


def advertised(host: str, advertise: str | None = None) -> str:
    """The address other machines reach this host's services by: ``advertise`` (a host name or an IP address), else
    the bind address ``host``, else, bound to every interface (``0.0.0.0``, ``::``), this host's name. (Bound to
    0.0.0.0, the Prefect UI's pages called ``http://0.0.0.0:4200/api``, which a browser on another machine cannot
    reach, and the reports' MLflow links named 127.0.0.1.)"""
    if advertise is None:
        return socket.gethostname() if _every_interface(host) else host
    problem = _not_reachable(advertise)
    if problem:
        shown = repr(advertise) if len(advertise) <= 80 else f"{advertise[:80]!r}…"
        raise ServiceError(f"--advertise {shown} {problem}; give the host name or IP address other machines reach "
                           f"this one by (such as head or 10.0.0.5: no scheme, port or path).")
    return advertise


# A DNS name's last label is never all digits (RFC 3696, 2): one that is, or a hex number, is an IPv4 address the
# system's resolver reads in inet_aton's short, octal or hex forms (`127.1` is 127.0.0.1, `0x0` and `000.0.0.0` are
# 0.0.0.0), which ipaddress refuses and other tools read otherwise
_NUMERIC_LABEL = re.compile(r"(?:\d+|0[xX][0-9a-fA-F]*)")


def _every_interface(host: str) -> bool:
    """Whether the bind address ``host`` means every interface (``0.0.0.0``, ``::``, nothing, and the resolver's
    other spellings of them: ``0``, ``0x0``, ``::ffff:0.0.0.0``), read by ``ipaddress``, not by its spelling."""
    import ipaddress

    if not host.strip("[]"):
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            return socket.inet_aton(host) == bytes(4)
        except OSError:
            return False
    return (getattr(ip, "ipv4_mapped", None) or ip).is_unspecified


def _not_reachable(text: str) -> str | None:
    """Why ``text`` is no address another machine reaches this one by, or None: parsed as an IP address by
    ``ipaddress`` (an IPv6 one bracketed or not, an IPv4-mapped one as its IPv4 address), never by its spelling;
    else a host name by the DNS rule, not one of the resolver's numeric forms, not ``localhost``."""
    import ipaddress

    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        ip = None
    if ip is None:
        if "%" in bare:
            return "is a scoped IPv6 address (its zone names an interface of this machine; no URL's host)"
        if not _HOST_NAME.fullmatch(text):
            return "is neither a host name nor an IP address"
        if _NUMERIC_LABEL.fullmatch(text.rsplit(".", 1)[-1]):
            try:
                meant = f" ({socket.inet_ntoa(socket.inet_aton(text))} to the system's resolver)"
            except OSError:
                meant = ""
            return f"is an IPv4 address in a short, octal or hex form{meant}, or no address at all"
        if text.lower().rstrip(".") == "localhost" or text.lower().rstrip(".").endswith(".localhost"):
            return "names this machine on every machine (loopback)"
        return None
    if text.startswith("[") and ip.version == 4:
        return "is an IPv4 address in brackets"
    ip = getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:0.0.0.0 is 0.0.0.0
    for bad, why in ((ip.is_unspecified, "means every interface, which no other machine can call"),
                     (ip.is_loopback, "is this machine on every machine (loopback)"),
                     (ip.is_link_local, "is link-local (reached only on one link, and as a URL's host only with "
                                        "its interface)"),
                     (ip.is_multicast, "is a multicast address")):
        if bad:
            return why
    return None


def _in_url(host: str) -> str:
    """``host`` as a URL's host: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def addresses(host: str, prefect_port: int, mlflow_port: int | None, advertise: str | None = None
              ) -> dict[str, str]:
    """The services' URLs: ``local_api``, what this host's own processes call (loopback when bound to every
    interface); ``prefect_api``, ``prefect_ui`` and ``mlflow_ui``, the advertised ones other machines call and a
    browser opens."""
    public = _in_url(advertised(host, advertise))
    local = ("[::1]" if ":" in host else "127.0.0.1") if _every_interface(host) else _in_url(host)
    urls = {"local_api": f"http://{local}:{prefect_port}/api", "prefect_api": f"http://{public}:{prefect_port}/api",
            "prefect_ui": f"http://{public}:{prefect_port}"}
    if mlflow_port:
        urls["local_mlflow"] = f"http://{local}:{mlflow_port}"
        urls["mlflow_ui"] = f"http://{public}:{mlflow_port}"
    return urls


def service_envs(urls: dict[str, str]) -> dict[str, dict[str, str]]:
    """The environments `jagg services up` starts its processes with: ``server`` (the UI's pages call the API at
    PREFECT_UI_API_URL, the advertised one), ``client`` (the pool's creation, the deployments, the worker: this
    host's own address of the API; flow-run links and the reports' MLflow links at the advertised addresses)."""
    client = {**_env(urls["local_api"]), "PREFECT_UI_URL": urls["prefect_ui"]}
    if "mlflow_ui" in urls:
        client[MLFLOW_UI_ENV] = urls["mlflow_ui"]
    return {"server": {**_env(), "PREFECT_UI_API_URL": urls["prefect_api"], "PREFECT_UI_URL": urls["prefect_ui"]},
            "client": client}


def _env(api_url: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PREFECT_HOME": str(STATE / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "JAGG_ROOT": str(ROOT), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "DVC_NO_ANALYTICS": "1",
                "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)})
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def _api(api: str, path: str, body: dict | None, method: str = "POST") -> Any:
    """A call of the Prefect server's REST API; a 503 (its database busy, "retry") is retried as Prefect's client
    does."""
    import urllib.error

    for attempt in range(6):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{api}/{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            if e.code != 503 or attempt == 5:
                raise
            time.sleep(1 + attempt)
    raise AssertionError("unreachable")


def crash_automation(api: str, crash_after: float = CRASH_AFTER_S) -> None:
    """The server's automation that marks a flow run CRASHED when its heartbeats stop for ``crash_after`` seconds
    (created once; Prefect 3 leaves a run whose worker was killed RUNNING without it)."""
    if any(a.get("name") == AUTOMATION for a in _api(api, "automations/filter", {})):
        return
    _api(api, "automations/", {
        "name": AUTOMATION, "enabled": True,
        "description": f"No heartbeat from a flow run's process for {crash_after:.0f} s: its worker or host died.",
        "trigger": {"type": "event", "posture": "Proactive", "match": {"prefect.resource.id": "prefect.flow-run.*"},
                    "after": ["prefect.flow-run.heartbeat"], "expect": ["prefect.flow-run.heartbeat", *_FINAL_EVENTS],
                    "for_each": ["prefect.resource.id"], "threshold": 1, "within": crash_after},
        "actions": [{"type": "change-flow-run-state", "state": "CRASHED",
                     "message": f"no heartbeat for {crash_after:.0f} s: its worker or host died"}]})


def late_automations(api: str, pool: str, wait_s: float) -> list[str]:
    """For each work queue of ``pool`` but `units`, the server's automation that cancels a flow run left Late (its
    scheduled start passed, no worker took it) for ``wait_s`` more seconds, its state message naming the pool and
    the queue no worker serves: a sweep sent where no worker listens ends in one sentence instead of waiting for ever
    (Late is all `prefect deployment run --watch` showed). The `units` queue's runs are a sweep's, which waits for
    them itself (``resources.pool_wait_s``, flows/pool.py). ``wait_s`` 0: none (runs wait for ever). Made again at
    each `up`, so that a changed wait holds; returns the automations' names."""
    import urllib.parse

    made = []
    old = {a.get("name"): a.get("id") for a in _api(api, "automations/filter", {}) or []}
    queues = _api(api, f"work_pools/{urllib.parse.quote(pool)}/queues/filter", {}) or []
    taken = [f"prefect.flow-run.{s}" for s in ("Pending", "Running", "Cancelling")] + _FINAL_EVENTS  # no longer Late
    for queue in sorted(queues, key=lambda q: q["name"]):
        name = LATE_AUTOMATION.format(pool=pool, queue=queue["name"])
        if old.get(name):
            _api(api, f"automations/{old[name]}", None, method="DELETE")
        if queue["name"] == "units" or not wait_s:
            continue
        message = (f"no worker took this run in {wait_s:g} s after it was Late: no worker of pool {pool!r} serves "
                   f"its queue {queue['name']!r}. Start one (`jagg services worker --queue {queue['name']}`, "
                   f"docs/scaling.md), then run it again.")
        _api(api, "automations/", {
            "name": name, "enabled": True, "description": message,
            "trigger": {"type": "event", "posture": "Proactive", "match": {"prefect.resource.id": "prefect.flow-run.*"},
                        "match_related": {"prefect.resource.id": f"prefect.work-queue.{queue['id']}"},
                        "after": ["prefect.flow-run.Late"], "expect": taken, "for_each": ["prefect.resource.id"],
                        "threshold": 1, "within": max(wait_s, 10.0)},
            "actions": [{"type": "change-flow-run-state", "state": "CANCELLED", "message": message}]})
        made.append(name)
    return made


def _spawn(name: str, cmd: list[str], env: dict[str, str]) -> int:
    STATE.mkdir(parents=True, exist_ok=True)
    path = STATE / f"{name}.log"
    # Appended through storage's one appender: a link planted at the log is refused (its target was appended to).
    with open_append(path, ServiceError, fix=f"remove it (rm {path}), then start the services again") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc.pid


def _wait_http(url: str, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise ServiceError(f"{what} did not answer at {url} within {timeout:.0f} s; see {STATE}/*.log.")


def _registered(api: str, pool: str, name: str) -> dict[str, Any] | None:
    """The Prefect server's record of worker ``name`` of ``pool`` (its ``last_heartbeat_time``, its ``status``:
    ONLINE until three heartbeat intervals have passed without one); None if it never saw one."""
    import urllib.error
    import urllib.parse

    try:
        workers = _api(api, f"work_pools/{urllib.parse.quote(pool)}/workers/filter", {})
    except urllib.error.HTTPError as e:
        if e.code == 404:  # no such pool yet: a worker creates its pool as it starts
            return None
        raise
    return next((w for w in workers or [] if isinstance(w, dict) and w.get("name") == name), None)


def _heartbeat(api: str, pool: str, name: str) -> str | None:
    """The last heartbeat the Prefect server holds of worker ``name`` of ``pool``; None if it never saw one."""
    return (_registered(api, pool, name) or {}).get("last_heartbeat_time")


def _worker_name(name: str | None) -> str:
    """``--name`` held to the project's name rule (:mod:`jagg_core.setup.names`, single inner dots allowed: a host's
    name), before anything starts: the name becomes the worker's log file, ``.services/worker-<name>.log`` (``a/b``
    was an ``Errno 2``, 500 characters an ``OSError`` traceback). Without ``--name``, this host's name, lowercased."""
    given = name is not None
    name = name if given else socket.gethostname().lower()
    if is_name(name, dots=True):
        return name
    shown = repr(name) if len(name) <= 40 else f"{name[:40]!r}… ({len(name)} characters)"
    what = f"the worker name {shown}" if given else f"this host's name {shown}, the worker's default name,"
    raise ServiceError(f"{what} is not a name by the project's rule ({name_rule(dots=True)}): give --name one, "
                       f"such as gpu-1.")


def _wait_worker(api: str, pool: str, name: str, pid: int, log: str, before: str | None) -> None:
    """Return once the worker started as ``pid`` has reported to the server (a heartbeat newer than ``before``, the
    last one of a worker of that name before it started); one sentence if it exits or stays silent."""
    deadline = time.time() + WORKER_START_S
    while time.time() < deadline:
        if not _alive(pid):
            raise ServiceError(f"worker {name!r} of pool {pool!r} exited as it started; see {STATE / log}.")
        beat = _heartbeat(api, pool, name)
        if beat is not None and beat != before:
            return
        time.sleep(1)
    raise ServiceError(f"worker {name!r} did not report to the Prefect server at {api} within {WORKER_START_S:.0f} "
                       f"s; see {STATE / log}.")


def deployments(api: str) -> list[str]:
    """``<flow>/<deployment>`` of every deployment the server at ``api`` holds, sorted (read from its REST API)."""
    def post(path: str) -> list[dict]:
        req = urllib.request.Request(f"{api}/{path}/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    flows = {f["id"]: f["name"] for f in post("flows")}
    return sorted(f"{flows.get(d['flow_id'], '?')}/{d['name']}" for d in post("deployments"))


def _run(cmd: list[str], env: dict[str, str]) -> None:
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise ServiceError(f"{' '.join(cmd[:4])} failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")


def _started(pid: int) -> float | None:
    """When process ``pid`` started (psutil's create_time), None if there is no such process."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, OverflowError):
        return None


def _cmdline(pid: int) -> list[str] | None:
    """Process ``pid``'s command line as the system shows it (psutil), None if there is no such process or it cannot
    be read (a zombie, another user's). Read just after the spawn, it may still be empty for a few milliseconds (the
    kernel fills it in as the new program is loaded): it is read again, for at most a second."""
    import psutil

    for _ in range(50):
        try:
            cmd = psutil.Process(pid).cmdline()
        except (psutil.Error, ValueError, OverflowError):
            return None
        if cmd:
            return cmd
        time.sleep(0.02)
    return None


def _record(pid: int) -> dict[str, Any]:
    """What pids.json keeps of a service: its pid, its process's start time, which tells it from a process that took
    the pid over after a crash or a reboot, and its command line as it started (written right after the spawn),
    which tells it from a process whose pid and start time a pids.json names without having started it."""
    return {"pid": pid, "started": _started(pid), "cmd": _cmdline(pid)}


def _host_file() -> Path:
    """This host's record of the workers `jagg services worker` started here (.services/ may be on a filesystem that
    several hosts share; a pid means something on its own host only)."""
    return STATE / f"workers-{socket.gethostname()}.json"


def _pids(f: Path | None = None) -> dict[str, int]:
    """The services this project started that still run: a pid whose process started at another time (a stale
    pids.json; the pid now names a stranger) or a record without a start time is not ours and is left alone."""
    return {name: rec["pid"] for name, rec in _records(f).items() if _ours(rec)}


def _load(f: Path | None = None) -> dict[str, Any]:
    """pids.json (or a host's workers file) as written by :func:`_write_pids`; {} when absent or not JSON; one
    :class:`ServiceError` sentence when it is not a regular file of bounded size (a FIFO there hung `jagg services
    status`, `down` and `up`)."""
    f = f or STATE / "pids.json"
    if not f.exists():
        return {}
    try:
        data = parse_json(read_regular(f, ServiceError, limit=1 << 20, fix=f"remove it (rm {f}); it lists the "
                                       f"services jagg started, which `ps` shows too"), ValueError, str(f))
    except ValueError:  # not JSON, not finite, too deep: lists nothing
        return {}
    return data if isinstance(data, dict) else {}


def _records(f: Path | None = None) -> dict[str, dict[str, Any]]:
    return {str(k): v for k, v in _load(f).items()
            if isinstance(v, dict) and type(v.get("pid")) is int and v["pid"] > 0}


def _verdict(rec: dict[str, Any]) -> str:
    """``ours`` (the process pids.json names: its start time and its command line are the ones recorded), ``gone``
    (no such process), ``stale`` (the pid names a process started at another time, or the record has no start time)
    or ``foreign`` (pid and start time match, but its command line is not the one jagg started, or none was
    recorded: not ours to signal)."""
    started = _started(rec["pid"])
    if started is None:
        return "gone"
    if not (isinstance(rec.get("started"), (int, float)) and abs(started - rec["started"]) < 0.05):
        return "stale"
    cmd = rec.get("cmd")
    return "ours" if isinstance(cmd, list) and cmd and _cmdline(rec["pid"]) == cmd else "foreign"


def _ours(rec: dict[str, Any]) -> bool:
    return _verdict(rec) == "ours"


def _foreign_line(name: str, rec: dict[str, Any]) -> str:
    """One line for a record whose process runs another command line than the one recorded: not signalled."""
    def shown(cmd: Any) -> str:
        text = " ".join(map(str, cmd)) if isinstance(cmd, list) and cmd else "none recorded"
        return redact(text if len(text) <= 80 else f"{text[:80]}…")

    return (f"jagg: {name}: pid {rec['pid']} left alone: it runs `{shown(_cmdline(rec['pid']))}`, not the command "
            f"line jagg started ({shown(rec.get('cmd'))}); stop it yourself if it is a service")


def _alive(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # a child of this process (stopped after an interrupt): reaped
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _interruptible() -> None:
    """SIGTERM and SIGINT raise :class:`tasks.launch.Interrupted` (a KeyboardInterrupt with the signal's number) in
    the main thread, so what was started is stopped in ``except``/``finally`` and the entry point exits 128 + signal.
    (SIGTERM or Ctrl-C used to end `jagg services up` mid-start without stopping the server it had started; `jagg
    ui`, an ``exec`` of mlflow, exited 0 after SIGTERM.)"""
    def handler(signum: int, frame) -> None:  # noqa: ANN001
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one clean-up, bounded: a second signal does not cut it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _stop(pid: int) -> None:
    """Stop ``pid``'s process group, every process of it (SIGTERM; SIGKILL after 10 s)."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except OSError:
        return
    for _ in range(50):
        _alive(pid)  # reaps it if it is a child of this process
        try:
            os.killpg(pid, 0)  # anything of the group left?
        except OSError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def up(host: str, prefect_port: int, mlflow_port: int | None, pool: str, worker_name: str | None = None,
       crash_after: float = CRASH_AFTER_S, queues: list[str] | None = None, limit: int | None = None,
       advertise: str | None = None, late_after: float | None = None) -> dict[str, str]:
    """Start the server, create the pool, deploy prefect.yaml, start a worker (and the MLflow UI); interrupted
    (SIGTERM, Ctrl-C) or failing half-way, it stops what it started. Returns the advertised URLs."""
    if worker_name is not None:
        _worker_name(worker_name)
    urls = addresses(host, prefect_port, mlflow_port, advertise)  # a bad --advertise: one sentence, nothing started
    if any(_alive(p) for p in _pids().values()):
        raise ServiceError(f"services are already running ({_pids()}); `jagg services down` first.")
    try:
        return _up(host, prefect_port, mlflow_port, pool, worker_name, crash_after, queues, limit, urls, late_after)
    except BaseException:
        down()
        raise


def _worker_cmd(pool: str, name: str | None, queues: list[str] | None = None, limit: int | None = None) -> list[str]:
    """A process worker of ``pool``: every queue of it unless ``queues`` (`units`: a sweep's trainings and
    evaluations only), at most ``limit`` flow runs at a time (one training per GPU host, say)."""
    return [str(BIN / "prefect"), "worker", "start", "--pool", pool, *(["--name", name] if name else []),
            *[a for q in queues or [] for a in ("--work-queue", q)], *(["--limit", str(limit)] if limit else [])]


def worker(api: str, pool: str, name: str | None, queues: list[str] | None = None, limit: int | None = None) -> str:
    """Start one more worker of ``pool`` on this host, serving the server at ``api`` (`jagg services worker`: a
    host of a pool-dispatched sweep, docs/scaling.md); returns its name. A name that breaks the name rule, or that
    a live worker of the pool already has (another host's: two would become one Prefect worker sharing one log), is
    one sentence, and nothing is started."""
    name = _worker_name(name)
    _wait_http(f"{api}/health", 30, "the Prefect server")
    pids = _pids(_host_file())
    key = f"worker-{name}"
    if key in pids and _alive(pids[key]):
        raise ServiceError(f"worker {name!r} already runs here (pid {pids[key]}); give another --name.")
    other = _registered(api, pool, name)
    if other and other.get("status") == "ONLINE":
        every = other.get("heartbeat_interval_seconds") or 30
        raise ServiceError(f"a worker named {name!r} of pool {pool!r} is online at {api} (last heartbeat "
                           f"{other.get('last_heartbeat_time')}), on another host or started apart from `jagg "
                           f"services`: two workers of one name become one Prefect worker sharing one log, so give "
                           f"another --name (a worker that stopped is offline {3 * every} s after its last heartbeat).")
    before = (other or {}).get("last_heartbeat_time")
    pids[key] = _spawn(key, _worker_cmd(pool, name, queues, limit), {**_env(api), **_links()})
    _write_pids(pids, _host_file())
    _wait_worker(api, pool, name, pids[key], f"{key}.log", before)
    return name


def _links() -> dict[str, str]:
    """The advertised UIs `jagg services up` recorded in pids.json, for a worker started apart from it (the head's
    worker restarted as docs/scaling.md says): its flow-run links and its sweeps' reports' MLflow links (a restarted
    worker's reports linked to tracking.ui_url's 127.0.0.1:5000, neither the head nor --mlflow-port). {} when `up`
    recorded none."""
    urls = _load().get("urls")
    if not isinstance(urls, dict):
        return {}
    env = {"mlflow_ui": MLFLOW_UI_ENV, "prefect_ui": "PREFECT_UI_URL"}
    return {env[k]: v for k, v in urls.items() if k in env and isinstance(v, str) and v.startswith("http")}


def _up(host: str, prefect_port: int, mlflow_port: int | None, pool: str, worker_name: str | None,
        crash_after: float, queues: list[str] | None, limit: int | None, urls: dict[str, str],
        late_after: float | None = None) -> dict[str, str]:
    api, envs = urls["local_api"], service_envs(urls)
    env = envs["client"]
    # The UI's pages call the API at PREFECT_UI_API_URL: this server's port, at the address other machines reach.
    pids = {"server": _spawn("prefect-server", [str(BIN / "prefect"), "server", "start", "--host", host, "--port",
                                                 str(prefect_port)], envs["server"])}
    _write_pids(pids, urls=urls)
    _wait_http(f"{api}/health", 90, "the Prefect server")
    _run([str(BIN / "prefect"), "work-pool", "create", pool, "--type", "process", "--overwrite"], env)
    _run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all"], env)
    crash_automation(api, crash_after)
    late_automations(api, pool, load().resources.pool_wait_s if late_after is None else late_after)
    before = _heartbeat(api, pool, worker_name) if worker_name else None
    pids["worker"] = _spawn("prefect-worker", _worker_cmd(pool, worker_name, queues, limit), env)
    _write_pids(pids, urls=urls)
    if worker_name:  # (a worker Prefect names itself is checked by the deployment runs it takes)
        _wait_worker(api, pool, worker_name, pids["worker"], "prefect-worker.log", before)
    shown = {k: v for k, v in urls.items() if not k.startswith("local")}
    shown["deployments"] = ", ".join(deployments(api))
    if mlflow_port:
        store = resolve_uri(load().tracking.mlflow_uri, ROOT)
        pids["mlflow"] = _spawn("mlflow", [str(BIN / "mlflow"), "server", "--host", host, "--port", str(mlflow_port),
                                           "--backend-store-uri", store, "--workers", "1"], env)
        _write_pids(pids, urls=urls)
        _wait_http(f"{urls['local_mlflow']}/health", 120, "the MLflow server")  # a sweep logs to it at once
    _write_pids(pids, urls=urls)
    return shown


def _write_pids(pids: dict[str, int], f: Path | None = None, urls: dict[str, str] | None = None) -> None:
    records: dict[str, Any] = {k: _record(v) for k, v in pids.items()}
    records["host"] = socket.gethostname()  # a pid means something on its own host only (.services/ may be shared)
    if urls:  # the advertised UIs, for a worker started later (:func:`_links`)
        records["urls"] = {k: v for k, v in urls.items() if k in ("mlflow_ui", "prefect_ui")}
    atomic_write_text(f or STATE / "pids.json", json.dumps(records))


def _pids_host() -> str | None:
    """The host that wrote pids.json (None: no file, or one written before hosts were recorded)."""
    host = _load().get("host")
    return host if isinstance(host, str) else None


def _report_foreign(f: Path | None = None) -> None:
    for name, rec in _records(f).items():
        if _verdict(rec) == "foreign":
            print(_foreign_line(name, rec))


def down() -> None:
    """Stop this host's workers (`jagg services worker`'s too), then the MLflow UI and the server: only processes
    whose pid, start time and command line are the ones pids.json recorded; any other is left alone, in one line."""
    _report_foreign(_host_file())
    for pid in _pids(_host_file()).values():
        if _alive(pid):
            _stop(pid)
    _host_file().unlink(missing_ok=True)
    head = _pids_host()
    if head not in (None, socket.gethostname()):  # the services of another host (the head's): theirs to stop
        print(f"jagg: the Prefect and MLflow servers of this project run on {head}; `jagg services down` there "
              f"stops them")
        return
    _report_foreign()
    pids = _pids()
    for name in ("worker", "mlflow", "server"):  # the worker before its server
        pid = pids.get(name)
        if pid and _alive(pid):
            _stop(pid)
    (STATE / "pids.json").unlink(missing_ok=True)


def ui(host: str, port: int) -> int:
    """The MLflow UI in the foreground on the project's store, in a process group of its own that SIGTERM and
    Ctrl-C stop whole (mlflow's parent process and its server)."""
    store = resolve_uri(load().tracking.mlflow_uri, ROOT)
    proc = subprocess.Popen([str(BIN / "mlflow"), "server", "--host", host, "--port", str(port), "--backend-store-uri",
                             store, "--workers", "1"], env=_env(), start_new_session=True)
    try:
        return proc.wait()
    finally:
        _stop(proc.pid)
        proc.wait()


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg services", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["up", "down", "status", "ui", "worker"],
                    help="worker: start one more worker of the pool on this host (for a sweep with "
                         "resources.dispatch = pool; --api names the server)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only; 0.0.0.0: every "
                                                        "interface, for the workers of other hosts)")
    ap.add_argument("--advertise", default=None, metavar="HOST",
                    help="`up`: the host name or IP address other machines reach this one by, in the Prefect UI's "
                         "API address and the reports' MLflow links (default: --host, or this host's name when "
                         "--host is 0.0.0.0 or ::)")
    ap.add_argument("--prefect-port", type=int, default=4200)
    ap.add_argument("--mlflow-port", type=int, default=5000, help="0 = no MLflow UI")
    ap.add_argument("--pool", default="jagg", help="process work pool name (prefect.yaml uses 'jagg')")
    ap.add_argument("--name", default=None, help="the worker's name (default: Prefect's for `up`, the host name for "
                                                 "`worker`); each worker of a pool needs its own")
    ap.add_argument("--api", default=os.environ.get("PREFECT_API_URL"),
                    help="`worker`: the Prefect server's API, e.g. http://head:4200/api (default: $PREFECT_API_URL)")
    ap.add_argument("--queue", action="append", default=None, metavar="NAME",
                    help="a work queue the worker serves (repeatable; default: every queue of the pool). A sweep's "
                         "trainings and evaluations go to `units`, the sweeps themselves to `default`")
    ap.add_argument("--limit", type=int, default=None, help="flow runs the worker runs at a time (default: no limit)")
    ap.add_argument("--crash-after", type=float, default=CRASH_AFTER_S,
                    help=f"`up`: seconds without a heartbeat after which a flow run is marked CRASHED (default "
                         f"{CRASH_AFTER_S}; heartbeats every {HEARTBEAT_S} s)")
    ap.add_argument("--cancel-late-after", type=float, default=None, metavar="SECONDS",
                    help="`up`: seconds a flow run may stay Late (no worker of its queue took it) before it is "
                         "cancelled, saying which queue has no worker (default: resources.pool_wait_s; 0: never)")
    args = ap.parse_args(argv)
    _interruptible()
    if args.action == "worker":
        if not args.api:
            raise ServiceError("`jagg services worker` needs the server's API: --api http://<head host>:4200/api or "
                               "PREFECT_API_URL.")
        name = worker(args.api, args.pool, args.name, args.queue, args.limit)
        print(f"worker {name!r} serves pool {args.pool!r} of {args.api}")
        return 0
    if args.action == "up":
        if args.crash_after <= HEARTBEAT_S:
            raise ServiceError(f"--crash-after {args.crash_after:g} must exceed the heartbeat interval, {HEARTBEAT_S} s.")
        if args.cancel_late_after is not None and not 0 <= args.cancel_late_after <= 7 * 86400:
            raise ServiceError(f"--cancel-late-after {args.cancel_late_after:g} must be 0 (never) to 604800 s.")
        urls = up(args.host, args.prefect_port, args.mlflow_port or None, args.pool, args.name, args.crash_after,
                  args.queue, args.limit, args.advertise, args.cancel_late_after)
        print("\n".join(f"{k}: {v}" for k, v in urls.items()))
        print(f"run a sweep: PREFECT_API_URL={urls['prefect_api']} prefect deployment run 'jagg-reproduce/toy' --watch")
    elif args.action == "down":
        down()
    elif args.action == "status":
        for name, rec in {**_records(), **_records(_host_file())}.items():
            verdict = _verdict(rec)
            state = {"ours": "running" if _alive(rec["pid"]) else "stopped", "gone": "stopped",
                     "stale": "stopped (pids.json is stale: the pid now names another process)",
                     "foreign": "stopped (the pid names a process whose command line is not the one jagg started)",
                     }[verdict]
            print(f"{name}: pid {rec['pid']} {state}")
    else:  # ui: the MLflow UI in the foreground on the project's store
        return ui(args.host, args.mlflow_port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
