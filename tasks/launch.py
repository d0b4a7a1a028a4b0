"""Starting worker processes (`accelerate launch`) for a stage and relaying their output: the training and the
evaluation stages share it. A training run's workers also need this machine's place in the run (:class:`Machine`)
and their command line (:func:`accelerate_command`, :func:`worker_threads`), at the end.

The launcher hands its validated params to the workers in a context file only its owner can read (params may hold
credentials; nothing shows on a command line). The workers run in a process group of their own that ends with the
launcher.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from jagg_core.errors import UserError
from jagg_core.setup.config import Params, ParamsError
from jagg_core.setup.paths import Layout
from jagg_core.setup.json_read import read_json
from jagg_core.setup.storage import atomic_write_text

__all__ = ["Interrupted", "clear_outcomes", "die_with_parent", "error_class", "launch", "outcome_file", "read_outcome",
           "user_error_class", "stop_on_signals", "local_context", "read_context",
           "remove_stale_contexts", "report_error_class", "user_error", "write_context", "worker_error"]


def write_context(path: Path, params: Params, lay: Layout, mlflow_run: str, key: str, restart: bool = False) -> None:
    """What the workers need from the launcher, in a file only its owner can read (params may hold credentials)."""
    # the project's one writing function: a link planted at `path` (a shared /tmp) is replaced, never written through
    atomic_write_text(path, json.dumps({"params": params.model_dump_json(), "root": str(lay.root),
                                        "mlflow_run": mlflow_run, "run_key": key, "restart": restart}), mode=0o600)


def die_with_parent(sig: int) -> None:
    """Linux: deliver ``sig`` to this process when its parent dies (prctl PR_SET_PDEATHSIG); elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _own_group_dying_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    die_with_parent(signal.SIGKILL)


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop the workers' whole process group (SIGTERM, then SIGKILL after 30 s) if anything of it still runs."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            os.killpg(proc.pid, 0)  # the launcher ended; do its workers still run?
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT reached a launcher: its worker groups are stopped, and every launch of this process ends with
    this (not with a "died worker", which Prefect would retry). A KeyboardInterrupt, so what cleans up after Ctrl-C
    cleans up after SIGTERM too."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


_live: set[subprocess.Popen] = set()  # the worker groups this process runs now (launches may run in threads)
_stopping: list[int] = []  # the signal that stops this process, once one came


def _signal_all(sig: int) -> None:
    for proc in list(_live):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def stop_on_signals() -> None:
    """In a launcher's main thread: SIGTERM and SIGINT stop every worker group it started (in any thread) and raise
    :class:`Interrupted` here, so ``finally`` blocks remove context files and close MLflow runs. A second signal
    during that clean-up is ignored: the clean-up is bounded (:func:`_stop_group`)."""

    def handler(signum: int, frame) -> None:  # noqa: ANN001
        if _stopping:
            return
        _stopping.append(signum)
        _signal_all(signal.SIGTERM)
        raise Interrupted(signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def read_context(path: str) -> tuple[Params, Layout, dict]:
    """A worker's side of :func:`write_context`: the launcher's params, the project layout and the rest."""
    ctx = read_json(path, UserError, limit=64 << 20)
    params = Params.model_validate_json(ctx["params"])
    return params, Layout.of(params, Path(ctx["root"])), ctx


def launch(cmd: list[str], lay: Layout, env: dict, run: str, log) -> tuple[int, deque]:  # noqa: ANN001
    """Run ``cmd`` (an ``accelerate launch``, or the one worker it would start: :func:`without_launcher`), relaying
    its output line by line to ``log`` as ``[run] line``; returns its exit status and last 30 lines.

    The workers run in a process group of their own that ends with this launcher: when the launcher stops (an error,
    an interrupt, a cancelled flow) the group is stopped here; when it is killed outright, the kernel stops its child
    (and that child's workers, which call :func:`die_with_parent`)."""
    tail: deque[str] = deque(maxlen=30)
    if _stopping:
        raise Interrupted(_stopping[0])
    with subprocess.Popen(cmd, cwd=lay.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1, preexec_fn=_own_group_dying_with_parent) as proc:
        _live.add(proc)
        try:
            held: list[str] = []  # a traceback being read: relayed once its last line says whose it is
            for line in proc.stdout:  # type: ignore[union-attr]
                line = line.rstrip()
                tail.append(line)
                if held or line.startswith("Traceback (most recent call last):"):
                    held.append(line)
                    if len(held) == 1 or line.startswith((" ", "\t")):
                        continue
                    if not _launchers_traceback(held):  # a worker's own traceback is shown; accelerate's is not
                        _relay(log, run, held)
                    held = []
                    continue
                _relay(log, run, [line])
            _relay(log, run, held)
            rc = proc.wait()
        finally:
            _stop_group(proc)
            _live.discard(proc)
    if _stopping:  # stopped by a signal to this launcher, not a death of its own
        raise Interrupted(_stopping[0])
    return rc, tail


def _relay(log, run: str, lines: list[str]) -> None:  # noqa: ANN001
    for line in lines:
        if line and "\r" not in line and not line.startswith(_ERROR_CLASS):  # the class line is for the launcher
            log.info("[%s] %s", run, line)


def _launchers_traceback(lines: list[str]) -> bool:
    """Whether a traceback is `accelerate launch` saying that its worker exited non-zero (a CalledProcessError
    raised in accelerate's code): the worker said why already (its one sentence), and the launcher says it again."""
    return lines[-1].startswith("subprocess.CalledProcessError:") and any("accelerate" in ln for ln in lines)


def user_error(tail: deque) -> str | None:
    """The workers' own error sentence (``jagg: error: ...``) among their last lines, if they stopped with one."""
    errors = [ln for ln in tail if ln.startswith("jagg: error:")]
    return errors[-1].removeprefix("jagg: error: ") if errors else None


_ERROR_CLASS = "jagg: error class: "
_MAX_OUTCOME = 64 * 1024  # an outcome is a class name and one sentence


def outcome_file(context: str | os.PathLike, pid: int | None = None) -> Path:
    """Where a worker started with ``context`` writes its outcome (one file per worker process)."""
    return Path(f"{context}.outcome-{os.getpid() if pid is None else pid}")


def _write_outcome(context: str | os.PathLike | None, kind: str, cls: str, message: str) -> None:
    """A worker's error, as a file beside its context that its launcher reads after the exit: a channel that no
    amount of output (a long traceback, accelerate's own lines) can scroll away."""
    if context is None:
        return
    try:  # a link planted at the outcome's path is replaced, never written through (it was opened O_TRUNC through it)
        atomic_write_text(outcome_file(context), json.dumps({"kind": kind, "class": cls, "message": message[:4000]}),
                          mode=0o600)
    except OSError:  # a full or read-only disk: the launcher falls back to the worker's last lines
        pass


class _NoOutcome(Exception):
    """An outcome file that cannot be read (a FIFO, a folder, too large): no outcome, as a death leaves none."""


def clear_outcomes(context: str | os.PathLike) -> None:
    """Remove what workers of an earlier launch with this context wrote."""
    import glob

    for p in Path(context).parent.glob(glob.escape(Path(context).name) + ".outcome-*"):
        with contextlib.suppress(OSError):
            p.unlink(missing_ok=True)


def read_outcome(context: str | os.PathLike | None) -> dict | None:
    """The workers' outcome after their exit (their files removed): a user error of the run's own (``kind``
    "user", its ``class`` as ``module:Class`` and its sentence) before a Python error (``kind`` "worker"), or None when
    no worker wrote one (a death: killed, out of memory, a crash)."""
    import glob

    if context is None:
        return None
    found = []
    for p in sorted(Path(context).parent.glob(glob.escape(Path(context).name) + ".outcome-*")):
        try:  # bounded and regular: a FIFO planted there blocked the launcher for good after the last iteration
            record = read_json(p, _NoOutcome, limit=_MAX_OUTCOME)
        except _NoOutcome:
            record = None
        finally:
            with contextlib.suppress(OSError):  # a folder planted there is no outcome either
                p.unlink(missing_ok=True)
        if isinstance(record, dict) and record.get("kind") in ("user", "worker") and \
                all(isinstance(record.get(k), str) for k in ("class", "message")):
            found.append(record)
    found.sort(key=lambda r: r["kind"] != "user")
    return found[0] if found else None


@contextlib.contextmanager
def report_error_class(context: str | os.PathLike | None = None) -> Iterator[None]:
    """In a worker: an error of its own (a :class:`~jagg_core.errors.UserError`) names its class on stderr, just
    before the entry point prints its sentence; any other exception is printed as ``jagg: worker error: Class:
    message``. Given the worker's ``context``, both also go to the worker's outcome file (:func:`read_outcome`), which
    the launcher reads whatever the worker printed after them."""
    try:
        yield
    except UserError as e:
        name = f"{type(e).__module__}:{type(e).__qualname__}"
        print(f"{_ERROR_CLASS}{name}", file=sys.stderr, flush=True)
        _write_outcome(context, "user", name, str(e))
        raise
    except Exception as e:  # noqa: BLE001  (any other error of its own: the same input fails the same way again)
        text = " ".join(str(e).split())[:300]
        print(f"{_WORKER_ERROR}{type(e).__name__}: {text}", file=sys.stderr, flush=True)
        _write_outcome(context, "worker", type(e).__name__, text)
        raise


_WORKER_ERROR = "jagg: worker error: "


def worker_error(tail: deque) -> str | None:
    """A worker's own Python error (an exception it raised, not a death by a signal or the OOM killer), as
    ``Class: message``, if it stopped with one (:func:`report_error_class` prints it)."""
    errors = [ln for ln in tail if ln.startswith(_WORKER_ERROR)]
    return errors[-1].removeprefix(_WORKER_ERROR) if errors else None


# How a worker's death reaches the launcher's last lines: accelerate's own traceback ends with the CalledProcessError
# of its one worker (the whole command line, the context file's path among it); torchrun's report (several processes)
# names each failed rank's exit code and signal.
_DIED_BY = re.compile(r"died with <Signals\.(SIG[A-Z0-9]+): (\d+)>|Signal (\d+) \((SIG[A-Z0-9]+)\) received by PID")
_EXITED = re.compile(r"returned non-zero exit status (\d+)|exitcode\s*:\s*(\d+)\b")
_SIGNAL_CAUSE = {"SIGKILL": "out of memory, or a kill -9 from outside", "SIGTERM": "stopped from outside",
                 "SIGSEGV": "a crash", "SIGBUS": "a crash", "SIGABRT": "an abort"}


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _killed(name: str, num: int | str) -> str:
    cause = _SIGNAL_CAUSE.get(name)
    return f"its worker was killed by {name} (signal {num}{': ' + cause if cause else ''})"


def death(rc: int, tail: deque, direct: bool = False) -> str:
    """How the workers ended, without an error of their own, as the end of one plain sentence: the signal that killed
    one or the exit status it gave, read off accelerate's ``CalledProcessError`` (or torchrun's report) rather than
    relaying that line, which is the worker's whole command. ``direct``: ``rc`` is the worker's own exit status (it
    was started without a launcher: :func:`without_launcher`)."""
    if direct:
        if rc < 0:
            return _killed(_signal_name(-rc), -rc)
        return f"its worker exited with status {rc} without an error of its own"
    for line in reversed(tail):
        m = _DIED_BY.search(line)
        if m:
            name, num = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            return _killed(name, num)
        m = _EXITED.search(line)
        if m:
            return f"its worker exited with status {m.group(1) or m.group(2)} without an error of its own"
    if rc < 0:
        return f"its launcher (accelerate) was killed by {_signal_name(-rc)}"
    return f"its launcher (accelerate) exited with status {rc} without saying why"


def user_error_class(name: str, default: type[UserError]) -> type[UserError]:
    """The project's own user-error class ``module:Class`` (looked up by name, never anything else: the name comes
    from a worker), else ``default``."""
    module, _, cls_name = name.partition(":")
    if module.split(".")[0] not in ("jagg_core", "tasks") or not cls_name.isidentifier():
        return default
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError):
        return default
    return cls if isinstance(cls, type) and issubclass(cls, UserError) else default


def error_class(tail: deque, default: type[UserError]) -> type[UserError]:
    """The user-error class a worker named among its last lines (:func:`user_error_class`), else ``default``."""
    names = [ln.removeprefix(_ERROR_CLASS) for ln in tail if ln.startswith(_ERROR_CLASS)]
    return user_error_class(names[-1], default) if names else default


def remove_stale_contexts(folder: Path, pattern: str) -> None:
    """Context files ``pattern`` (named ``...-<pid>.json``) of launchers that no longer run on this machine (killed
    before they could remove theirs)."""
    for p in folder.glob(pattern):
        pid = p.stem.rsplit("-", 1)[-1]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            p.unlink(missing_ok=True)
        except PermissionError:
            pass


def local_context(label: str) -> Path:
    """Where a launcher's context goes on this machine's own temporary folder (``jagg-context-<label>-<pid>.json``),
    after removing those of launchers no longer running here."""
    tmp = Path(tempfile.gettempdir())
    remove_stale_contexts(tmp, "jagg-context-*.json")
    return tmp / f"jagg-context-{label}-{os.getpid()}.json"


# --- where and how a training run's workers start (`jagg train`) ---------------------------------------------


@dataclass(frozen=True)
class Machine:
    """This machine's place in a run that spans ``resources.num_machines`` machines.

    It differs per machine, so it never comes from the shared params.yaml: ``--machine-rank`` / ``--main-process-ip``
    / ``--main-process-port`` on the command line, else ``JAGG_MACHINE_RANK`` / ``JAGG_MAIN_PROCESS_IP`` /
    ``JAGG_MAIN_PROCESS_PORT``. Rank 0 runs the pipeline (MLflow, evaluation, report); every other rank runs only its
    share of each training run.
    """

    rank: int = 0
    address: str | None = None  # the rank-0 machine's address, the same on every machine
    port: int | None = None  # rendezvous port; None: resources.main_process_port + the method's index

    @classmethod
    def resolve(cls, params: Params, rank: int | None = None, address: str | None = None, port: int | None = None,
                environ: dict | None = None) -> "Machine":
        env = os.environ if environ is None else environ

        def number(value, flag: str, var: str) -> int | None:
            if value is not None:
                return value
            if not env.get(var):
                return None
            try:
                return int(env[var])
            except ValueError:
                raise ParamsError(f"{var}={env[var]!r} must be a whole number (or pass {flag}).") from None

        rank = number(rank, "--machine-rank", "JAGG_MACHINE_RANK") or 0
        port = number(port, "--main-process-port", "JAGG_MAIN_PROCESS_PORT")
        address = address or env.get("JAGG_MAIN_PROCESS_IP") or None
        n = params.resources.num_machines
        if not 0 <= rank < n:
            raise ParamsError(f"machine rank {rank} must be in 0..{n - 1} (resources.num_machines is {n}).")
        if port is not None and not 1024 <= port <= 65535:
            raise ParamsError(f"the rendezvous port {port} must be in 1024..65535.")
        return cls(rank, address, port)

    def check_address(self, params: Params) -> None:
        """Before a launch: a run over several machines needs the rank-0 machine's address (one sentence if not)."""
        n = params.resources.num_machines
        if n > 1 and not self.address:
            raise ParamsError(f"resources.num_machines is {n}: give every machine the rank-0 machine's address with "
                              f"--main-process-ip or JAGG_MAIN_PROCESS_IP.")


def accelerate_command(params: Params, method: str, worker_args: list[str], machine: Machine | None = None) -> list[str]:
    """``accelerate launch`` with the profile's processes, this machine's rank and a port of the method's own."""
    res = params.resources
    machine = machine or Machine()
    index = list(params.methods).index(method)
    port = machine.port if machine.port is not None else res.main_process_port + index
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if res.accelerate_config:
        cmd += ["--config_file", res.accelerate_config]
    cmd += ["--num_processes", str(res.num_processes * res.num_machines), "--num_machines", str(res.num_machines),
            "--machine_rank", str(machine.rank), "--main_process_port", str(port),
            "--mixed_precision", res.mixed_precision, "--dynamo_backend", "no",
            "--num_cpu_threads_per_process", str(worker_threads(params))]
    if res.num_processes * res.num_machines > 1 and not res.accelerate_config:
        cmd += ["--multi_gpu"]  # also the multi-process switch on CPU (gloo), with Accelerator(cpu=True)
    if machine.address:
        cmd += ["--main_process_ip", machine.address]
    return cmd + ["-m", "tasks.train", "--worker", *worker_args]


def without_launcher(cmd: list[str], env: dict) -> tuple[list[str], dict] | None:
    """The one worker's own command and environment where the ``accelerate launch`` command ``cmd`` (of
    :func:`accelerate_command`) would start one process with accelerate's simple launcher (one process on one machine,
    no DeepSpeed, FSDP, Megatron or TPU from the flags or accelerate's default config): what that launcher would run,
    read off accelerate's own parser and ``prepare_simple_launcher_cmd_env``, on ``env`` plus the variables accelerate
    adds (``ACCELERATE_*``, ``OMP_NUM_THREADS``, ...). Starting it directly saves the launcher's process, whose start
    (torch and accelerate imported to run one child) cost a training run ~1 s of CPU and of wall on an Intel Xeon
    (3.4 s on an AMD EPYC). None: launch ``cmd``."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import ComputeEnvironment
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    try:
        args = launch_command_parser().parse_args(cmd[3:])  # after [python, -m, accelerate.commands.launch]
        args, defaults, _ = _validate_launch_command(args)
        launcher = (args.use_deepspeed, args.use_fsdp, args.use_megatron_lm, args.multi_gpu, args.tpu,
                    defaults is not None and defaults.compute_environment == ComputeEnvironment.AMAZON_SAGEMAKER)
        if any(launcher) or args.num_processes != 1 or args.num_machines != 1 or args.mpirun_hostfile is not None:
            return None
        worker_cmd, launcher_env = prepare_simple_launcher_cmd_env(args)  # os.environ's copy, plus its own
    except (Exception, SystemExit):  # noqa: BLE001  (whatever accelerate refuses: a broken config file, ...)
        return None  # `accelerate launch` then says it, in its own words, as it did before
    added = {k: v for k, v in launcher_env.items() if os.environ.get(k) != v}
    return worker_cmd, {**env, **added}


def worker_threads(params: Params, environ: dict | None = None) -> int:
    """The torch CPU threads of each worker: ``resources.num_threads``, else ``OMP_NUM_THREADS``, else torch's own
    default (what a process of its own gets: its physical cores) shared by this machine's processes.

    The number a worker trains with changes float reductions, hence the weights' last bits: without it `accelerate
    launch` sets ``OMP_NUM_THREADS=1``, so a run trained by `jagg train` / `jagg run` differed (~6e-8) from the same
    run trained by `jagg train --worker` in a process of its own, and a resume could only be compared to a run of
    the same launcher. With it, both paths train with the same threads and the same bits.
    """
    env = os.environ if environ is None else environ
    if params.resources.num_threads:
        return params.resources.num_threads
    given = env.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    import torch  # this process never sets its thread count: torch's default

    return max(1, torch.get_num_threads() // params.resources.num_processes)
