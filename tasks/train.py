"""Stage `train@<method>-s<seed>`: one GRPO training run, launched through `accelerate launch`.

The stage function starts ``accelerate launch [...] -m tasks.train --worker-context FILE`` with the profile's process
count, the method's own ``CUDA_VISIBLE_DEVICES`` and rendezvous port (so methods can share a machine on GPU partitions),
and streams the workers' output into the Prefect log (one process on one machine starts as accelerate's simple launcher
would start it, without that launcher's own process: :func:`tasks.launch.without_launcher`). FILE (readable by its owner
only, removed when the run ends) carries the launcher's validated params, the repository root and the MLflow run to the
workers, so every rank trains exactly the same config and no credential in the params shows on a command line. The
worker (rank 0) writes every metric and image it logs to the run's stream, which the launcher sends to the run's
MLflow child run as it comes (the workers import no MLflow). A killed run resumes from its last complete checkpoint
when started again (the Prefect task retries a run whose process died; a run that stopped with an error of its own is
not retried).

Multi-node (``resources.num_machines`` > 1): every machine starts the same ``jagg train --method M --seed S`` with its
own ``--machine-rank`` (or ``JAGG_MACHINE_RANK``) and the rank-0 machine's ``--main-process-ip`` (or
``JAGG_MAIN_PROCESS_IP``). Machine 0 keeps the MLflow run and writes what only one process writes; the others start
only their workers. The project folder (prompts, checkpoints) must be one path every machine sees.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections import deque
from pathlib import Path

from jagg_core.errors import UserError
from jagg_core.setup.config import Params, ParamsError
from jagg_core.setup.paths import Layout, run_name
from jagg_core.trainer import TrainingError

from jagg_core.trainer.fingerprint import run_fingerprint

from .common import (DEFAULT_SWEEP, add_common_args, add_sweep_arg, cli, layout, load, orchestration_tags,
                     parse_overrides, retry_only_died, stage_logger)
from .launch import (Machine, accelerate_command, clear_outcomes, death, die_with_parent, error_class, launch,
                     local_context, read_context, read_outcome, remove_stale_contexts, report_error_class,
                     stop_on_signals, user_error, user_error_class, without_launcher, worker_error, write_context)
from jagg_core.pipeline.tracking import RecordStream, StreamForwarder, Tracker, TrackingError
from jagg_core.setup.faults import fault
from jagg_core.setup.storage import LockedError, PromptFileError, read_prompts
from jagg_core.world import parse_prompt, shown_prompt


class WorkerDied(TrainingError):
    """The training process ended without an error of its own (killed, out of memory, a crash): a retry resumes."""

    process_died = True  # tasks/launch.py:retry_only_died retries this, and nothing else


def pending_file(lay: Layout, run: str) -> Path:
    """Where a training run buffers what it could not log while the MLflow store was unreachable."""
    return lay.run_dir(run) / "mlflow-pending.jsonl"


def stream_file(lay: Layout, run: str) -> Path:
    """Where a training run's rank-0 worker writes what it logs, for its launcher to send to MLflow."""
    return lay.run_dir(run) / "mlflow-stream.jsonl"


def _replay_pending(logger, run: str, log) -> None:  # noqa: ANN001  (the run's MlflowLogger)
    """Send what the run buffered during an outage of the store (``logger``: the launcher's ``once`` logger on the
    run's pending file, so a replay cut by a kill is not sent twice); if the store is still down, say what waits
    where."""
    waiting = logger.pending()
    if not waiting:
        return
    try:
        log.info("%s: sending %d records buffered while the MLflow store was unreachable", run, logger.flush())
    except TrackingError as e:
        raise TrackingError(f"training run {run} finished, but {logger.pending()} records wait in "
                            f"{logger.buffer} for the MLflow store ({e}); run the stage again when the store "
                            f"is back: it sends them and does not train again.") from None


def checkpoint_tags(lay: Layout, run: str, last=None) -> dict[str, str]:  # noqa: ANN001  (a Checkpoint)
    """Where a run's last checkpoint is (``last``, or the newest one that verifies) and the SHA-256 of its manifest
    (which holds every file's SHA-256)."""
    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.trainer.checkpoint import file_sha256, latest_checkpoint

    if last is None:
        last = latest_checkpoint(lay.checkpoints(run))  # older checkpoints are not read
    if last is None:
        return {}
    return {"jagg.checkpoint": str(last.path.relative_to(lay.root)), "jagg.checkpoint_iteration": str(last.iteration),
            "jagg.checkpoint_manifest_sha256": file_sha256(last.path / "manifest.json")}


def _launch_workers(params: Params, lay: Layout, method: str, seed: int, machine: Machine, context: Path,
                    log) -> None:  # noqa: ANN001
    """`accelerate launch` this machine's workers of the run, which read ``context`` (the caller removes it)."""
    run = run_name(method, seed)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if method in params.resources.cuda_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = params.resources.cuda_visible_devices[method]
    worker = ["--profile", params.profile, "--method", method, "--seed", str(seed), "--worker-context", str(context)]
    cmd = accelerate_command(params, method, worker, machine)
    direct = without_launcher(cmd, env)  # one process: the worker itself, as accelerate's simple launcher starts it
    if direct:
        cmd, env = direct
    n = params.resources.num_machines
    where = f" as machine {machine.rank} of {n} (rank 0 at {machine.address})" if n > 1 else ""
    log.info("launching %s%s: %s", run, where, " ".join(cmd[:14]) + " ...")
    clear_outcomes(context)
    try:
        rc, tail = launch(cmd, lay, env, run, log)
    finally:
        outcome = read_outcome(context)  # what a worker said of its own error, whatever it printed after it
    if rc != 0:
        raise _failure(run, rc, tail, outcome, direct=direct is not None)


def check_train_prompts(params: Params, lay: Layout) -> None:
    """Before any worker starts: the training prompts read (one sentence for an empty prompt or a lone surrogate)
    and, on the toy world, each one a prompt of its grammar (``""``, 10,000 characters of anything: one sentence
    naming the line, not a worker's traceback)."""
    prompts = read_prompts(lay.train_prompts)
    if not params.is_toy:
        return

    for n, prompt in enumerate(prompts, 1):
        try:
            parse_prompt(prompt)
        except ValueError:
            raise PromptFileError(f"{lay.train_prompts}: prompt {n} {shown_prompt(prompt)} is not a prompt of the toy "
                                  f"world's grammar; regenerate the file with `jagg prepare`.") from None


def _failure(run: str, rc: int, tail: deque, outcome: dict | None = None, direct: bool = False) -> TrainingError:
    """What a failed launch raises: the worker's own error from its outcome file (:func:`tasks.launch.read_outcome`),
    which no output can scroll away; without one, what its last lines say; else a death (the one error retried).
    ``direct``: the process launched was the worker itself (:func:`tasks.launch.without_launcher`), so ``rc`` is its
    own exit status."""
    if outcome and outcome["kind"] == "user":  # the run's own error, as its own class (never retried)
        cls = user_error_class(outcome["class"], TrainingError)
        return (TrainingError if issubclass(cls, WorkerDied) else cls)(f"training run {run} failed: "
                                                                       f"{outcome['message']}")
    if outcome:  # a Python error the worker raised (a TypeError, a read-only folder): not a death, never retried
        return TrainingError(f"training run {run} failed in its worker with {outcome['class']}: "
                             f"{outcome['message']}")
    error = user_error(tail)
    if error:  # the run's own error, as its own class: the same input fails the same way again (never retried)
        cls = error_class(tail, TrainingError)
        return (TrainingError if issubclass(cls, WorkerDied) else cls)(f"training run {run} failed: {error}")
    own = worker_error(tail)
    if own:  # a Python error the worker raised (a TypeError, a read-only folder): not a death, never retried
        return TrainingError(f"training run {run} failed in its worker with {own}")
    return WorkerDied(f"training run {run} failed: {death(rc, tail, direct)}; running it again resumes from its last "
                      f"complete checkpoint.")


def _trained(lay: Layout, run: str, params: Params, key: str | None = None):  # noqa: ANN202  (a Checkpoint or None)
    """The run's last checkpoint if it is trained: its newest checkpoint verifies, is its last, and was written with
    these params (and, given ``key``, this fingerprint; another machine compares the params only: its local copy of
    the base model may differ in file times); else None."""
    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.trainer.checkpoint import latest_checkpoint, list_checkpoints

    listed = list_checkpoints(lay.checkpoints(run), check=False)
    if not listed or listed[-1].iteration < params.train.iterations:
        return None  # still training: no file is hashed here (the worker verifies what it resumes from)
    last = latest_checkpoint(lay.checkpoints(run))  # verified: a damaged last checkpoint is not "trained"
    if last is None or last.iteration < params.train.iterations:
        return None
    state = last.state()
    if key is not None:
        return last if state.get("run_key") == key else None
    same = json.dumps(state.get("params"), sort_keys=True) == json.dumps(params.redacted(), sort_keys=True)
    return last if same else None


def train_run(params: Params, lay: Layout, method: str, seed: int, *, sweep: str = DEFAULT_SWEEP,
              restart: bool = False, machine: Machine | None = None, take_over: bool = False) -> dict:
    """Run one training run to completion (resuming if checkpoints exist); returns its final metrics.

    On a run that spans several machines, ``machine`` (default: from the environment) says which one this is: rank 0
    keeps the MLflow run; the others only take their share of the training. ``take_over``: the run's MLflow run may
    be left RUNNING by a process of another host that crashed (a pool-dispatched unit resubmitted): take it once
    that owner has missed two heartbeats.
    """
    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.build import check_model_files
    from jagg_core.rewards import check_rewards

    log = stage_logger("train")
    lay.checkpoints(run_name(method, seed))  # its folders held inside the project (paths.held): a link leading out
    lay.run_dir(run_name(method, seed))  # is refused before any work
    check_rewards(params.reward.weights, params.reward.options, params.eval.metrics)  # before any model loads
    check_train_prompts(params, lay)
    check_model_files(params, lay)  # the weights' files, before any worker starts
    machine = machine or Machine.resolve(params)
    run = run_name(method, seed)
    key = run_fingerprint(params, lay, method, seed)
    if machine.rank > 0:
        return _follow(params, lay, method, seed, key, machine, restart, log)
    tracker = Tracker(params, lay.root)  # fails here, before any training, if the store is unreachable
    mlflow_run = tracker.child_run(sweep, run, method=method, seed=seed, key=key, extra_tags=orchestration_tags())
    # Another live process trains it: this one neither trains nor ends its run. An owner that cannot be checked from
    # here (another host's) is taken over once its heartbeat is stale, at once with --restart, and after two missed
    # heartbeats with ``take_over`` (a pool-dispatched unit submitted again after Prefect saw its flow run crash:
    # flows/pool.py).
    if not tracker.claim(mlflow_run, take_over=restart, crashed=take_over):
        raise LockedError(tracker.held_sentence(run, mlflow_run))
    # From here on, whatever ends the command (SIGTERM in the next half second, an error) ends the run as well.
    with tracker.ending(mlflow_run), tracker.heartbeat(mlflow_run):
        fault("run_created", 0)  # the reliability tests' SIGTERM in the half second after the run is created
        return _train_rank0(params, lay, method, seed, machine, restart, log, tracker, mlflow_run, key, run)


def _train_rank0(params: Params, lay: Layout, method: str, seed: int, machine: Machine, restart: bool, log,  # noqa: ANN001
                 tracker, mlflow_run: str, key: str, run: str) -> dict:  # noqa: ANN001
    logger = tracker.logger(mlflow_run, buffer=pending_file(lay, run), once=True)
    forwarder = StreamForwarder(logger, stream_file(lay, run))
    forwarder.close()  # what a start that was stopped left in the run's stream is sent first
    last = _trained(lay, run, params, key)
    if last is not None:
        # Trained already (its last checkpoint verified, with these params): no worker is launched to find that out
        # (`dvc repro` after `jagg run` runs every train stage once; on several machines, launching would wait for
        # machines that have nothing to do). What the run buffered during an outage of the store is still sent.
        log.info("%s is trained (its last checkpoint, iteration %d, verified; train.iterations is %d): not launching "
                 "it again", run, last.iteration, params.train.iterations)
    else:
        machine.check_address(params)
        remove_stale_contexts(lay.run_dir(run), ".worker-context-*.json")
        context = lay.run_dir(run) / f".worker-context-{os.getpid()}.json"
        try:  # an error ends the run FAILED, Ctrl-C or SIGTERM (through stop_on_signals) KILLED: Tracker.ending
            write_context(context, params, lay, mlflow_run, key, restart)
            # The rank-0 worker writes what it logs to the run's stream; this process sends it to the MLflow run,
            # and samples the machine (CPU, memory, GPU) into it
            monitor = tracker.system_metrics(mlflow_run)
            try:
                with forwarder.running():
                    _launch_workers(params, lay, method, seed, machine, context, log)
            finally:
                if monitor is not None:
                    monitor.finish()
        finally:
            context.unlink(missing_ok=True)
    _replay_pending(logger, run, log)  # the forwarder's logger: what it knows the run holds, not read again
    tracker.set_tags(mlflow_run, checkpoint_tags(lay, run, last))
    tracker.finish(mlflow_run)
    return {"run": run, "mlflow_run_id": mlflow_run, "curve": str(lay.curve(run))}


def _follow(params: Params, lay: Layout, method: str, seed: int, key: str, machine: Machine, restart: bool,
            log) -> dict:  # noqa: ANN001
    """Machine rank ≥ 1: this machine's processes of the run, nothing else (rank 0 logs, checkpoints, evaluates)."""
    run = run_name(method, seed)
    if _trained(lay, run, params) is not None:
        log.info("%s is trained (%d iterations); nothing to do on machine %d", run, params.train.iterations,
                 machine.rank)
        return {"run": run, "machine_rank": machine.rank}
    machine.check_address(params)
    # The context goes to this machine's own temporary folder: the shared run folder is tidied by machine 0, which
    # cannot see this machine's processes.
    context = local_context(f"{run}-m{machine.rank}")
    try:
        write_context(context, params, lay, "", key, restart)
        _launch_workers(params, lay, method, seed, machine, context, log)
    finally:
        context.unlink(missing_ok=True)
    return {"run": run, "machine_rank": machine.rank}


def worker(params: Params, lay: Layout, method: str, seed: int, *, mlflow_run: str | None = None,
           run_key: str | None = None, restart: bool = False) -> None:
    """Inside `accelerate launch`: train, logging to the MLflow run named by the launcher (rank 0 logs)."""
    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.trainer import train

    logger = None
    # The trainer's progress lines go to stdout, which the launcher relays to its log (and Prefect's).
    trainer_log = logging.getLogger("jagg_core")
    if not trainer_log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        trainer_log.addHandler(handler)
    trainer_log.setLevel(logging.INFO)
    trainer_log.propagate = False
    if mlflow_run and int(os.environ.get("RANK", "0")) == 0:  # accelerate sets RANK
        # The launcher holds the MLflow run: what this process logs goes to the run's stream, which the launcher
        # sends as it comes (a store that goes down is buffered there; a resumed run's steps the MLflow run holds
        # are not sent twice). This process imports no MLflow.
        logger = RecordStream(stream_file(lay, run_name(method, seed)), mlflow_run)
    train(params, method, seed, root=lay.root, logger=logger, run_key=run_key, progress=sys.stderr.isatty(),
          restart=restart)


def _retryable(task, task_run, state) -> bool:  # noqa: ANN001  (Prefect's retry_condition_fn signature)
    """Retry only a run whose process died (it resumes from its checkpoint); an error of the run's own — a bad
    parameter, a damaged checkpoint, a diverged loss — would fail the same way again."""
    return retry_only_died(task, task_run, state)


def train_stage(params: Params, method: str, seed: int, sweep: str = DEFAULT_SWEEP, restart: bool = False,
                take_over: bool = False) -> dict:
    """A training run; a retry (only after its process died) resumes from the last complete checkpoint."""
    return train_run(params, layout(params), method, seed, sweep=sweep, restart=restart, take_over=take_over)




@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg train", description=__doc__.splitlines()[0])
    add_common_args(ap)
    add_sweep_arg(ap)
    ap.add_argument("--method", required=True, help="a method defined under `methods` in params.yaml")
    ap.add_argument("--seed", type=int, default=None, help="training seed (default: the first of run.seeds)")
    ap.add_argument("--restart", action="store_true",
                    help="if the run's checkpoints were written with other params, move them aside and start over "
                         "(without it, such a run stops and says what changed); also take over an MLflow run left "
                         "RUNNING by an owner this machine cannot check (another host's)")
    ap.add_argument("--worker", action="store_true",
                    help="train in this process (e.g. inside your own `accelerate launch`), without an MLflow run")
    ap.add_argument("--worker-context", default=None, help=argparse.SUPPRESS)  # written by the launcher
    multi = ap.add_argument_group(
        "multi-node", "a run over resources.num_machines machines: start the same command on every machine, each with "
                      "its own rank; checkpoints and prompts must be on a path every machine sees")
    multi.add_argument("--machine-rank", type=int, default=None,
                       help="this machine's rank, 0 (runs MLflow) to num_machines - 1 (default: $JAGG_MACHINE_RANK or 0)")
    multi.add_argument("--main-process-ip", default=None,
                       help="the rank-0 machine's address (default: $JAGG_MAIN_PROCESS_IP)")
    multi.add_argument("--main-process-port", type=int, default=None,
                       help="rendezvous port (default: $JAGG_MAIN_PROCESS_PORT, else resources.main_process_port + the "
                            "method's index)")
    args = ap.parse_args(argv)
    if args.worker_context:  # a worker started by train_run: the launcher's validated params
        die_with_parent(signal.SIGTERM)  # a killed launcher (accelerate, or jagg train) takes its workers with it
        params, lay, ctx = read_context(args.worker_context)
        with report_error_class(args.worker_context):  # its own error reaches the launcher as its own class
            worker(params, lay, args.method, args.seed, mlflow_run=ctx["mlflow_run"], run_key=ctx["run_key"],
                   restart=ctx.get("restart", False))
        return 0
    params = load(args.profile, args.params, parse_overrides(args.overrides))
    seed = params.run.seeds[0] if args.seed is None else args.seed
    if not 0 <= seed <= 2**31 - 1:  # as run.seeds: a negative seed names no run ('jagg-s-1') and seeds nothing
        raise ParamsError(f"--seed {seed} must be a whole number from 0 to {2**31 - 1}.")
    params.method(args.method)  # an unknown method fails here, before anything starts
    if args.worker:
        check_train_prompts(params, layout(params))
        worker(params, layout(params), args.method, seed, restart=args.restart)
    else:
        machine = Machine.resolve(params, args.machine_rank, args.main_process_ip, args.main_process_port)
        stop_on_signals()
        train_run(params, layout(params), args.method, seed, sweep=args.sweep, restart=args.restart, machine=machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
