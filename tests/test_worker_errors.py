"""A worker's own errors across the process boundary (its outcome file, its one sentence, its own class, never
retried), a death's sentence (retried), and the prompts that used to cause errors, refused up front."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from conftest import REPO, run_module
from fault_helpers import _one_sentence
from jagg_core.setup.params_io import load_params
from jagg_core.setup.paths import Layout
from jagg_core.setup.storage import PromptFileError
from jagg_core.trainer import CheckpointError, TrainingError

PARAMS = REPO / "params.yaml"
BAD_PROMPTS = [("", "is an empty prompt"), ("a " * 5000, r"is not a prompt of the toy world's grammar"),
               ("\ud800 red circle", "holds a lone surrogate")]


def _write_prompts(lay: Layout, bad: str) -> None:
    good = lay.train_prompts.read_text().splitlines()[:3]
    lay.train_prompts.write_text("\n".join([*good, json.dumps({"prompt": bad})]) + "\n")


@pytest.mark.parametrize("bad,fragment", BAD_PROMPTS, ids=["empty", "10k-characters", "lone-surrogate"])
def test_prompts_a_worker_cannot_take_are_one_sentence_before_any_worker_starts(ci_project, bad, fragment):
    """``""``, 10,000 characters, a lone surrogate (JSON's ``"\\ud800"``) in the training prompt file: the launcher
    refuses it with one sentence naming the file and the line (they used to reach the workers: a traceback in each,
    "exit status 1", retried by Prefect)."""
    from tasks.train import check_train_prompts

    params = load_params(ci_project / "params.yaml", "ci")
    lay = Layout.of(params, ci_project)
    _write_prompts(lay, bad)
    with pytest.raises(PromptFileError, match=fragment) as e:
        check_train_prompts(params, lay)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300 and str(lay.train_prompts) in str(e.value)


def test_a_real_launcher_refuses_a_bad_prompt_file_and_writes_nothing(ci_project):
    lay = Layout.of(load_params(ci_project / "params.yaml", "ci"), ci_project)
    _write_prompts(lay, "")
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", root=ci_project)
    assert out.returncode == 1 and "is an empty prompt" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (ci_project / "checkpoints").exists() and not (ci_project / "runs").exists()


def test_a_workers_own_error_reaches_its_launcher_as_its_own_class_and_is_not_retried(ci_project):
    """A real `accelerate launch` of a worker that meets a prompt file it cannot use (edited after the launcher
    looked: the worker reads it itself): the launcher raises the worker's PromptFileError with its sentence — not a
    TrainingError "exit status 1; last output: …", and not a WorkerDied, the one error Prefect retries."""
    from jagg_core.trainer.fingerprint import run_fingerprint
    from tasks.launch import error_class, write_context
    from tasks.launch import Machine
    from tasks.train import WorkerDied, _launch_workers, _retryable

    params = load_params(ci_project / "params.yaml", "ci")
    lay = Layout.of(params, ci_project)
    context = lay.run_dir("jagg-s0") / ".worker-context-test.json"
    write_context(context, params, lay, "", run_fingerprint(params, lay, "jagg", 0))
    _write_prompts(lay, "")
    with pytest.raises(PromptFileError, match=r"training run jagg-s0 failed: .*train.jsonl:4 is an empty prompt") as e:
        _launch_workers(params, lay, "jagg", 0, Machine(), context, logging.getLogger("test"))
    assert not isinstance(e.value, WorkerDied) and "exit status" not in str(e.value)

    class State:  # what Prefect's retry condition sees
        def result(self, raise_on_failure=True):
            raise e.value

    assert not _retryable(None, None, State())
    # Only the project's own user errors are looked up by name; anything else a worker prints is not.
    from collections import deque

    from jagg_core.trainer import TrainingError

    for line in ["os:system", "builtins:SystemExit", "jagg_core.setup.storage:Path", "tasks.train:nope"]:
        assert error_class(deque([f"jagg: error class: {line}"]), TrainingError) is TrainingError


_PROBE = "import json, os, sys\nprint(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}))\n"


def test_one_process_starts_as_accelerate_would_start_it_without_its_launcher(tmp_path, monkeypatch):
    """A one-process training starts its worker directly (:func:`tasks.launch.without_launcher`), saving the
    `accelerate launch` process in between: the worker gets the command line and the environment (ACCELERATE_*,
    OMP_NUM_THREADS, ...) that a real `accelerate launch` gives it, to the last variable; several processes or
    machines still go through `accelerate launch`; a direct worker's death is worded from its own exit status."""
    from collections import deque

    from tasks.launch import Machine, accelerate_command, without_launcher
    from tasks.train import WorkerDied, _failure

    (tmp_path / "jagg_probe.py").write_text(_PROBE)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # accelerate's variable must come from the command
    params = load_params(PARAMS, "ci")
    cmd = accelerate_command(params, "jagg", ["--seed", "3"])
    cmd[cmd.index("tasks.train"):] = ["jagg_probe", "--seed", "3"]
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{REPO}", PYTHONUNBUFFERED="1")

    def seen(command: list[str], environ: dict) -> dict:
        out = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])

    direct = without_launcher(cmd, env)
    assert direct is not None and "accelerate" not in " ".join(direct[0])
    launched, started = seen(cmd, env), seen(*direct)
    assert started["argv"] == launched["argv"] == ["--seed", "3"]
    threads = cmd[cmd.index("--num_cpu_threads_per_process") + 1]
    assert started["env"] == launched["env"] and launched["env"]["OMP_NUM_THREADS"] == threads, \
        {k for k in started["env"].keys() | launched["env"].keys() if started["env"].get(k) != launched["env"].get(k)}
    two = load_params(PARAMS, "ci", {"resources.num_processes": 2})
    assert without_launcher(accelerate_command(two, "jagg", []), env) is None
    nodes = load_params(PARAMS, "ci", {"resources.num_machines": 2})
    assert without_launcher(accelerate_command(nodes, "jagg", [], Machine(0, "10.0.0.1")), env) is None
    broken = tmp_path / "broken.yaml"  # what accelerate refuses is refused by `accelerate launch`, as before
    broken.write_text("compute_environment: [\n")
    assert without_launcher([*cmd[:3], "--config_file", str(broken), *cmd[3:]], env) is None
    killed = _failure("jagg-s0", -9, deque(["iteration 2"]), direct=True)
    assert isinstance(killed, WorkerDied) and "its worker was killed by SIGKILL (signal 9: out of memory" in str(killed)
    assert "its worker exited with status 3 without an error of its own" in str(_failure("jagg-s0", 3, deque(),
                                                                                           direct=True))


# --- a worker's outcome across the process boundary: its own error, or a death -------------------------------------


def test_a_workers_own_errors_are_user_error_sentences_that_are_not_retried(tmp_path):
    """What a worker finds — a garbage ``curve.tsv`` row, a garbage ``state.json`` (its manifest rewritten to match,
    so it verifies) — is a user error with a sentence naming the file, which the worker prints as ``jagg: error:``
    and its launcher raises as a TrainingError, not a WorkerDied that Prefect retries (they were tracebacks: "exit
    status 1; last output: CalledProcessError…", retried twice)."""
    from collections import deque

    from jagg_core.trainer.checkpoint import Checkpoint
    from jagg_core.trainer.curve import TsvCurve
    from tasks.train import WorkerDied, _failure, _retryable

    curve = tmp_path / "curve.tsv"
    curve.write_text("iteration\treward/mean\n1\t0.5\ngarbage\tnot-a-number\n")
    with pytest.raises(TrainingError, match=r"curve.tsv line 3 is not a row of numbers; fix or delete"):
        TsvCurve(curve, resume_from=1)
    ckpt = tmp_path / "checkpoint-000001"
    ckpt.mkdir()
    for garbage, fragment in [(b"\xff{not json", "cannot be read as JSON"), (b"[1]", "holds a list")]:
        (ckpt / "state.json").write_bytes(garbage)
        with pytest.raises(CheckpointError, match=fragment) as e:
            Checkpoint(ckpt, 1).state()
        assert "\n" not in str(e.value)
    failure = _failure("jagg-s0", 1, deque(["Traceback …", f"jagg: error: {e.value}", "CalledProcessError: …"]))
    assert type(failure) is TrainingError and "state.json holds a list" in str(failure)
    carried = _failure("jagg-s0", 1, deque(["jagg: error class: jagg_core.trainer.checkpoint:CheckpointError",
                                            f"jagg: error: {e.value}"]))
    assert type(carried) is CheckpointError and "state.json holds a list" in str(carried)  # the worker's own class

    class State:  # what Prefect's retry condition sees
        def result(self, raise_on_failure=True):
            raise failure

    assert not _retryable(None, None, State())
    assert isinstance(_failure("jagg-s0", -9, deque(["killed"])), WorkerDied)


def test_a_workers_python_error_reaches_its_launcher_as_an_error_not_a_death(capsys):
    from collections import deque

    from tasks.launch import report_error_class
    from tasks.train import WorkerDied, _failure

    with pytest.raises(TypeError):
        with report_error_class():
            raise TypeError("unsupported operand type(s) for -: 'str' and 'float'")
    tail = deque(["Traceback (most recent call last):", *capsys.readouterr().err.splitlines(),
                  "subprocess.CalledProcessError: Command '[...]' returned non-zero exit status 1."])
    failure = _failure("jagg-s0", 1, tail)
    assert not isinstance(failure, WorkerDied) and "TypeError" in str(failure)
    assert isinstance(_failure("jagg-s0", -9, deque(["Killed"])), WorkerDied)  # a death is still retried


def test_c2_a_workers_error_behind_a_long_traceback_is_its_own_not_a_death(ci_project, monkeypatch):
    """A real `accelerate launch` whose worker raises a PermissionError deep in the trainer (as under a read-only
    checkpoint folder): its traceback and accelerate's own lines are longer than the 30 lines the launcher keeps, so
    the "jagg: worker error" line printed before them scrolled away and the failure was a WorkerDied, retried twice
    under `jagg run`. The worker's outcome file says what it was: a TrainingError naming the PermissionError.
    (Through `accelerate launch`, as several processes start: one process starts without it, and its own traceback
    alone is shorter than 30 lines; tests/test_worker_errors.py has a worker's error on that path.)"""
    import logging

    from jagg_core.setup.paths import Layout
    from jagg_core.trainer import TrainingError
    from jagg_core.trainer.fingerprint import run_fingerprint
    from tasks.launch import Machine, write_context
    from tasks.train import WorkerDied, _launch_workers, _retryable

    params = load_params(ci_project / "params.yaml", "ci", {"train.iterations": 1})
    lay = Layout.of(params, ci_project)
    context = lay.run_dir("jagg-s0") / ".worker-context-test.json"
    write_context(context, params, lay, "", run_fingerprint(params, lay, "jagg", 0))
    monkeypatch.setenv("JAGG_FAULT", "rollout@1:eacces")
    lines = []

    class Log:
        def info(self, fmt, *args):
            lines.append(fmt % args)

    import tasks.train

    tails = []

    def launch(*args, **kwargs):  # the real launch; its tail (the last 30 lines) kept for the check below
        rc, tail = real_launch(*args, **kwargs)
        tails.append(tail)
        return rc, tail

    real_launch = tasks.train.launch
    monkeypatch.setattr(tasks.train, "launch", launch)
    monkeypatch.setattr(tasks.train, "without_launcher", lambda cmd, env: None)
    with pytest.raises(TrainingError) as e:
        _launch_workers(params, lay, "jagg", 0, Machine(), context, Log())
    assert not isinstance(e.value, WorkerDied), e.value
    assert "PermissionError" in str(e.value) and "Permission denied (injected)" in str(e.value), e.value
    assert any("jagg: worker error: PermissionError" in line for line in lines)  # printed, then scrolled away:
    assert not any("jagg: worker error" in line for line in tails[0]), "the traceback was short: proves nothing"

    class State:  # what Prefect's retry condition sees
        def result(self, raise_on_failure=True):
            raise e.value

    assert not _retryable(None, None, State())
    assert not list(context.parent.glob(context.name + ".outcome-*"))  # read and removed


def test_c2_a_launch_without_an_outcome_is_a_death_and_outcomes_are_bounded(tmp_path):
    """No outcome file (killed, out of memory): a WorkerDied, the one error retried; a user error's outcome is its
    own class; a garbage or huge outcome file is no outcome."""
    from collections import deque

    from jagg_core.trainer.checkpoint import CheckpointError
    from tasks.launch import outcome_file, read_outcome, report_error_class
    from tasks.train import WorkerDied, _failure

    context = tmp_path / "ctx.json"
    with pytest.raises(CheckpointError):
        with report_error_class(context):
            raise CheckpointError("checkpoint 3 is damaged; move it aside.")
    outcome = read_outcome(context)
    failure = _failure("jagg-s0", 1, deque(["x"] * 30), outcome)
    assert type(failure) is CheckpointError and "checkpoint 3 is damaged" in str(failure)
    assert read_outcome(context) is None  # removed once read
    outcome_file(context, 1).write_bytes(b"\xff{garbage")
    outcome_file(context, 2).write_text('{"kind": "user", "class": "os:system", "message": "' + "x" * 100_000 + '"}')
    assert read_outcome(context) is None
    assert isinstance(_failure("jagg-s0", -9, deque(["Killed"]), None), WorkerDied)


def test_c8_the_launcher_shows_the_workers_sentence_not_accelerates_traceback(ci_project, monkeypatch):
    """A real `accelerate launch` (as several processes start; one starts without it) whose worker stops on a user
    error (a prompt file it cannot use): what the launcher relays is the worker's one sentence; accelerate's 10-line
    `CalledProcessError` traceback ("[run] Traceback …") and the class line meant for the launcher are not shown."""
    import tasks.train

    from jagg_core.setup.paths import Layout
    from jagg_core.setup.storage import PromptFileError
    from jagg_core.trainer.fingerprint import run_fingerprint
    from tasks.launch import Machine, write_context
    from tasks.train import _launch_workers

    params = load_params(ci_project / "params.yaml", "ci")
    lay = Layout.of(params, ci_project)
    context = lay.run_dir("jagg-s0") / ".worker-context-test.json"
    write_context(context, params, lay, "", run_fingerprint(params, lay, "jagg", 0))
    _write_prompts(lay, "")
    lines = []

    class Log:
        def info(self, fmt, *args):
            lines.append(fmt % args)

    monkeypatch.setattr(tasks.train, "without_launcher", lambda cmd, env: None)
    with pytest.raises(PromptFileError, match="is an empty prompt"):
        _launch_workers(params, lay, "jagg", 0, Machine(), context, Log())
    shown = "\n".join(lines)
    assert "is an empty prompt" in shown, shown
    assert "Traceback" not in shown and "CalledProcessError" not in shown and "error class" not in shown, shown


_ACCELERATE = """
import os, signal, subprocess, sys
# as accelerate's simple_launcher: its one worker (here, one that is SIGKILLed) run with check, the error re-raised
cmd = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "--worker-context",
       "/tmp/x/runs/ci/jagg-s0/.worker-context-1.json"]
process = subprocess.Popen(cmd)
process.wait()
raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)
"""


def test_m7_a_sigkilled_worker_is_one_plain_sentence():
    """A SIGKILLed worker's failure relayed accelerate's last line, "subprocess.CalledProcessError: Command '[…the
    worker's whole command…]' died with <Signals.SIGKILL: 9>.". Now the sentence says which signal, what it usually
    means and what a rerun does; it is still a death (retried), and the command line is not in it."""
    from collections import deque

    from tasks.train import WorkerDied, _failure

    out = subprocess.run([sys.executable, "-c", _ACCELERATE], capture_output=True, text=True, timeout=60)
    tail = deque(out.stderr.splitlines(), maxlen=30)
    assert out.returncode == 1 and "CalledProcessError" in tail[-1], out.stderr  # what accelerate leaves
    failure = _failure("jagg-s0", out.returncode, tail)
    assert isinstance(failure, WorkerDied)
    text = _one_sentence(str(failure))
    assert "SIGKILL" in text and "out of memory" in text and "resumes from its last complete checkpoint" in text, text
    assert "CalledProcessError" not in text and "worker-context" not in text and "Command" not in text, text
    # torchrun's report of several processes, and a worker that exited with a status of its own
    elastic = deque(["  exitcode  : -9 (pid: 4242)", "  error_file: <N/A>",
                     "  traceback : Signal 9 (SIGKILL) received by PID 4242", "=" * 60])
    assert "killed by SIGKILL" in str(_failure("jagg-s0", 1, elastic))
    exited = deque(["subprocess.CalledProcessError: Command '['python', '-m', 'tasks.train']' returned non-zero exit "
                    "status 3."])
    assert "exited with status 3" in str(_failure("jagg-s0", 1, exited))


def test_m1_the_workers_outcome_and_context_files_replace_a_planted_link(tmp_path):
    """A symlink planted at `runs/ci/jagg-s9/.worker-context-*.json.outcome-<pid>` was opened O_CREAT|O_TRUNC and
    its target overwritten with the worker's outcome; the context file (params, maybe credentials) was written the
    same way. Both now go through the one writing function: the link is replaced, its target untouched, the file
    is the owner's alone (0600)."""
    from jagg_core.errors import UserError
    from jagg_core.setup.paths import Layout
    from tasks.launch import outcome_file, read_outcome, report_error_class, write_context

    run_dir = tmp_path / "project" / "runs" / "ci" / "jagg-s9"
    run_dir.mkdir(parents=True)
    context = run_dir / ".worker-context-4242.json"
    victims = {name: tmp_path / name for name in ("outcome-victim", "context-victim")}
    for v in victims.values():
        v.write_text("precious\n")
    outcome_file(context).symlink_to(victims["outcome-victim"])
    context.symlink_to(victims["context-victim"])

    params = load_params(PARAMS, "ci")
    write_context(context, params, Layout.of(params, tmp_path / "project"), "", "")
    with pytest.raises(UserError):
        with report_error_class(context):
            raise UserError("the run's own error")
    assert {k: v.read_text() for k, v in victims.items()} == {k: "precious\n" for k in victims}
    for path in (context, outcome_file(context)):
        assert not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600, path
    assert json.loads(context.read_text())["root"] == str(tmp_path / "project")
    assert read_outcome(context)["message"] == "the run's own error"


@pytest.mark.timeout(30)
def test_m2_a_fifo_at_the_workers_outcome_file_does_not_block_the_launcher(tmp_path):
    """A FIFO at the outcome file's path blocked `train` for good after its last iteration (a plain `open`). Now it
    is no outcome (as a death leaves none), read at once, and removed like any outcome file."""
    import time

    from tasks.launch import outcome_file, read_outcome

    context = tmp_path / ".worker-context-4242.json"
    os.mkfifo(outcome_file(context, pid=1))
    (outcome_file(context, pid=2)).write_text(json.dumps({"kind": "worker", "class": "TypeError", "message": "m"}))
    os.mkdir(outcome_file(context, pid=3))  # a folder there is no outcome either (and no traceback)
    t0 = time.monotonic()
    assert read_outcome(context) == {"kind": "worker", "class": "TypeError", "message": "m"}
    assert time.monotonic() - t0 < 5
    assert not outcome_file(context, pid=1).exists() and not outcome_file(context, pid=2).exists()
