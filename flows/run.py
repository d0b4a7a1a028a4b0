"""`jagg run`: the reproduction flow end to end on one profile (Prefect in-process; no server needed).

With ``--set KEY=VALUE`` the flow run is a sweep point: its outputs go to folders of their own (see flows.reproduce).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

from jagg_core.setup.config import ParamsError
from tasks.common import ROOT, ServiceError, add_common_args, cli, free_port, layout, parse_overrides
from tasks.launch import die_with_parent, stop_on_signals

from .reproduce import flow_params, reproduce
from .secrets import withhold
from jagg_core.errors import UserError
from jagg_core.pipeline.report_pages import said


@contextlib.contextmanager
def temporary_server() -> Iterator[None]:
    """A Prefect API server of this process's own while the flow runs, unless ``PREFECT_API_URL`` names one.

    It is the server Prefect would start on its own (the same uvicorn app, UI off), except that it dies with this
    process: it gets SIGTERM from the kernel when ``jagg run`` is killed outright (PR_SET_PDEATHSIG, as the trainers
    do, see tasks/launch.py), and is stopped here when the flow ends, fails or is interrupted. Prefect's own temporary
    server outlived a SIGKILLed or SIGTERMed `jagg run`, still listening."""
    import prefect
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    if PREFECT_API_URL.value():
        yield
        return
    port = free_port()
    env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
           "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
           "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port), "--log-level", "error",
           "--lifespan", "on"]
    server = subprocess.Popen(cmd, env=env, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    try:
        _wait_healthy(server, f"http://127.0.0.1:{port}/api")
        with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}):
            yield
    finally:
        _drain_logs()
        server.terminate()
        try:  # uvicorn waits for open connections (Prefect's event websocket) before it stops: not for long
            server.wait(timeout=3)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _exit_now(status: int) -> None:
    """After an interrupt, once the trainers and the server are stopped: exit without Prefect's exit handlers, which
    would try to reach the stopped server for ~10 s (Ctrl-C must be quick)."""
    print("jagg: interrupted", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _in_a_thread(flow, **kwargs) -> None:  # noqa: ANN001
    """Run ``flow`` in a thread of its own and wait for it in the main thread, where signals arrive.

    In the main thread Prefect's engine would take SIGTERM for itself and wait for the running tasks (a whole training
    run) before it ends; here :func:`tasks.launch.stop_on_signals` gets it, stops every trainer at once, the tasks end
    with :class:`tasks.launch.Interrupted`, the flow run is recorded as crashed, and the caller stops the server."""
    outcome: dict[str, BaseException] = {}
    done = threading.Event()  # not Thread.join: an interrupted join can mark a running thread as ended (Python 3.11)

    context = contextvars.copy_context()  # Prefect's settings (the temporary server's URL) live in context variables

    def target() -> None:
        try:
            context.run(flow, **kwargs)
        except BaseException as e:  # noqa: BLE001  (handed to the main thread)
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name="jagg-flow", daemon=True).start()
    try:
        while not done.wait(0.2):
            pass
    except KeyboardInterrupt:
        done.wait(timeout=8)  # its trainers are stopped: the flow ends within seconds, its state recorded
        raise
    if "error" in outcome:
        raise outcome["error"]


def _drain_logs() -> None:
    """Send the flow's last log lines to the server before it stops (else: "Error logging to API" at exit)."""
    try:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)
        EventsWorker.drain_all(timeout=5)
    except Exception:  # noqa: BLE001  (nothing was logged, or the server is gone already)
        pass


def _wait_healthy(server: subprocess.Popen, api: str, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ServiceError(f"the temporary Prefect server exited with status {server.returncode} at start; "
                               f"run `prefect server start` to see why.")
        try:
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise ServiceError(f"the temporary Prefect server did not answer within {timeout:.0f} s; is the machine busy?")


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg run", description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--parallel-runs", type=int, default=1, help="training runs at a time (GPU partitions)")
    ap.add_argument("--restart", action="store_true",
                    help="runs whose checkpoints were written with other params start over (moved aside); MLflow "
                         "runs left RUNNING by an owner this machine cannot check (another host's) are taken over")
    args = ap.parse_args(argv)
    if args.parallel_runs < 1:
        raise ParamsError(f"--parallel-runs {args.parallel_runs} must be at least 1.")
    overrides = parse_overrides(args.overrides) or None
    params = flow_params(args.profile, args.params, overrides)  # bad params fail here, before Prefect starts
    if params.resources.dispatch == "pool":  # its units go to the pool's workers, which a temporary server has none of
        raise ParamsError("resources.dispatch = pool sends the trainings to the work pool's workers, which `jagg run`'s "
                          "temporary server has none of: start the services (`jagg services up`, a worker per host: "
                          f"docs/scaling.md) and run `prefect deployment run 'jagg-reproduce/{params.profile}'`.")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    t0 = time.perf_counter()
    stop_on_signals()  # SIGTERM / Ctrl-C: the trainers' groups stop at once, then the temporary server
    try:
        with temporary_server():
            # Prefect stores a flow run's parameters: its secrets go redacted, the flow puts them back in-process.
            _in_a_thread(reproduce, profile=params.profile, parallel_runs=args.parallel_runs,
                         overrides=withhold(overrides),
                         params_file=args.params, sweep=f"run-{time.strftime('%Y%m%d-%H%M%S')}",
                         restart=args.restart)
    except KeyboardInterrupt as e:
        _exit_now(128 + getattr(e, "signum", signal.SIGINT))
    lay = layout(params)
    print(f"\njagg: profile {params.profile} done in {time.perf_counter() - t0:.0f} s; report: "
          f"{(lay.report_dir / 'index.html').relative_to(ROOT)} (MLflow UI: `jagg ui`)")
    print(_speed_line(params, lay))
    return 0


def _speed_line(params, lay) -> str:  # noqa: ANN001  (Params, Layout)
    """The side-by-side update speedups of the run's methods (the `speed` stage), one line: the measurement the
    report shows, taken at these params' settings (`jagg_core.pipeline.report.read_side_by_side`, which reads it
    bounded and regular: a FIFO there hung `jagg run` after "done"), or why none."""
    # the report module loads torch; flows stay import-light (docs/architecture.md)
    from jagg_core.pipeline.report import read_side_by_side

    try:
        side, why = read_side_by_side(params, lay)
    except UserError as e:
        return f"jagg: no side-by-side speed measurement ({e})"
    if side is None:
        return f"jagg: no side-by-side speed measurement ({why or 'resources.speed_rounds 0'})"
    table = [r for r in side["table"] if r.get("method") in params.run.methods]
    parts = [f"{r['method']} {said(r.get('speedup'), 2, 'x')}" + (
                 " (above the cost model's ideal: not a gain)" if r.get("above_ideal") else
                 f" (ideal {said(r.get('ideal'), 2, 'x')})")
             for r in table if "speedup" in r and r.get("mode") != "exact"]
    if parts:
        return "jagg: update speedup vs the exact baseline, every method timed side by side: " + ", ".join(parts)
    seconds = ", ".join(f"{r['method']} {said(r.get('update_s'), 3, ' s')}" for r in table if "update_s" in r)
    if any(r.get("mode") == "exact" for r in table):
        return f"jagg: only the exact baseline's update was timed ({seconds}); no other method to compare with it"
    return ("jagg: no update speedup to show: the sweep has no exact baseline (a method of mode exact) to compare "
            f"with; update seconds, timed side by side: {seconds or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
